"""`routereplay diagnose`: my run diverges, where? Engine vs trainer, per layer and per position, for a user's run.

Reads the rollouts' routes (vLLM / SGLang responses saved as JSON, `.rrt` codec files, route store files), their
token ids (from the payload, the trace or the store) and the engine's log-probs where the payload has them;
scores them with the model (an HF checkpoint folder, or `demo`: the built-in demo model) without replay (off)
and replaying the engine's routes (R3); prints the summary (or `--json`) and writes ONE self-contained HTML
report (plots embedded). The computation is `routereplay.report.diagnosis.scoring`, the page
`routereplay.report.diagnosis.page`; the walkthrough is docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from routereplay.cli.arguments import add_json_argument, positive_float, positive_int
from routereplay.cli.threads import add_threads_argument

DEFAULT_REPORT = "routereplay-diagnosis.html"
DEMO_MODEL = "demo"
HELP = "where a run's engine and trainer diverge: routing and log-prob mismatch per layer and position, off vs R3"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diagnose",
        help=HELP,
        description=(
            f"{HELP[0].upper()}{HELP[1:]}.\n\n"
            "ROUTES are the rollouts' routes in any form routereplay reads: a vLLM response saved as JSON (every\n"
            "choice; token ids from prompt_token_ids + token_ids, the engine's log-probs from logprobs), an SGLang\n"
            "/generate response (with the request's input_ids added), a .rrt codec file with token ids, or a route\n"
            "store file (RouteStore.save). The model scores every sequence twice: with its own routing (off) and\n"
            "replaying the engine's routes (R3). Reported: routing disagreement (engine vs trainer) overall, per\n"
            "MoE layer and per token position; the log-prob mismatch (k3 KL, mean |dlogp|, F(2)) of off and R3\n"
            "against the engine's log-probs (when the inputs hold them; otherwise the report says so and shows\n"
            "how far replay moves the trainer's own log-probs); expert load skew per layer; and a summary naming\n"
            "the layers that diverge most and the next step. The report is one HTML file, plots embedded, no\n"
            "network. Walkthrough: docs/diagnose.md."
        ),
        epilog=(
            "examples:\n"
            "  routereplay diagnose resp-*.json --model ./my-moe-checkpoint\n"
            "  routereplay diagnose batch.rrs --model ./ckpt --device cuda --dtype bfloat16 --report diag.html\n"
            "  routereplay diagnose seq0.rrt seq1.rrt --model demo --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("routes", nargs="+", metavar="ROUTES", help="rollout files: .json (vLLM, SGLang), .rrt, store")
    model = parser.add_argument_group("model (the trainer)")
    model.add_argument(
        "--model",
        required=True,
        help=f"the HF checkpoint folder the rollouts were sampled with (save_pretrained's), or {DEMO_MODEL!r} for the "
        "built-in demo model (trained on first use, then cached)",
    )
    model.add_argument(
        "--arch", default="qwen3_moe", help="with --model demo: the demo model's family (default qwen3_moe)"
    )
    model.add_argument("--device", default="cpu", help="torch device of the trainer: cpu (default) or cuda[:N]")
    model.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="trainer precision (float32)"
    )
    model.add_argument("--batch-size", type=positive_int, default=16, help="sequences per forward (default 16)")
    model.add_argument(
        "--temperature",
        type=positive_float,
        default=1.0,
        help="the engine's sampling temperature: the trainer's logits are divided by it, as the engine's were (1.0)",
    )
    add_threads_argument(model)
    output = parser.add_argument_group("output")
    output.add_argument(
        "--report", help=f"the HTML report (default ./{DEFAULT_REPORT}); an existing file needs --force"
    )
    output.add_argument("--force", action="store_true", help="overwrite an existing --report file")
    output.add_argument("--no-report", action="store_true", help="write no HTML report (refused with --report)")
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.cli.extras import require
    from routereplay.cli.outputs import check_output_file, report_flags
    from routereplay.report.diagnosis.rollouts import sniff_inputs

    report_flags(args, DEFAULT_REPORT)
    paths = sniff_inputs(args.routes)  # missing files, folders, empty files: before any heavy import
    if not args.no_report:
        check_output_file("--report", args.report, force=args.force)
    needs = {"transformers": "the model that scores the rollouts"}
    if not args.no_report:
        needs["matplotlib"] = f"the report's plots (--report {args.report}; or pass --no-report)"
    require("diagnose", needs)
    _check_model_flag(args)
    _check_device(args.device)

    from routereplay.cli.progress import phase_progress
    from routereplay.report.diagnosis.rollouts import read_rollouts
    from routereplay.report.diagnosis.scoring import DiagnoseConfig, diagnose
    from routereplay.threads import ThreadPolicy

    config = DiagnoseConfig(
        device=args.device, dtype=args.dtype, batch_size=args.batch_size, temperature=args.temperature
    )
    with ThreadPolicy(threads=args.threads).applied(), phase_progress() as report:
        model, source = _load_model(args, report)
        rollouts = read_rollouts(paths, _geometry(model))
        record = diagnose(model, rollouts, config, report)
    record["model"]["source"] = source
    if args.json:
        print(json.dumps(record, indent=2), flush=True)
    else:
        _render(record)
    if not args.no_report:
        from routereplay.report.diagnosis.page import write_diagnosis

        write_diagnosis(record, args.report)
        if not args.json:
            print(f"report: {args.report}")
    return 0


def _check_model_flag(args: argparse.Namespace) -> None:
    """`--model`: `demo` (with a known --arch) or a checkpoint folder holding config.json; checked before loading."""
    from routereplay.errors import ConfigError
    from routereplay.rl.model import Arch

    if args.model == DEMO_MODEL:
        if args.arch not in {arch.value for arch in Arch}:
            raise ConfigError(
                f"--arch {args.arch!r} is not a demo family; use one of {', '.join(a.value for a in Arch)}"
            )
        return
    folder = Path(args.model)
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise ConfigError(
            f"--model {args.model}: not a checkpoint folder (no config.json there); pass the folder save_pretrained "
            f"wrote, or {DEMO_MODEL!r} for the built-in demo model"
        )


def _check_device(device: str) -> None:
    import torch

    from routereplay.errors import ConfigError

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a torch device; pass cpu or cuda (cuda:N)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch {torch.__version__} sees no CUDA device here; pass --device cpu")
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: diagnose runs on cpu or cuda")


def _load_model(args: argparse.Namespace, report: Any) -> tuple[Any, str]:
    """The trainer's model (float32, eval) and where it came from; a tokenizer is not needed (ids are given)."""
    import transformers

    from routereplay.errors import CheckpointError

    transformers.utils.logging.disable_progress_bar()
    if args.model == DEMO_MODEL:
        from routereplay.rl.model import load_or_train

        model, _tokenizer, source = load_or_train(
            args.arch,
            progress=lambda step, steps, _loss: report("training the demo model (cached after this run)", step, steps),
            threads=args.threads,
        )
        return model, source
    import torch

    report("loading --model", 0, 1)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError) as exc:
        first = " ".join(str(exc).split("\n\n", 1)[0].split())
        raise CheckpointError(
            f"--model {args.model}: cannot load it with transformers ({type(exc).__name__}: {first})"
        ) from None
    report("loading --model", 1, 1)
    return model.eval(), f"--model {args.model}"


def _geometry(model: Any) -> Any:
    from routereplay.report.diagnosis.rollouts import Geometry
    from routereplay.runtime import attach

    replayer = attach(model)
    try:
        text_config = model.config.get_text_config()
        return Geometry(replayer.num_experts, text_config.num_hidden_layers, replayer.top_k, tuple(replayer.layers))
    finally:
        replayer.detach()


def _render(record: dict[str, Any]) -> None:
    from rich.table import Table

    from routereplay.cli.console import footnotes, show

    model, inputs, routing = record["model"], record["inputs"], record["routing"]
    head = (
        f"[bold]{model['model_type']}[/bold] ({len(model['layers'])} MoE layers, top-{model['top_k']} of "
        f"{model['num_experts']} experts; {model['source']})\n{inputs['sequences']} sequences, {inputs['tokens']} "
        f"tokens, {inputs['scored_tokens']} scored"
    )
    table = Table(title="engine vs trainer", title_justify="left")
    for name in ("measure", "off", "R3"):
        table.add_column(name, justify="right" if name != "measure" else "left")
    table.add_row(
        "routing disagreement", _percent(routing["routing_disagreement"]), _percent(routing["replayed_disagreement"])
    )
    if record["logprobs"] is not None:
        for key in ("k3_kl", "mean_abs_dlogp", "extreme_frac_2"):
            table.add_row(key, f"{record['logprobs']['off'][key]:.4g}", f"{record['logprobs']['R3'][key]:.4g}")
    layers = Table(title="per layer", title_justify="left")
    for name in ("layer", "disagreement", "engine load max/mean"):
        layers.add_column(name, justify="right")
    engine_skew = record["load"]["engine"]["max_over_mean"]
    for layer, value, skew in zip(model["layers"], routing["per_layer_disagreement"], engine_skew, strict=True):
        layers.add_row(str(layer), _percent(value), f"{skew:.2f}")
    steps = [f"- {step}" for step in record["summary"]["next_steps"]]
    missing = [f"missing: {m}" for m in record["inputs"]["missing"]]
    show(head, table, layers, footnotes("next:", *steps, *missing))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"
