"""`routereplay convert IN OUT`: between engine payloads, .npy and the compact codec."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from routereplay.cli.arguments import add_json_argument, add_payload_arguments, payload_hints

HELP = "convert a trace between engine payloads (vLLM/SGLang/Megatron JSON), .npy and the codec (.rrt)"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help=HELP,
        description=(
            f"{HELP[0].upper()}{HELP[1:]}. The input format is recognised from its bytes; the output "
            "format from --to or OUT's extension (.rrt, .npy). The input is validated before anything "
            "is written, and OUT is written atomically."
        ),
        epilog=(
            "examples:\n  routereplay convert resp.json routes.rrt --num-experts 128 --moe-layers 0-47\n"
            "  routereplay convert routes.rrt routes.npy\n  routereplay convert routes.rrt gen.json --to sglang"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", help="input trace file")
    parser.add_argument("output", help="output path")
    parser.add_argument("--to", choices=["rrt", "npy", "vllm", "sglang", "megatron"], help="output format")
    parser.add_argument(
        "--mode",
        choices=["set", "ordered"],
        default="set",
        help="codec: keep each row's expert SET (smallest; ids come back sorted) or the exact order",
    )
    parser.add_argument("--zstd", action="store_true", help="codec: compress the payload with zstd (extra `zstd`)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    add_payload_arguments(parser)
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.cli.extras import require
    from routereplay.cli.failure import naming, read_trace_file
    from routereplay.errors import ConfigError
    from routereplay.tracefile import FileFormat, format_for_path, write_trace

    target = FileFormat(args.to) if args.to else format_for_path(args.output)
    if target is None:
        raise ConfigError(f"cannot tell the output format from {args.output!r}; pass --to rrt|npy|vllm|sglang|megatron")
    if Path(args.output).is_dir():
        raise ConfigError(f"{args.output} is a directory; name the output file, e.g. {Path(args.output) / 'out.rrt'}")
    if Path(args.output).exists() and not args.force:
        raise ConfigError(f"{args.output} exists; pass --force to overwrite it")
    if args.zstd:
        require("convert", {"zstandard": "--zstd"})
    trace, source = read_trace_file(args, args.input, payload_hints(args), validate=True)
    with naming(args.output):
        written = write_trace(trace, args.output, target, mode=args.mode, compress=args.zstd)
    if args.zstd and target is FileFormat.CODEC:
        from routereplay.codec import encode

        plain = len(encode(trace, mode=args.mode, compress=False))
        if written > plain:
            print(
                f"note: --zstd made {args.output} larger ({written} B against {plain} B without it): the codec's "
                "bit-packed ids are already close to their entropy; leave out --zstd for traces like this one",
                file=sys.stderr,
            )
    if target is FileFormat.NPY:
        print(
            f"note: .npy keeps only the ids; layers {list(trace.layers)[:4]}..., start {trace.start} and provenance "
            "are dropped (use .rrt to keep them)",
            file=sys.stderr,
        )
    dense = sorted(set(range(max(trace.layers, default=-1) + 1)) - set(trace.layers))
    if target in (FileFormat.VLLM, FileFormat.SGLANG) and dense:
        from routereplay.summary import compact_ranges

        print(
            f"note: {target} sends every hidden layer: wrote layers 0-{max(trace.layers)}, non-MoE layer(s) "
            f"{compact_ranges(dense)} zero-filled. The MoE layers are recorded in the file's 'routereplay' "
            f"object, so routereplay reads them back as they were; other readers: --moe-layers "
            f"{compact_ranges(list(trace.layers))}",
            file=sys.stderr,
        )
    rows = trace.num_tokens * trace.num_layers
    record = {
        "input": args.input,
        "input_format": str(source),
        "input_bytes": Path(args.input).stat().st_size,
        "output": args.output,
        "output_format": str(target),
        "output_bytes": written,
        "rows": rows,
        "bytes_per_row": written / rows if rows else 0.0,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(
            f"{args.input} ({source}, {record['input_bytes']} B) -> {args.output} ({target}, {written} B, "
            f"{record['bytes_per_row']:.3f} B per (token, layer) row)"
        )
    return 0
