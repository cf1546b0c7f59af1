"""Load benchmark: the demo's CPU paths on a quiet machine and with busy processes sharing the cores.

Issue 11 item 25: with two other processes on the 2 cores, 20 supervised steps of the demo model took
250 s under torch's default 2 intra-op threads and 20 s with 1 thread. This suite times three
workloads of the demo model (Qwen3-MoE shape, random weights: speed does not depend on training):
- `train`: supervised steps of `train_demo_model` (the step that collapsed);
- `demo`: `run_demo` without its GRPO part: engine sampling (bf16) and the trainer's scoring with
  routers off and with R3;
- `grpo_step`: one R3 GRPO step (rollouts, old log-probs, update mini-steps).
Each repeat runs every workload quiet and loaded (`busy_processes` processes spinning
`while True: pass`, started before and killed after the loaded half), alternating which half goes
first. The ratio reported is the median of the per-repeat ratios loaded / quiet; the target is
`LOADED_TARGET` (2x). Threads follow `routereplay.threads.ThreadPolicy` (`threads=None`: the
library default), so `--threads 2` shows what torch's default did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import median_ratio, spread, target
from routereplay.threads import ThreadPolicy

LOADED_TARGET = 2.0  # loaded / quiet, per workload
MAX_BUSY_PROCESSES = 64  # a benchmark that starts more spinning processes is a typo
BUSY_CODE = "while True: pass"
BUSY_SETTLE_S = 0.2  # let the busy processes get scheduled before timing


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBenchConfig:
    repeats: int = 3
    busy_processes: int = 2
    train_steps: int = 5  # supervised steps per `train` call
    train_batch: int = 64
    prompts: int = 64  # `demo` prompts
    grpo_prompts: int = 8  # `grpo_step` prompts per step (x group_size 4)
    threads: int | None = None  # ThreadPolicy: None = the library default
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("repeats", "train_steps", "train_batch", "prompts", "grpo_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"load bench: {name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.busy_processes <= MAX_BUSY_PROCESSES:
            raise ValueError(f"load bench: busy_processes={self.busy_processes} must be in [0, {MAX_BUSY_PROCESSES}]")


@contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` Python processes spinning on a core each, killed (and reaped) when the block ends."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            processes.append(subprocess.Popen([sys.executable, "-c", BUSY_CODE], stdin=subprocess.DEVNULL))
        if processes:
            time.sleep(BUSY_SETTLE_S)
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def _workloads(config: LoadBenchConfig, folder: Path) -> dict[str, Callable[[], Any]]:
    """The three timed calls; `folder` receives a random-weight demo checkpoint for `run_demo`."""
    import copy

    import torch
    import transformers

    from routereplay.engines.hf import HFEngine
    from routereplay.rl.demo import DemoConfig, run_demo
    from routereplay.rl.grpo import GRPOConfig, GRPOTrainer
    from routereplay.rl.model import demo_config, train_demo_model
    from routereplay.rl.tasks import AdditionTask, build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(config.seed)
    model_config = demo_config("qwen3_moe", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = transformers.AutoModelForCausalLM.from_config(model_config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    task = AdditionTask(tokenizer)
    demo = DemoConfig(model=str(folder), prompts=config.prompts, rl_steps=0, seed=config.seed, threads=config.threads)
    grpo = GRPOConfig(mode="R3", steps=1, prompts_per_step=config.grpo_prompts, seed=config.seed)

    def train() -> None:
        train_demo_model(
            "qwen3_moe", steps=config.train_steps, batch=config.train_batch, seed=config.seed, threads=config.threads
        )

    def grpo_step() -> None:
        policy = copy.deepcopy(model)
        GRPOTrainer(policy, task, HFEngine(policy), grpo).train()

    return {"train": train, "demo": lambda: run_demo(demo), "grpo_step": grpo_step}


def run(config: LoadBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    import gc

    import transformers

    report = progress or (lambda _name: None)
    transformers.utils.logging.disable_progress_bar()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    seconds: dict[str, dict[str, list[float]]] = {}
    with ThreadPolicy(threads=config.threads).applied() as choice, tempfile.TemporaryDirectory() as folder:
        report("building the model")
        workloads = _workloads(config, Path(folder))
        seconds = {name: {"quiet": [], "loaded": []} for name in workloads}
        for name, workload in workloads.items():
            report(f"warm-up: {name}")
            workload()
        for repeat in range(config.repeats):
            halves = ("quiet", "loaded") if repeat % 2 == 0 else ("loaded", "quiet")
            for half in halves:
                with busy_processes(config.busy_processes if half == "loaded" else 0):
                    for name, workload in workloads.items():
                        report(f"repeat {repeat + 1}/{config.repeats}, {half}: {name}")
                        gc.collect()
                        begin = time.perf_counter()
                        workload()
                        seconds[name][half].append(time.perf_counter() - begin)
    ratios = {name: median_ratio(s["loaded"], s["quiet"]) for name, s in seconds.items()}
    return {
        "suite": "load",
        "machine": collect(),
        "config": asdict(config),
        "threads": choice.to_dict(),
        "load_average_before": list(load_before) if load_before is not None else None,
        "seconds": {name: spread(s) for name, s in seconds.items()},
        "ratios": {f"{name}_loaded_over_quiet": ratio for name, ratio in ratios.items()},
        "targets": {f"{name}_loaded_over_quiet": target(ratio, LOADED_TARGET) for name, ratio in ratios.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine, threads = result["config"], result["machine"], result["threads"]
    load = result["load_average_before"]
    lines = [
        measured_on(machine, "load", "torch", "transformers")
        + f"; intra-op threads: {threads['threads']} ({threads['source']}); load average before the run: "
        + (", ".join(f"{v:.2f}" for v in load) if load else "n/a")
        + ".",
        "",
        f"Demo-shaped Qwen3-MoE (random weights). train: {config['train_steps']} supervised steps of batch "
        f"{config['train_batch']}; demo: {config['prompts']} prompts sampled and scored off and R3; grpo_step: one "
        f"R3 GRPO step of {config['grpo_prompts']} prompts x 4. Loaded: {config['busy_processes']} busy processes; "
        f"{config['repeats']} repeats (median).",
        "",
        "| workload | quiet s (median) | loaded s (median) | loaded low | loaded high | loaded / quiet |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, halves in result["seconds"].items():
        quiet, loaded = halves["quiet"], halves["loaded"]
        lines.append(
            f"| {name} | {quiet['median']:.3f} | {loaded['median']:.3f} | {loaded['low']:.3f} | {loaded['high']:.3f} | "
            f"{result['ratios'][f'{name}_loaded_over_quiet']:.2f} |"
        )
    lines.append(
        f"\nloaded / quiet is the median of per-repeat ratios; target <= {LOADED_TARGET:g}x. The quiet half is only "
        "quiet if nothing else runs on the machine: check the load average above."
    )
    return "\n".join(lines)


__all__ = ["LOADED_TARGET", "MAX_BUSY_PROCESSES", "LoadBenchConfig", "busy_processes", "markdown", "run"]
