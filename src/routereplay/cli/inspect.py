"""`routereplay inspect FILE`: shape, experts, layers, coverage, expert load and validation verdict."""

from __future__ import annotations

import argparse
import json
from typing import Any

from routereplay.cli.arguments import add_json_argument, add_payload_arguments, payload_hints

HELP = "show a trace file's shape, coverage, per-layer expert load and validation verdict"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help=HELP,
        description=(
            f"{HELP[0].upper()}{HELP[1:]}. FILE is a codec file (.rrt), a .npy array, or an engine "
            "response saved as JSON (vLLM, SGLang, Megatron). Exit status: 0 valid, 1 invalid, 2 unreadable."
        ),
        epilog=(
            "examples:\n  routereplay inspect routes.rrt\n"
            "  routereplay inspect resp.json --num-experts 128 --moe-layers 0-47\n"
            "  routereplay inspect gen.json --engine sglang --num-layers 48 --top-k 8 --num-experts 128"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", help="trace file: .rrt, .npy or a JSON engine response")
    add_payload_arguments(parser)
    parser.add_argument("--layers-shown", type=int, default=64, help="at most this many per-layer rows in the table")
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.summary import summarize
    from routereplay.tracefile import read_trace

    trace, found = read_trace(args.file, payload_hints(args), engine=args.engine, validate=False)
    summary = summarize(trace, sequence=args.file)
    if args.json:
        record: dict[str, Any] = {"file": args.file, "format": str(found), **summary.to_dict()}
        print(json.dumps(record, indent=2))
    else:
        _render(args.file, str(found), summary, args.layers_shown)
    return 0 if summary.valid else 1


def _render(path: str, fmt: str, summary: Any, layers_shown: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from routereplay.summary import compact_ranges
    from routereplay.trace import Segment

    console = Console()
    facts = Table(
        show_header=False, box=None, pad_edge=False, title=f"[bold]{path}[/bold] ({fmt})", title_justify="left"
    )
    facts.add_column(style="cyan")
    facts.add_column()
    facts.add_row(
        "rows (tokens)",
        f"{summary.num_tokens}  (token positions {summary.start}..{summary.stop - 1})"
        if summary.num_tokens
        else f"0  (no rows from token position {summary.start})",
    )
    facts.add_row("layers", f"{summary.num_layers}  [{compact_ranges(summary.layers)}]")
    facts.add_row("top-k / experts", f"{summary.top_k} of {summary.num_experts}  ({summary.dtype})")
    total = summary.routed_rows + summary.unrouted_rows
    facts.add_row(
        "coverage",
        f"{summary.coverage:.2%} of (token, layer) rows routed; {summary.unrouted_rows} of {total} are -1 "
        f"(live fallback); {summary.fully_routed_tokens} tokens routed in every layer",
    )
    provenance = ", ".join(Segment(**segment).describe() for segment in summary.segments)
    facts.add_row("provenance", provenance or "-")
    verdict = "[green]valid[/green]" if summary.valid else f"[red]INVALID[/red] {summary.error_type}: {summary.error}"
    facts.add_row("validation", verdict)
    console.print(facts)
    loads = Table(title="expert load per layer", title_justify="left")
    for name in ("layer", "routed rows", "max/mean", "unused experts", "busiest", "entropy"):
        loads.add_column(name, justify="right")
    for load in summary.layer_load[:layers_shown]:
        loads.add_row(
            str(load.layer),
            str(load.routed_rows),
            f"{load.max_over_mean:.2f}",
            str(load.unused_experts),
            str(load.busiest_expert),
            f"{load.entropy:.3f}",
        )
    if len(summary.layer_load) > layers_shown:
        loads.caption = f"{len(summary.layer_load) - layers_shown} more layers: --layers-shown N or --json"
    console.print(loads)
