"""`routereplay demo`: see the problem R3 solves, and the fix, on a laptop CPU.

The built-in engine samples in bf16 and a trainer scores the same tokens in fp32. The two disagree
on experts for a few percent of (token, layer) rows, and their log-probs drift apart. Replaying the
engine's routes in the trainer (R3) removes the routing disagreement and most of the drift. The
command prints a table (or `--json`) and writes a report folder: report.html and PNG plots.
`--engine vllm` samples with a real vLLM in this process instead (routereplay[vllm]); the demo model
is then its vLLM-servable variant (head_dim 64, trained and cached on first use), or `--model`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from routereplay.cli.arguments import (
    add_json_argument,
    bounded_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    seed_int,
)
from routereplay.cli.threads import add_threads_argument

DEFAULT_REPORT = "routereplay-report"
HELP = "show routing disagreement and log-prob mismatch between engine and trainer, without and with R3"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help=HELP,
        description=(
            "The main job. A tiny MoE that learned digit addition (trained on first use, then cached: 1 min 23 s "
            "on a 2-core AMD EPYC at a load average of 1.5-2.7, longer on busier cores) is served by the built-in "
            "engine in bf16. "
            "The trainer scores the same tokens in fp32: first with its own routing (off), then replaying the "
            "engine's routes (R3). Prints the routing disagreement and the log-prob mismatch (k3 KL, F(2), ...) of "
            "both modes, and writes a report folder (report.html + PNG plots). The figures depend on the CPU "
            "(docs/train.md, 'Figures and the CPU')."
        ),
        epilog=(
            "examples:\n  routereplay demo\n  routereplay demo --arch deepseek_v3 --json\n"
            "  routereplay demo --model ./my-moe\n"
            "  routereplay demo --engine vllm --json   (a real vLLM in this process; demo model with head_dim 64)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--arch", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe", help="demo model architecture"
    )
    model.add_argument("--model", help="a local HF MoE checkpoint folder (with tokenizer) instead of the demo model")
    model.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="rollout engine: hf (built-in, default) or vllm (a real vLLM in this process, routereplay[vllm]; "
        "the demo model becomes its vLLM-servable variant, head_dim 64)",
    )
    model.add_argument(
        "--train-steps", type=positive_int, default=800, help="training steps of the demo model (default 800)"
    )
    model.add_argument(
        "--rl-steps",
        type=non_negative_int,
        default=3,
        help="GRPO steps per mode (off, R2, R3) for the per-step comparison; 0 skips",
    )
    rollout = parser.add_argument_group("rollouts")
    rollout.add_argument("--prompts", type=positive_int, default=2048, help="number of addition prompts (default 2048)")
    rollout.add_argument("--max-new-tokens", type=positive_int, default=5, help="tokens sampled per prompt (default 5)")
    rollout.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default 1.0)")
    rollout.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling (default 1.0: off)")
    rollout.add_argument("--seed", type=seed_int, default=0, help="seed of prompts and sampling")
    rollout.add_argument(
        "--engine-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="engine precision"
    )
    rollout.add_argument(
        "--threshold",
        type=bounded_float(0.0),
        help="also score mode R3-threshold: engine routes kept only within this margin of the trainer's live top-k "
        "(selection score), with its replace rate (docs/replay.md)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--report",
        help=f"report folder (default ./{DEFAULT_REPORT}); written whole at the end, never half; an existing "
        "non-empty folder needs --force",
    )
    output.add_argument(
        "--force",
        action="store_true",
        help="write into an existing non-empty --report folder (its report files are replaced, other files kept)",
    )
    output.add_argument(
        "--no-report", action="store_true", help="do not write the report folder (refused with --report or --force)"
    )
    add_threads_argument(model)
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.cli.extras import require, require_vllm
    from routereplay.cli.outputs import report_flags

    report_flags(args, DEFAULT_REPORT)
    if args.engine == "vllm":  # looked up before any heavy import (vLLM's takes seconds)
        require_vllm("demo --engine vllm", "(an in-process vLLM)")
    needs = {"transformers": "the demo model and engine"}
    if not args.no_report:
        needs["matplotlib"] = f"the report's plots (--report {args.report}; or pass --no-report)"
    require("demo", needs)  # before minutes of training, not after
    if args.engine == "vllm":
        _check_vllm(args)
    if not args.no_report:
        from routereplay.cli.outputs import check_output_folder

        check_output_folder("--report", args.report, force=args.force)  # before minutes of work, creating nothing

    import transformers

    from routereplay.cli.progress import phase_progress
    from routereplay.rl.demo import DemoConfig, run_demo, summary

    transformers.utils.logging.disable_progress_bar()  # this command draws its own progress
    config = DemoConfig(
        arch=args.arch,
        model=args.model,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        train_steps=args.train_steps,
        rl_steps=args.rl_steps,
        engine_dtype=args.engine_dtype,
        threads=args.threads,
        engine=args.engine,
        threshold=args.threshold,
    )
    with phase_progress() as report:
        result = run_demo(config, report)
    # the numbers first: a report that cannot be written (disk full) must not lose minutes of work
    if args.json:
        print(json.dumps(summary(result), indent=2), flush=True)
    else:
        _render(result)
    if not args.no_report:
        from routereplay.cli.failure import naming
        from routereplay.cli.outputs import staged_folder
        from routereplay.report.page import write_report

        with naming(args.report), staged_folder(args.report) as staging:  # Ctrl-C here leaves no half report
            paths = write_report(result, staging)
        if not args.json:
            print(f"report: {args.report}/report.html ({len(paths)} files)")
    if not args.json:
        from routereplay.report.table import NEXT_STEPS

        print(NEXT_STEPS)
    return 0


def _check_vllm(args: argparse.Namespace) -> None:
    """`--engine vllm`: vLLM importable and the demo model servable, before any training."""
    from routereplay.cli.train import vllm_logs_to_stderr
    from routereplay.engines.vllm.colocated import import_vllm

    vllm_logs_to_stderr()
    import_vllm()  # MissingDependencyError naming the extra
    if args.model is None:
        from routereplay.rl.model import vllm_overrides

        vllm_overrides(args.arch)  # UnservableModelError for an arch without a servable variant


def _render(result: dict[str, Any]) -> None:
    from rich.table import Table

    from routereplay.cli.console import show
    from routereplay.report.table import METRIC_ROWS, format_metric, mode_label

    model, rollouts, modes = result["model"], result["rollouts"], result["modes"]
    summary = (
        f"[bold]{model['model_type']}[/bold] ({model['parameters']:,} parameters, {len(model['layers'])} MoE layers, "
        f"top-{model['top_k']} of {model['num_experts']} experts; {model['source']})\n"
        f"{rollouts['sequences']} rollouts, {rollouts['response_tokens']} response tokens, reward "
        f"{rollouts['reward_mean']:.1%}; engine {result['config'].get('engine', 'hf')} "
        f"{result['config']['engine_dtype']}, trainer "
        f"{result['config']['trainer_dtype']}"
    )
    table = Table(title="engine vs trainer: routing and log-prob mismatch", title_justify="left")
    table.add_column("metric")
    for mode in modes:
        table.add_column(mode_label(mode, result["config"]), justify="right")
    table.add_column("R3 / off", justify="right")
    for key, label, _meaning in METRIC_ROWS:
        if key not in modes.get("off", {}) and key != "replace_rate":
            continue
        if not any(key in record for record in modes.values()):
            continue
        values = [modes[mode].get(key) for mode in modes]
        off, r3 = modes["off"].get(key), modes.get("R3", {}).get(key)
        ratio = f"{r3 / off:.3f}" if isinstance(off, (int, float)) and off and isinstance(r3, (int, float)) else "-"
        table.add_row(label, *(format_metric(key, v) for v in values), ratio)
    show(summary, table)
