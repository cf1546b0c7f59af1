"""Fully-async GRPO benchmark: resume-route policies side by side, and async against sync throughput.

Two parts, both on the trained demo model (`rl.model.load_or_train`, cached) and the built-in engine
(bf16, as in the demo):
- `policies`: for every mode (off, R2, R3) and every resume-route policy (latest, first,
  prefix-replay), one seeded async run of `steps` trainer steps from the same weights and seed (the
  `seeded` schedule, so the aborts land alike until the runs' weights diverge). Per run the means
  over steps of k3 KL engine-vs-trainer on the old-log-prob pass, ppo_kl, routing disagreement on
  the engine's routed rows (old-log-prob pass and update mini-steps), stale and resumed row
  fractions, the prefix conflicts (stored rows a resumed prefill routed otherwise), aborts, and the
  reward of the first and last steps.
- `throughput`: samples trained per second for `throughput_steps` steps of synchronous GRPO (one
  intra-op thread, and two) and of async GRPO on the realistic `threaded` schedule (a rollout thread
  and the trainer, one intra-op thread each), with the engine in the rollout thread
  (`async_threaded`, so both share the GIL) and in a child process (`async_process`,
  `engines.hf.HFProcessEngine`; its start-up is inside the timed run, the steady state leaves
  it out), interleaved over `repeats` repeats. The ratios are medians of per-repeat ratios async /
  sync, on the same machine in the same run.
With `engine="vllm"` (`routereplay bench async --engine vllm`) the `policies` part runs on a real
in-process vLLM (`VLLMEngine`, the demo model's vLLM-servable variant), where `prefix-replay` forces
each resumed prefill's routes inside vLLM; every run syncs its own weights in first, so the nine runs
share one engine. The throughput part is the built-in engine's and is left out then.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import interleave, median_ratio, spread
from routereplay.threads import ThreadPolicy

MODES = ("off", "R2", "R3")
POLICIES = ("latest", "first", "prefix-replay")


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncBenchConfig:
    steps: int = 24  # trainer steps per policy run
    prompts_per_step: int = 16
    group_size: int = 4
    mini_steps: int = 4
    max_new_tokens: int = 5
    sync_tokens: tuple[int, int] = (1, 3)
    max_staleness: int = 2
    throughput_steps: int = 6
    repeats: int = 3
    seed: int = 0
    train_steps: int = 800  # supervised steps of the demo model (the demo's default; cached after the first run)
    engine: str = "hf"  # "hf": the built-in engine; "vllm": the policies part on an in-process vLLM

    def __post_init__(self) -> None:
        names = ("steps", "prompts_per_step", "group_size", "mini_steps", "throughput_steps", "repeats", "train_steps")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"async bench: {name}={getattr(self, name)} must be >= 1")
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"async bench: engine={self.engine!r} must be 'hf' or 'vllm'")
        if self.throughput_steps < 2:
            raise ValueError(
                f"async bench: throughput_steps={self.throughput_steps} must be >= 2 (the steady state is timed "
                "from the end of step 0)"
            )


def _policy_run(
    model: Any, task: Any, config: AsyncBenchConfig, mode: str, policy: str, engine: Any = None
) -> dict[str, Any]:
    from routereplay.engines.hf import HFEngine
    from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer

    policy_model = copy.deepcopy(model)
    trainer = AsyncGRPOTrainer(
        policy_model,
        task,
        engine if engine is not None else HFEngine(policy_model),
        _grpo(config, mode, config.steps),
        AsyncConfig(
            schedule="seeded",
            sync_tokens=config.sync_tokens,
            resume_routes=policy,
            max_staleness=config.max_staleness,
        ),
    )
    history = trainer.train()

    def mean(key: str) -> float:
        return statistics.fmean(float(r[key]) for r in history)

    current = [r["k3_kl_current"] for r in history if r["k3_kl_current"] is not None]
    return {
        "mode": mode,
        "resume_routes": policy,
        "k3_kl": mean("k3_kl"),
        "k3_kl_current": statistics.fmean(current) if current else None,
        "current_steps": len(current),
        "ppo_kl": mean("ppo_kl"),
        "disagreement_old": mean("rollout_routing_disagreement"),
        "disagreement_update": statistics.fmean(
            statistics.fmean(r["rollout_disagreement_per_mini_step"]) for r in history
        ),
        "resumed_row_fraction": mean("resumed_row_fraction"),
        "stale_row_fraction": mean("stale_row_fraction"),
        "prefix_conflicts": sum(r["prefix_conflicts"] for r in history),
        "aborts": sum(r["aborts"] for r in history),
        "reward_first": history[0]["reward_mean"],
        "reward_last": history[-1]["reward_mean"],
        "reward_mean": mean("reward_mean"),
    }


def _grpo(config: AsyncBenchConfig, mode: str, steps: int) -> Any:
    from routereplay.rl.grpo import GRPOConfig

    return GRPOConfig(
        mode=mode,
        steps=steps,
        prompts_per_step=config.prompts_per_step,
        group_size=config.group_size,
        mini_steps=config.mini_steps,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
    )


def _throughput_workloads(
    model: Any, task: Any, config: AsyncBenchConfig, steady: dict[str, list[float]]
) -> dict[str, Callable[[], Any]]:
    """The four timed runs; each also appends its steady-state seconds per step to `steady[name]`:
    from the end of step 0 to the end of the last step, so the async run's initial fill of the
    pool (and sync's first step) is left out."""
    from routereplay.engines.hf import HFEngine, HFProcessEngine
    from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer
    from routereplay.rl.grpo import GRPOTrainer

    grpo = _grpo(config, "R3", config.throughput_steps)
    later = max(config.throughput_steps - 1, 1)

    def sync(name: str, threads: int) -> Callable[[], Any]:
        def run() -> None:
            policy = copy.deepcopy(model)
            with ThreadPolicy(threads=threads).applied():
                history = GRPOTrainer(policy, task, HFEngine(policy), grpo).train()
            steady.setdefault(name, []).append(sum(sum(r["seconds"].values()) for r in history[1:]) / later)

        return run

    def fully_async(name: str, engine_type: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> None:
            policy = copy.deepcopy(model)
            fully = AsyncConfig(schedule="threaded", max_staleness=config.max_staleness)
            with ThreadPolicy(threads=1).applied():
                engine = engine_type(policy)
                try:
                    history = AsyncGRPOTrainer(policy, task, engine, grpo, fully).train()
                finally:
                    if isinstance(engine, HFProcessEngine):
                        engine.close()
            steady.setdefault(name, []).append((history[-1]["elapsed"] - history[0]["elapsed"]) / later)

        return run

    return {
        "sync_1_thread": sync("sync_1_thread", 1),
        "sync_2_threads": sync("sync_2_threads", 2),
        "async_threaded": fully_async("async_threaded", HFEngine),
        "async_process": fully_async("async_process", lambda policy: HFProcessEngine(policy, threads=1)),
    }


def run(config: AsyncBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    import transformers

    from routereplay.rl.model import load_or_train
    from routereplay.rl.tasks import AdditionTask

    report = progress or (lambda _name: None)
    transformers.utils.logging.disable_progress_bar()
    with ThreadPolicy(threads=1).applied() as choice:
        report("the demo model (trained once, cached)")
        vllm = config.engine == "vllm"
        model, tokenizer, _ = load_or_train("qwen3_moe", threads=1, steps=config.train_steps, vllm=vllm)
        task = AdditionTask(tokenizer)
        engine, vllm_version = None, None
        if vllm:
            from routereplay.engines.vllm.colocated import VLLMEngine, import_vllm

            vllm_version = import_vllm().__version__
            report("starting vLLM")
            engine = VLLMEngine(copy.deepcopy(model), tokenizer, policy_version=0)
        runs = []
        try:
            pairs = [(mode, policy) for mode in MODES for policy in POLICIES]
            for number, (mode, policy) in enumerate(pairs, start=1):
                report(f"policies: run {number}/{len(pairs)}, {mode}, {policy} ({config.steps} steps)")
                began = time.perf_counter()
                result = _policy_run(model, task, config, mode, policy, engine)
                result["seconds"] = time.perf_counter() - began
                runs.append(result)
        finally:
            if engine is not None:
                engine.close()
        if vllm:
            return {
                "suite": "async",
                "machine": {**collect(), "vllm": vllm_version},
                "config": asdict(config),
                "threads": choice.to_dict(),
                "policies": runs,
                "throughput": None,
                "ratios": {},
                "targets": {},
            }
        steady: dict[str, list[float]] = {}
        seconds = interleave(_throughput_workloads(model, task, config, steady), config.repeats, report)
        for name in steady:  # interleave's untimed warm-up call appended first: keep the timed repeats
            steady[name] = steady[name][-config.repeats :]
    batch = config.prompts_per_step * config.group_size
    samples = config.throughput_steps * batch
    rates = {name: samples / statistics.median(s) for name, s in seconds.items()}
    steady_rates = {name: batch / statistics.median(s) for name, s in steady.items()}
    ratios = {
        "async_over_sync_1_thread": median_ratio(seconds["sync_1_thread"], seconds["async_threaded"]),
        "async_over_sync_2_threads": median_ratio(seconds["sync_2_threads"], seconds["async_threaded"]),
        "steady_async_over_sync_1_thread": median_ratio(steady["sync_1_thread"], steady["async_threaded"]),
        "steady_async_over_sync_2_threads": median_ratio(steady["sync_2_threads"], steady["async_threaded"]),
        "process_over_sync_1_thread": median_ratio(seconds["sync_1_thread"], seconds["async_process"]),
        "process_over_sync_2_threads": median_ratio(seconds["sync_2_threads"], seconds["async_process"]),
        "process_over_async_threaded": median_ratio(seconds["async_threaded"], seconds["async_process"]),
        "steady_process_over_sync_1_thread": median_ratio(steady["sync_1_thread"], steady["async_process"]),
        "steady_process_over_sync_2_threads": median_ratio(steady["sync_2_threads"], steady["async_process"]),
        "steady_process_over_async_threaded": median_ratio(steady["async_threaded"], steady["async_process"]),
    }
    return {
        "suite": "async",
        "machine": collect(),
        "config": asdict(config),
        "threads": choice.to_dict(),
        "policies": runs,
        "throughput": {
            "samples_per_run": samples,
            "seconds": spread(seconds),
            "samples_per_second": rates,
            "steady_samples_per_second": steady_rates,
        },
        "ratios": ratios,
        "targets": {},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine = result["config"], result["machine"]
    lines = [
        measured_on(machine, "async", "torch")
        + ". Trained demo model, "
        + ("in-process vLLM (bf16)" if config.get("engine") == "vllm" else "built-in engine (bf16)")
        + f", {config['prompts_per_step']} prompts "
        f"x {config['group_size']} per step, {config['mini_steps']} mini-steps, seeded schedule: a trainer step lasts "
        f"{config['sync_tokens'][0]}-{config['sync_tokens'][1]} engine tokens, max staleness "
        f"{config['max_staleness']}, {config['steps']} steps per run (means over steps).",
        "",
        "| mode | resume routes | k3 KL | k3 KL, current tokens | ppo_kl | ≠eng old | ≠eng upd | resumed rows | "
        "stale rows | conflicts | aborts | reward first → last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["policies"]:
        lines.append(
            f"| {r['mode']} | {r['resume_routes']} | {r['k3_kl']:.2e} | "
            + (f"{r['k3_kl_current']:.2e} | " if r["k3_kl_current"] is not None else "n/a | ")
            + f"{r['ppo_kl']:.2e} | "
            f"{r['disagreement_old']:.2%} | {r['disagreement_update']:.2%} | {r['resumed_row_fraction']:.1%} | "
            f"{r['stale_row_fraction']:.1%} | {r['prefix_conflicts']} | {r['aborts']} | "
            f"{r['reward_first']:.1%} → {r['reward_last']:.1%} |"
        )
    throughput = result["throughput"]
    if throughput is None:
        return "\n".join(lines)
    lines += [
        "",
        f"Throughput: {config['throughput_steps']} R3 steps ({throughput['samples_per_run']} samples) per run, "
        f"{config['repeats']} interleaved repeats (median).",
        "",
        "| run | samples/s, whole run (median) | s low | s high | samples/s, steady state (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rate in throughput["samples_per_second"].items():
        timing = throughput["seconds"][name]
        steady = throughput["steady_samples_per_second"][name]
        lines.append(f"| {name} | {rate:.1f} | {timing['low']:.2f} | {timing['high']:.2f} | {steady:.1f} |")
    ratios = result["ratios"]
    lines.append(
        f"\nasync / sync samples per second (median of per-repeat ratios), whole run: "
        f"{ratios['async_over_sync_1_thread']:.2f} against sync on 1 intra-op thread, "
        f"{ratios['async_over_sync_2_threads']:.2f} against sync on 2; steady state (after step 0, so without the "
        f"async pool's initial fill): {ratios['steady_async_over_sync_1_thread']:.2f} and "
        f"{ratios['steady_async_over_sync_2_threads']:.2f}."
    )
    lines.append(
        f"\nWith the engine in a child process (`async_process`), whole run (its start-up included): "
        f"{ratios['process_over_sync_1_thread']:.2f} against sync on 1 intra-op thread, "
        f"{ratios['process_over_sync_2_threads']:.2f} against sync on 2, "
        f"{ratios['process_over_async_threaded']:.2f} against the rollout thread; steady state: "
        f"{ratios['steady_process_over_sync_1_thread']:.2f}, {ratios['steady_process_over_sync_2_threads']:.2f} and "
        f"{ratios['steady_process_over_async_threaded']:.2f}."
    )
    return "\n".join(lines)


__all__ = ["MODES", "POLICIES", "AsyncBenchConfig", "markdown", "run"]
