"""`routereplay inspect FILE`: shape, experts, layers, coverage, expert load and validation verdict."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from routereplay.cli.arguments import (
    CommandParser,
    add_codec_limit_arguments,
    add_json_argument,
    add_payload_arguments,
    non_negative_int,
    payload_hints,
)
from routereplay.cli.failure import ExitCode, cli_message, exit_code, os_error_line, read_trace_file
from routereplay.errors import RouteReplayError

HELP = "show a trace file's shape, coverage, per-layer expert load and validation verdict"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help=HELP,
        description=(
            f"{HELP[0].upper()}{HELP[1:]}.\nFILE is a codec file (.rrt), a .npy array, or an engine "
            "response saved as JSON (vLLM, SGLang, Megatron).\n\n"
            "exit status:\n"
            "  0  valid\n"
            "  1  invalid: the file was read, but its routes fail validation (row or layer count, top-k,\n"
            "     expert ids out of range, duplicate or partial rows, all-zero layers)\n"
            "  2  unreadable: missing, a directory, not a recognised format, a corrupt codec file, a codec\n"
            "     file beyond the codec limits (the message names the flag that raises them), model flags\n"
            "     missing, or a bad flag\n"
            "With --json a verdict (readable, valid, error_type, error) is printed on stdout in every case."
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
    add_codec_limit_arguments(parser)
    parser.add_argument(
        "--layers-shown", type=non_negative_int, default=64, help="at most this many per-layer rows in the table"
    )
    add_json_argument(parser)
    parser.set_defaults(func=run)
    if isinstance(parser, CommandParser):
        parser.usage_verdict = lambda message, given: _usage_verdict(parser, message, given)


def _usage_verdict(parser: argparse.ArgumentParser, message: str, given: list[str]) -> None:
    """With --json, a bad command line (`--num-experts 0`, `--moe-layers 3-1`) still gets its verdict on stdout;
    argparse then prints the usage error on stderr and exits 2 (unreadable)."""
    options = given[: given.index("--")] if "--" in given else given  # after `--` every token is a file name
    if "--json" not in options:
        return
    takes_value = {flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings}
    file, skip = None, False
    for token in given:
        if skip:
            skip = False
        elif token.startswith("-") and token != "-":
            skip = token in takes_value  # `--flag value`; `--flag=value` is one token
        elif file is None:
            file = token
    verdict = {
        "file": file,
        "format": None,
        "readable": False,
        "valid": False,
        "error_type": "ArgumentError",
        "error": f"bad command line: {message}",
    }
    print(json.dumps(verdict, indent=2), flush=True)


def run(args: argparse.Namespace) -> int:
    """Exit 0 valid, 1 invalid (read, but the routes fail validation), 2 unreadable; --json always prints a verdict."""
    from routereplay.trace.summary import summarize

    try:
        trace, found = read_trace_file(args, args.file, payload_hints(args), validate=False)
    except (RouteReplayError, OSError, ImportError) as exc:  # ImportError: a zstd codec file without zstandard
        return _refused(args, exc)
    summary = summarize(trace, sequence=args.file)
    if not summary.valid:  # the decoder's own verdict knows the wire (e.g. which shapes a flat payload fits)
        try:
            read_trace_file(args, args.file, payload_hints(args), validate=True)
        except RouteReplayError as exc:
            if type(exc).__name__ == summary.error_type:
                summary = dataclasses.replace(summary, error=str(exc))
    if summary.error is not None:
        summary = dataclasses.replace(summary, error=cli_message(summary.error))
    if args.json:
        record: dict[str, Any] = {"file": args.file, "format": str(found), "readable": True, **summary.to_dict()}
        print(json.dumps(record, indent=2))
    else:
        _render(args.file, str(found), summary, args.layers_shown)
    return ExitCode.OK if summary.valid else ExitCode.INVALID


def _refused(args: argparse.Namespace, exc: RouteReplayError | OSError | ImportError) -> int:
    """The verdict on a file whose decoding failed: invalid routes (1) or an unreadable file (2)."""
    code = exit_code(exc)
    message = os_error_line(exc) if isinstance(exc, OSError) else cli_message(str(exc))
    if args.json:
        verdict = {
            "file": args.file,
            "format": _format_of(args.file, args.engine) if code is ExitCode.INVALID else args.engine,
            "readable": code is ExitCode.INVALID,
            "valid": False,
            "error_type": type(exc).__name__,
            "error": message,
        }
        print(json.dumps(verdict, indent=2))
    if code is ExitCode.INVALID:
        if not args.json:
            print(f"{args.file}: INVALID {type(exc).__name__}: {message}")
        return code
    cause = message if isinstance(exc, OSError) else f"{type(exc).__name__}: {message}"
    print(f"routereplay inspect: {args.file} is unreadable: {cause}", file=sys.stderr)
    return code


def _format_of(path: str, engine: str | None) -> str | None:
    """The format of a file that was read (its routes failed validation): --engine, else the sniffed one."""
    from pathlib import Path

    from routereplay.tracefile.format import sniff

    if engine is not None:
        return engine
    try:
        return str(sniff(Path(path).read_bytes())[0])
    except (RouteReplayError, OSError):
        return None


def _render(path: str, fmt: str, summary: Any, layers_shown: int) -> None:
    from rich.table import Table

    from routereplay.cli.console import show
    from routereplay.trace.provenance import Segment
    from routereplay.trace.summary import compact_ranges

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
    show(facts, loads)
