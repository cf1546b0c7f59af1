"""Trace files on disk: recognise, read and write every format routereplay speaks.

Formats: the compact codec (`.rrt`, self-describing), `.npy` arrays (ids only), and engine payloads
saved as JSON (a vLLM response, an SGLang `/generate` response or `meta_info`, a Megatron response).
Engine payloads do not say how many experts the model has (nor, for SGLang, the layer count and
top-k): those come from `PayloadHints`. Writes are atomic (`routereplay.atomicfile`).

Formats are named and recognised in `routereplay.tracefile.format`; the hints and the engine payloads
written here (with the `"routereplay"` object that keeps global layer numbers across a conversion) are
`routereplay.tracefile.payload`.

Reading is bounded: files above `TraceFileLimits.max_file_bytes` are refused before they are read,
JSON documents are parsed by `routereplay.jsondocument.load_json` within `TraceFileLimits.json`
(size, nesting depth, number length, finite numbers only), codec files are decoded within
`TraceFileLimits.codec` (`routereplay.codec.limits.CodecLimits`: ids, expansion over the file's size,
set-mode table). Raise `codec` to read a trusted file beyond the defaults (CLI: `--max-expansion`,
`--max-entries`), e.g. a zstd-compressed trace of almost only -1 rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routereplay.atomicfile import atomic_write
from routereplay.codec import blob as codec
from routereplay.codec.header import MAGIC
from routereplay.codec.limits import CodecLimits
from routereplay.enums import CodecMode
from routereplay.errors import ConfigError, JsonDocumentError
from routereplay.jsondocument import JsonLimits
from routereplay.trace.route_trace import RouteTrace
from routereplay.tracefile.format import FileFormat, parse_json, sniff
from routereplay.tracefile.payload import (
    PayloadHints,
    check_recorded,
    check_required,
    engine_payload,
    required_hint,
    with_carried,
)
from routereplay.wire.limits import is_int
from routereplay.wire.megatron import decode_megatron
from routereplay.wire.payload import NPY_MAGIC, load_npy, npy_bytes
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

DEFAULT_MAX_FILE_BYTES = 8 << 30  # any trace file (codec, .npy, JSON); JSON also obeys JsonLimits.max_bytes
MAX_FILE_BYTES = DEFAULT_MAX_FILE_BYTES  # the name earlier releases exported


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceFileLimits:
    """What `read_trace` reads: files up to `max_file_bytes`, JSON documents within `json`, codec files
    decoded within `codec` (e.g. `TraceFileLimits(codec=CodecLimits(max_expansion=1 << 16))` for a
    trusted zstd file of almost only -1 rows)."""

    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    json: JsonLimits = field(default_factory=JsonLimits)
    codec: CodecLimits = field(default_factory=CodecLimits)

    def __post_init__(self) -> None:
        if not (is_int(self.max_file_bytes) and self.max_file_bytes >= 1):
            raise ConfigError(f"TraceFileLimits.max_file_bytes={self.max_file_bytes!r} must be a positive int")
        if not isinstance(self.json, JsonLimits):
            raise ConfigError(f"TraceFileLimits.json must be a JsonLimits, got {type(self.json).__name__}")
        if not isinstance(self.codec, CodecLimits):
            raise ConfigError(
                f"TraceFileLimits.codec must be a routereplay.codec.CodecLimits, got {type(self.codec).__name__}"
            )


def read_trace(
    path: str | Path,
    hints: PayloadHints | None = None,
    *,
    engine: FileFormat | str | None = None,
    validate: bool = True,
    limits: TraceFileLimits | None = None,
) -> tuple[RouteTrace, FileFormat]:
    """Read any supported file into a `RouteTrace`; returns the trace and the format it had.

    Sizes are checked before the file is read: `limits.max_file_bytes` for any file,
    `limits.json.max_bytes` for a JSON document (then its depth and numbers, see `load_json`);
    a codec file is decoded within `limits.codec` (`CodecLimitError` beyond it, before allocating).
    """
    hints = PayloadHints() if hints is None else hints
    limits = TraceFileLimits() if limits is None else limits
    if not isinstance(hints, PayloadHints):
        raise ConfigError(f"hints must be a PayloadHints, got {type(hints).__name__}")
    if not isinstance(limits, TraceFileLimits):
        raise ConfigError(f"limits must be a TraceFileLimits, got {type(limits).__name__}")
    found = _engine_format(engine)
    path = Path(path)
    where = path.name
    data = _read_bounded(path, limits)
    if found is None:
        found, document = sniff(data, limits.json)
    elif found in (FileFormat.CODEC, FileFormat.NPY):
        document = None
    else:
        document = parse_json(data, limits.json, where=where)
    if found is FileFormat.CODEC:
        trace = codec.decode(data, limits=limits.codec)
        check_recorded(hints, trace, where)
        return (trace.validate(where) if validate else trace), found
    if found is FileFormat.NPY:
        array = load_npy(data, where)
        num_experts = required_hint(hints.num_experts, "num_experts", path)
        trace = RouteTrace(array, num_experts, hints.layers, hints.start)
        return (trace.validate(where) if validate else trace), found
    hints = with_carried(hints, document, found, where)
    sglang = found is FileFormat.SGLANG  # SGLang's payload also leaves out its layer count and top-k
    check_required(hints, ("num_experts", "num_layers", "top_k") if sglang else ("num_experts",), path)
    num_experts = required_hint(hints.num_experts, "num_experts", path)
    common: dict[str, Any] = {
        "num_experts": num_experts,
        "moe_layers": hints.moe_layers,
        "layers": hints.layers,
        "num_tokens": hints.num_tokens,
        "sequence": where,
        "validate": validate,
    }
    if found is FileFormat.VLLM:
        trace = decode_vllm(
            document,
            num_layers=hints.num_layers,
            top_k=hints.top_k,
            prompt_start=hints.start,
            choice=hints.index,
            **common,
        )
    elif found is FileFormat.SGLANG:
        trace = decode_sglang(
            document,
            num_layers=required_hint(hints.num_layers, "num_layers", path),
            top_k=required_hint(hints.top_k, "top_k", path),
            start_len=hints.start,
            index=hints.index,
            choice=hints.index,
            **common,
        )
    else:
        trace = decode_megatron(
            document, num_layers=hints.num_layers, top_k=hints.top_k, start=hints.start, index=hints.index, **common
        )
    return trace, found


def write_trace(
    trace: RouteTrace,
    path: str | Path,
    fmt: FileFormat | str,
    *,
    mode: CodecMode | str = CodecMode.SET,
    compress: bool = False,
) -> int:
    """Write `trace` as `fmt` atomically; returns the bytes written."""
    fmt = FileFormat(fmt)
    if fmt is FileFormat.CODEC:
        data = codec.encode(trace, mode=mode, compress=compress)
    elif fmt is FileFormat.NPY:
        data = npy_bytes(trace.experts)
    else:
        data = json.dumps(engine_payload(trace, fmt)).encode()
    return atomic_write(Path(path), data)


def _engine_format(engine: FileFormat | str | None) -> FileFormat | None:
    if engine is None:
        return None
    try:
        return FileFormat(engine)
    except ValueError:
        raise ConfigError(
            f"engine={engine!r} is not a trace format; use one of {', '.join(f.value for f in FileFormat)}"
        ) from None


def _read_bounded(path: Path, limits: TraceFileLimits) -> bytes:
    """The file's bytes; refused before reading when above the limit for what its first bytes say it is."""
    try:
        size = path.stat().st_size
        if size > limits.max_file_bytes:
            raise ConfigError(
                f"{path} is {size} bytes, above the {limits.max_file_bytes}-byte limit for one trace file "
                "(TraceFileLimits.max_file_bytes)"
            )
        with path.open("rb") as stream:
            head = stream.read(len(NPY_MAGIC))
            binary = head.startswith(MAGIC) or head.startswith(NPY_MAGIC)
            if not binary and size > limits.json.max_bytes:
                raise JsonDocumentError(
                    f"{path} is {size} bytes and not a codec or .npy file; a JSON engine response above the "
                    f"{limits.json.max_bytes}-byte limit (JsonLimits.max_bytes) is not read: raise the limit if "
                    "it is genuine"
                )
            rest = stream.read(max(size - len(head), 0))  # read(n) allocates n bytes first: n is the checked size
            if stream.read(1):
                raise ConfigError(f"{path} grew while it was read; read it once its writer has finished")
            return head + rest
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


__all__ = ["DEFAULT_MAX_FILE_BYTES", "MAX_FILE_BYTES", "TraceFileLimits", "read_trace", "write_trace"]
