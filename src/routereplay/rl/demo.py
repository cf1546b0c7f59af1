"""The main job: rollouts from the built-in engine, scored by the trainer with and without R3.

The engine (bf16) samples answers to addition prompts and returns its log-probs and routes, as vLLM
would. The trainer (fp32) then scores the same tokens twice:
- `off`: its routers choose freely;
- `R3`: it replays the engine's routes.
For each mode the record holds routing agreement against the engine's routes and the log-prob
mismatch against the engine's log-probs (`routereplay.metrics`). `run_demo` returns the record that
`routereplay demo --json` prints and that `report.write_report` draws. Legend: B = sequences,
S = positions, L = layers, K = top-k.

`engine="vllm"` samples with a real vLLM running in this process (`engines.vllm.colocated`) instead
of the built-in engine: the demo model is then its vLLM-servable variant (`rl.model.vllm_overrides`:
head_dim 64), or `model=`. One vLLM engine serves the comparison and every GRPO step (weights synced
at each step, so each mode starts from the same weights). The record has the same keys either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from routereplay.engines.hf import HFEngine
from routereplay.errors import ConfigError
from routereplay.metrics import logprob_mismatch, routing_agreement
from routereplay.rl.model import Arch, load_checkpoint, load_or_train
from routereplay.rl.scoring import ScoredBatch, batch_of, engine_logprobs, engine_routes, logprobs_of, score
from routereplay.rl.tasks import AdditionTask
from routereplay.runtime import attach
from routereplay.threads import ThreadPolicy

Progress = Callable[[str, int, int], None]  # (phase, done, total); every phase is reported up to its total
SCORING = "scoring (trainer, off then R3)"
THRESHOLD_MODE = "R3-threshold"  # `DemoConfig.threshold`: R3 kept only within the margin (runtime/threshold.py)
ENGINES = ("hf", "vllm")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    arch: str = Arch.QWEN3_MOE.value
    model: str | None = None  # a local HF MoE checkpoint instead of the demo model
    prompts: int = 2048
    max_new_tokens: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    train_steps: int = 800
    rl_steps: int = 3  # GRPO steps per mode (off, R2, R3) for the per-step comparison; 0 skips it
    engine_dtype: str = "bfloat16"
    trainer_dtype: str = "float32"
    threads: int | None = None  # intra-op threads (None: OMP_NUM_THREADS if set, else 1; routereplay.threads)
    engine: str = "hf"  # "hf": the built-in engine; "vllm": a real vLLM in this process (routereplay[vllm])
    threshold: float | None = None  # also score mode "R3-threshold": replay(threshold=...) with its replace rate

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"DemoConfig.engine={self.engine!r} must be one of {ENGINES}")


def run_demo(config: DemoConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The demo record (see the module docstring), computed with `config.threads` intra-op threads;
    the caller's torch thread count is restored afterwards."""
    with ThreadPolicy(threads=config.threads).applied():
        return _run_demo(config, progress)


def _run_demo(config: DemoConfig, progress: Progress | None) -> dict[str, Any]:
    report = progress or (lambda _phase, _done, _total: None)
    if config.engine == "vllm":
        from routereplay.engines.vllm.colocated import import_vllm

        import_vllm()  # MissingDependencyError naming the extra, before any training
    if config.model is not None:
        report("loading --model", 0, 1)
        model, tokenizer = load_checkpoint(config.model)
        report("loading --model", 1, 1)
        source = f"--model {config.model}"
    else:
        model, tokenizer, source = load_or_train(
            config.arch,
            steps=config.train_steps,
            progress=lambda step, steps, _loss: report("training the demo model (cached after this run)", step, steps),
            threads=config.threads,
            vllm=config.engine == "vllm",
        )
    model = model.to(getattr(torch, config.trainer_dtype)).eval()
    engine = _engine(model, tokenizer, config)
    try:
        return _compare(model, tokenizer, engine, source, config, report)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()


def _engine(model: torch.nn.Module, tokenizer: Any, config: DemoConfig) -> Any:
    """The rollout engine: the built-in one, or a vLLM in this process serving `model`'s weights."""
    dtype = getattr(torch, config.engine_dtype)
    if config.engine == "hf":
        return HFEngine(model, dtype=dtype, policy_version=0)
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine

    return VLLMEngine(model, tokenizer, config=EngineConfig(dtype=dtype, seed=config.seed), policy_version=0)


def _compare(
    model: torch.nn.Module, tokenizer: Any, engine: Any, source: str, config: DemoConfig, report: Progress
) -> dict[str, Any]:
    task = AdditionTask(tokenizer)
    problems = task.problems(config.prompts, seed=config.seed + 1)
    params = task.sampling(
        max_new_tokens=config.max_new_tokens, seed=config.seed, temperature=config.temperature, top_p=config.top_p
    )
    # one unit per phase, the engine's own: the built-in engine counts sampled tokens, vLLM finished prompts
    report("sampling (engine)", 0, config.prompts if config.engine == "vllm" else config.max_new_tokens)
    rollouts = engine.generate(
        task.prompt_ids(problems), params, progress=lambda done, total: report("sampling (engine)", done, total)
    )
    rewards = [task.reward(p, r.response_ids) for p, r in zip(problems, rollouts, strict=True)]
    replayer = attach(model)
    modes: dict[str, dict[str, Any]] = {}
    deltas: dict[str, list[float]] = {}
    scorings = [("off", False), ("R3", True)] + ([(THRESHOLD_MODE, True)] if config.threshold is not None else [])
    for index, (mode, replay) in enumerate(scorings):
        report(SCORING, index, len(scorings))  # one phase for every mode, so its bar reaches its total
        replayer.stats.reset()
        if mode == THRESHOLD_MODE:
            scored = thresholded_score(model, rollouts, task.pad_token_id, replayer, config)
        else:
            scored = score(
                model, rollouts, task.pad_token_id, replayer=replayer, replay=replay, temperature=config.temperature
            )
        infer_BS = engine_logprobs(rollouts, scored.ids_BS.shape)
        engine_BSLK = engine_routes(rollouts, scored.ids_BS.shape, len(replayer.layers), replayer.top_k)
        assert scored.routes_BSLK is not None
        routing = routing_agreement(scored.routes_BSLK, engine_BSLK, scored.mask_BS.bool())
        mismatch = logprob_mismatch(scored.logprobs_BS, infer_BS, scored.response_BS, tau=2.0)
        modes[mode] = {**routing, **mismatch, "fallback_rows": replayer.stats.fallback_rows}
        if mode == THRESHOLD_MODE:  # rows the threshold gave back to the live router, overall and per layer
            modes[mode]["replace_rate"] = replayer.stats.replace_rate
            modes[mode]["replaced_rows_by_layer"] = dict(replayer.stats.replaced_rows_by_layer)
        deltas[mode] = (scored.logprobs_BS - infer_BS)[scored.response_BS].tolist()
    report(SCORING, len(scorings), len(scorings))
    replayer.detach()
    steps: list[dict[str, Any]] = []
    if config.rl_steps:
        # R2 replays the trainer's own routing: its old-log-prob pass routes naturally, so against the
        # engine it measures exactly like `off`; it differs in the updates (drift), measured below
        modes = {"off": modes["off"], "R2": dict(modes["off"]), **{m: r for m, r in modes.items() if m != "off"}}
        deltas["R2"] = deltas["off"]
        steps = _rl_comparison(model, task, config, report, None if config.engine == "hf" else engine)
        for mode, record in modes.items():
            rows = [row for row in steps if row["mode"] == mode]
            if not rows:  # R3-threshold scores the rollouts only (no GRPO run of its own)
                continue
            record["update_drift"] = sum(row["drift"] for row in rows) / len(rows)
            record["update_routing_disagreement"] = sum(row["routing_disagreement"] for row in rows) / len(rows)
    text_config = model.config.get_text_config()  # type: ignore[union-attr, operator]
    return {
        "config": asdict(config),
        "model": {
            "model_type": text_config.model_type,
            "layers": list(replayer.layers),
            "num_experts": replayer.num_experts,
            "top_k": replayer.top_k,
            "parameters": sum(p.numel() for p in model.parameters()),
            "source": source,
        },
        "rollouts": {
            "sequences": len(rollouts),
            "response_tokens": sum(len(r.response_ids) for r in rollouts),
            "reward_mean": sum(rewards) / len(rewards),
        },
        "modes": modes,
        "dlogp": deltas,
        "steps": steps,
    }


def thresholded_score(
    model: torch.nn.Module, rollouts: Any, pad_token_id: int, replayer: Any, config: DemoConfig
) -> ScoredBatch:
    """The trainer's log-probs replaying the engine's traces with `replay(threshold=config.threshold)`."""
    batch = batch_of(rollouts, pad_token_id)
    with (
        torch.no_grad(),
        replayer.replay(batch.traces, batch.mask_BS, input_ids=batch.ids_BS, threshold=config.threshold) as used,
    ):
        logprobs_BS = logprobs_of(model, batch, config.temperature)
    return ScoredBatch(batch.ids_BS, batch.mask_BS, batch.response_BS, logprobs_BS, used.routes)


def _rl_comparison(
    model: torch.nn.Module, task: AdditionTask, config: DemoConfig, report: Progress, shared: Any = None
) -> list[dict[str, Any]]:
    """A few GRPO steps from the same start in each mode; one row per (mode, step).

    `shared`: an engine with `sync_weights` used by every mode (GRPO syncs the mode's policy into it
    before each step, so each mode starts from `model`'s weights); None: a built-in engine per mode."""
    import copy

    from routereplay.rl.grpo import GRPOConfig, GRPOTrainer

    rows: list[dict[str, Any]] = []
    for mode in ("off", "R2", "R3"):
        policy = copy.deepcopy(model)
        engine = shared if shared is not None else HFEngine(policy, dtype=getattr(torch, config.engine_dtype))
        grpo = GRPOConfig(mode=mode, steps=config.rl_steps, max_new_tokens=config.max_new_tokens, seed=config.seed)
        trainer = GRPOTrainer(policy, task, engine, grpo)
        phase = f"GRPO steps ({mode})"
        report(phase, 0, config.rl_steps)
        trainer.train(lambda _phase, done, total: report(phase, done, total))  # noqa: B023 - called inside the loop
        for record in trainer.history:
            updates = record["rollout_disagreement_per_mini_step"]
            rows.append(
                {
                    "step": record["step"],
                    "mode": mode,
                    "reward_mean": record["reward_mean"],
                    "k3_kl": record["k3_kl"],
                    "routing_disagreement": sum(updates) / len(updates),
                    "drift": record["max_drift"],
                    "ppo_kl": record["ppo_kl"],
                    "clip_frac": record["clip_frac"],
                }
            )
    return rows


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The --json record: everything but the per-token arrays (those go to the report)."""
    return {key: value for key, value in result.items() if key != "dlogp"}


__all__ = ["DemoConfig", "run_demo", "summary"]
