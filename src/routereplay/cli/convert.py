"""`routereplay convert IN OUT`: between engine payloads, .npy and the compact codec.

A codec (.rrt) output is written so that readers with the default `CodecLimits` (`inspect` without
flags, `read_trace`, `decode`) accept it: `--zstd` on a trace of almost only -1 rows can shrink the
file past the default 4096x expansion, and then the file is written without zstd (a note on stderr
says so; the uncompressed file is within the limits). An output beyond the defaults either way (more
than 2**28 ids, or a zero-bit layout: top-k == experts, one expert) is written with a note naming the
`--max-entries` / `--max-expansion` values that read it back. `--max-expansion` / `--max-entries` on
`convert` itself bound the codec INPUT.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from routereplay.cli.arguments import add_codec_limit_arguments, add_json_argument, add_payload_arguments, payload_hints
from routereplay.codec.limits import CodecLimits
from routereplay.trace.route_trace import RouteTrace

HELP = "convert a trace between engine payloads (vLLM/SGLang/Megatron JSON), .npy and the codec (.rrt)"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help=HELP,
        description=(
            f"{HELP[0].upper()}{HELP[1:]}. The input format is recognised from its bytes; the output "
            "format from --to or OUT's extension (.rrt, .npy). The input is validated before anything "
            "is written, and OUT is written atomically: a new file renamed over the old one. OUT must be a "
            "regular file or new, in a folder that exists (none is created, as with cp): a symlink is written "
            "through (the file it points to is replaced, the link kept); a FIFO, a device (/dev/null, /dev/full), "
            "a socket, a directory and `-` (stdout) are refused. --to must agree with OUT's extension (.rrt, "
            ".npy; .json for vllm, sglang, megatron); --mode and --zstd apply to .rrt only."
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
        help="codec: keep each row's expert SET (smallest; ids come back sorted) or the exact order (default: a "
        "codec input's own mode, so an ordered file stays ordered; set for any other input)",
    )
    parser.add_argument(
        "--zstd",
        action="store_true",
        help="codec: compress the payload with zstd (extra `zstd`); left out, with a note, where the compressed file "
        "would expand past the default --max-expansion that readers apply",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite OUT if it exists (a symlink is written through, to its file)"
    )
    add_payload_arguments(parser)
    add_codec_limit_arguments(parser)
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.atomicfile import atomic_write
    from routereplay.cli.extras import require
    from routereplay.cli.failure import naming, read_trace_file
    from routereplay.cli.outputs import check_output_file
    from routereplay.errors import OutputPathError
    from routereplay.tracefile.format import FileFormat
    from routereplay.tracefile.io import write_trace

    if Path(args.output).is_dir():
        raise OutputPathError(
            f"{args.output} is a directory; name the output file, e.g. {Path(args.output) / 'out.rrt'}"
        )
    check_output_file("OUT", args.output, force=args.force)  # `-`, a FIFO or device, an unwritable folder
    target = output_format(args.output, args.to, mode=args.mode, zstd=args.zstd)
    if args.zstd:
        require("convert", {"zstandard": "--zstd"})
    trace, source = read_trace_file(args, args.input, payload_hints(args), validate=True)
    mode = codec_mode(trace, source, args.mode, args.input)
    if target is FileFormat.CODEC:
        blob = codec_blob(trace, mode, zstd=args.zstd, output=args.output)
        with naming(args.output):
            written = atomic_write(Path(args.output), blob)
    else:
        with naming(args.output):
            written = write_trace(trace, args.output, target, mode=mode)
    if target is FileFormat.NPY:
        print(
            f"note: .npy keeps only the ids; layers {list(trace.layers)[:4]}..., start {trace.start} and provenance "
            "are dropped (use .rrt to keep them)",
            file=sys.stderr,
        )
    dense = sorted(set(range(max(trace.layers, default=-1) + 1)) - set(trace.layers))
    if target in (FileFormat.VLLM, FileFormat.SGLANG) and dense:
        from routereplay.trace.summary import compact_ranges

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


ENGINE_FORMATS = ("vllm", "sglang", "megatron")


def output_format(output: str, to: str | None, *, mode: str | None = None, zstd: bool = False) -> Any:
    """The format OUT is written in: `--to`, else OUT's extension (.rrt, .npy). Refused: no way to tell, a
    `--to` that contradicts the extension (.npy bytes under .rrt; .json for an engine payload), and the
    codec-only `--mode` / `--zstd` with another output format."""
    from routereplay.errors import ConfigError
    from routereplay.tracefile.format import FileFormat, format_for_path

    implied = format_for_path(output)
    json_named = Path(output).suffix.lower() == ".json"
    if to is None and implied is None:
        raise ConfigError(f"cannot tell the output format from {output!r}; pass --to rrt|npy|vllm|sglang|megatron")
    if to is not None and (
        (implied is not None and FileFormat(to) is not implied) or (json_named and to not in ENGINE_FORMATS)
    ):
        named = str(implied) if implied is not None else "an engine payload (vllm, sglang or megatron)"
        raise ConfigError(
            f"--to {to} contradicts OUT {output!r}, whose extension says {named}: drop --to, or name OUT with the "
            f"extension of {to} ({_EXTENSIONS[to]})"
        )
    target = FileFormat(to) if to is not None else implied
    if target is not FileFormat.CODEC:
        given = [flag for flag, value in (("--mode", mode is not None), ("--zstd", zstd)) if value]
        if given:
            flags, verb = " and ".join(given), "applies" if len(given) == 1 else "apply"
            raise ConfigError(
                f"{flags} only {verb} to a codec (.rrt) output, and OUT {output!r} is written as {target}: drop "
                f"{flags}, or convert to .rrt"
            )
    return target


_EXTENSIONS = {"rrt": ".rrt", "npy": ".npy", "vllm": ".json", "sglang": ".json", "megatron": ".json"}


def codec_mode(trace: RouteTrace, source: Any, asked: str | None, path: str) -> str:
    """The codec mode to write: `--mode` if given, else a codec input's own mode (an ordered file stays
    ordered), else set. `--mode ordered` on a set-mode input is refused: its order is already lost."""
    from routereplay.errors import OrderLostError
    from routereplay.tracefile.format import FileFormat

    if asked == "ordered" and not trace.ordered:
        raise OrderLostError(
            f"{path} keeps only each row's expert set (a set-mode codec file: ids come back sorted), so "
            "--mode ordered would write an order that was never recorded; drop --mode ordered (or use --mode set)"
        )
    if asked is not None:
        return asked
    return "ordered" if source is FileFormat.CODEC and trace.ordered else "set"


def codec_blob(trace: RouteTrace, mode: str, *, zstd: bool, output: str, limits: CodecLimits | None = None) -> bytes:
    """The codec bytes `convert` writes: zstd-compressed only where readers within `limits` (default
    `CodecLimits()`) accept the result; notes on stderr when zstd was left out, made the file larger,
    or the file needs raised limits to be read back."""
    from routereplay.codec.blob import encode

    limits = CodecLimits() if limits is None else limits
    plain = encode(trace, mode=mode, compress=False)
    blob = plain
    if zstd:
        packed = encode(trace, mode=mode, compress=True)
        if _raised_limits(trace, len(packed), limits) and not _raised_limits(trace, len(plain), limits):
            ratio = _decoded_bytes(trace) // max(len(packed), 1)
            print(
                f"note: wrote {output} without zstd ({len(plain)} B): compressed ({len(packed)} B) it would decode to "
                f"{ratio}x its size, above the default --max-expansion {limits.max_expansion} that readers "
                "(routereplay inspect, read_trace, decode) apply, so they would refuse it; the uncompressed file "
                "is within the default limits",
                file=sys.stderr,
            )
        else:
            blob = packed
            if len(packed) > len(plain):
                print(
                    f"note: --zstd made {output} larger ({len(packed)} B against {len(plain)} B without it): the "
                    "codec's bit-packed ids are already close to their entropy; leave out --zstd for traces like "
                    "this one",
                    file=sys.stderr,
                )
    flags = _raised_limits(trace, len(blob), limits)
    if flags:
        print(
            f"note: {output} is beyond the default codec limits (a zero-bit layout, top-k == experts or one expert, "
            f"or more than {limits.max_entries} ids): read it back with {' '.join(flags)}",
            file=sys.stderr,
        )
    return blob


def _decoded_bytes(trace: RouteTrace) -> int:
    from routereplay.trace.validation import canonical_dtype

    return trace.num_tokens * trace.num_layers * trace.top_k * canonical_dtype(trace.num_experts).itemsize


def _raised_limits(trace: RouteTrace, blob_bytes: int, limits: CodecLimits) -> list[str]:
    """The flags (`--max-entries N`, `--max-expansion N`) a reader within `limits` needs for this blob; [] if none."""
    entries = trace.num_tokens * trace.num_layers * trace.top_k
    flags = []
    if max(entries, trace.num_tokens) > limits.max_entries:
        flags.append(f"--max-entries {max(entries, trace.num_tokens)}")
    expansion = -(-_decoded_bytes(trace) // max(blob_bytes, 1))
    if expansion > limits.max_expansion:
        flags.append(f"--max-expansion {expansion}")
    return flags
