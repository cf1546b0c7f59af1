"""Trace files on disk: recognise, read and write every format routereplay speaks.

Formats: the compact codec (`.rrt`, self-describing), `.npy` arrays (ids only), and engine payloads
saved as JSON (a vLLM response, an SGLang `/generate` response or `meta_info`, a Megatron response).
Engine payloads do not say how many experts the model has (nor, for SGLang, the layer count and
top-k): those come from `PayloadHints`. Writes are atomic (`routereplay.atomicfile`).

Engine payloads written here (`engine_payload`) are in the engine's own wire form, so a trace's
global layer numbers survive: vLLM and SGLang send every hidden layer (dense layers zero-filled),
so layers 1-26 of a dense-first model are written as 27 layers with layer 0 zero-filled; Megatron
sends its MoE layers only. Every written payload also carries a `"routereplay"` object (layers,
num_experts, top_k, start, num_layers) that `read_trace` uses where `PayloadHints` say nothing, so
`convert a.rrt b.json --to vllm` then `inspect b.json` shows the same layers as `a.rrt`.

Reading is bounded: files above `TraceFileLimits.max_file_bytes` are refused before they are read,
JSON documents are parsed by `routereplay.jsondocument.load_json` within `TraceFileLimits.json`
(size, nesting depth, number length, finite numbers only), codec files are decoded within
`TraceFileLimits.codec` (`routereplay.codec_limits.CodecLimits`: ids, expansion over the file's size,
set-mode table). Raise `codec` to read a trusted file beyond the defaults (CLI: `--max-expansion`,
`--max-entries`), e.g. a zstd-compressed trace of almost only -1 rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from routereplay import codec
from routereplay.atomicfile import atomic_write
from routereplay.codec_limits import CodecLimits
from routereplay.engines.megatron import decode_megatron
from routereplay.engines.payload import NPY_MAGIC, load_npy, npy_bytes
from routereplay.engines.sglang import decode_sglang
from routereplay.engines.vllm import decode_vllm
from routereplay.enums import CodecMode, StrEnum
from routereplay.errors import ConfigError, JsonDocumentError, LayerCountError, PayloadEncodingError
from routereplay.jsondocument import JsonLimits, load_json, looks_like_json
from routereplay.summary import compact_ranges
from routereplay.trace import RouteTrace

DEFAULT_MAX_FILE_BYTES = 8 << 30  # any trace file (codec, .npy, JSON); JSON also obeys JsonLimits.max_bytes
MAX_FILE_BYTES = DEFAULT_MAX_FILE_BYTES  # the name earlier releases exported
CARRIED_FIELD = "routereplay"  # the object engine payloads written here carry: layers, geometry, start
MAX_CARRIED_LAYERS = 4096  # a model with more decoder layers than this does not exist


class FileFormat(StrEnum):
    CODEC = "rrt"
    NPY = "npy"
    VLLM = "vllm"
    SGLANG = "sglang"
    MEGATRON = "megatron"


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHints:
    """Model facts an engine payload does not carry (None = unknown). Types are checked here."""

    num_experts: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    moe_layers: Sequence[int] | None = None
    layers: Sequence[int] | None = None
    num_tokens: int | None = None
    start: int = 0
    index: int = 0  # choice / request index inside a response

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "top_k", "num_tokens"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ConfigError(f"{name}={value!r} must be a positive int or None (CLI: {_flag(name)})")
        for name in ("start", "index"):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be a non-negative int (CLI: {_flag(name)})")
        for name in ("moe_layers", "layers"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, (str, bytes))
                or not isinstance(value, (Sequence, np.ndarray))
                or not all(_is_int(x) and x >= 0 for x in value)
            ):
                raise ConfigError(
                    f"{name}={value!r} must be a sequence of non-negative global layer numbers or None "
                    f"(CLI: {_flag(name)} 1-26)"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceFileLimits:
    """What `read_trace` reads: files up to `max_file_bytes`, JSON documents within `json`, codec files
    decoded within `codec` (e.g. `TraceFileLimits(codec=CodecLimits(max_expansion=1 << 16))` for a
    trusted zstd file of almost only -1 rows)."""

    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    json: JsonLimits = field(default_factory=JsonLimits)
    codec: CodecLimits = field(default_factory=CodecLimits)

    def __post_init__(self) -> None:
        if not (_is_int(self.max_file_bytes) and self.max_file_bytes >= 1):
            raise ConfigError(f"TraceFileLimits.max_file_bytes={self.max_file_bytes!r} must be a positive int")
        if not isinstance(self.json, JsonLimits):
            raise ConfigError(f"TraceFileLimits.json must be a JsonLimits, got {type(self.json).__name__}")
        if not isinstance(self.codec, CodecLimits):
            raise ConfigError(
                f"TraceFileLimits.codec must be a routereplay.codec.CodecLimits, got {type(self.codec).__name__}"
            )


def sniff(data: bytes, limits: JsonLimits | None = None) -> tuple[FileFormat, Any]:
    """Recognise a file's format from its bytes; JSON documents come back parsed (else None)."""
    if data.startswith(codec.MAGIC):
        return FileFormat.CODEC, None
    if data.startswith(NPY_MAGIC):
        return FileFormat.NPY, None
    document = parse_json(data, limits)
    return engine_of(document), document


def parse_json(data: bytes, limits: JsonLimits | None = None, *, where: str = "file") -> Any:
    """A JSON engine response within `limits`; anything else is a `PayloadEncodingError` saying what it is."""
    if not looks_like_json(data):
        raise PayloadEncodingError(
            f"{where}: not a routereplay codec file, a .npy array, nor a JSON engine response; "
            f"the file starts with {data[:12]!r}"
        )
    return load_json(data, what=f"{where} (a JSON engine response)", error=JsonDocumentError, limits=limits)


def engine_of(document: Any) -> FileFormat:
    """Which engine produced a parsed JSON response (by the fields it carries)."""
    if isinstance(document, list) and document and isinstance(document[0], dict):
        document = document[0]
    if isinstance(document, dict):
        choices = document.get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if "moe_topk_indices" in document or (
            isinstance(choices, list) and any(isinstance(c, dict) and "moe_topk_indices" in c for c in choices)
        ):
            return FileFormat.MEGATRON
        if {"meta_info", "sglext"} & document.keys() or "routed_experts_dtype" in document:
            return FileFormat.SGLANG
        if "sgl_ext" in first:
            return FileFormat.SGLANG
        if "routed_experts" in first or "prompt_routed_experts" in document:
            return FileFormat.VLLM
        if "choices" in document and not isinstance(choices, list):
            raise PayloadEncodingError(
                f"the response's 'choices' is a {type(choices).__name__} ({str(choices)[:40]}), not a list of "
                "choices: not an engine response this release knows"
            )
    raise PayloadEncodingError(
        "a JSON document with no routed experts field this release knows (vLLM choices[i].routed_experts, "
        "SGLang meta_info/sglext/sgl_ext, Megatron moe_topk_indices); pass --engine to say which it is"
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
        return (trace.validate(where) if validate else trace), found
    if found is FileFormat.NPY:
        array = load_npy(data, where)
        num_experts = _need(hints.num_experts, "num_experts", path)
        trace = RouteTrace(array, num_experts, hints.layers, hints.start)
        return (trace.validate(where) if validate else trace), found
    hints = _with_carried(hints, document, found, where)
    num_experts = _need(hints.num_experts, "num_experts", path)
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
            num_layers=_need(hints.num_layers, "num_layers", path),
            top_k=_need(hints.top_k, "top_k", path),
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


def engine_payload(trace: RouteTrace, fmt: FileFormat | str) -> dict[str, Any]:
    """The JSON response an engine would send for this trace, in that engine's exact wire form.

    vLLM and SGLang payloads hold every hidden layer 0..max(layers), dense layers zero-filled (as
    those engines send them); Megatron's holds the trace's layers in order. Each carries the
    `"routereplay"` object, so `read_trace` restores the global layer numbers and the start.
    """
    import base64

    fmt = FileFormat(fmt)
    carried: dict[str, Any] = {
        "layers": list(trace.layers),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "start": trace.start,
    }
    if fmt is FileFormat.MEGATRON:
        return {"moe_topk_indices": trace.experts.tolist(), CARRIED_FIELD: carried}
    if fmt not in (FileFormat.VLLM, FileFormat.SGLANG):
        raise ConfigError(f"{fmt} is not an engine payload format")
    num_layers = max(trace.layers, default=-1) + 1
    if num_layers > MAX_CARRIED_LAYERS:
        raise ConfigError(
            f"layer number {num_layers - 1} is above {MAX_CARRIED_LAYERS - 1}: an all-layer {fmt} payload would hold "
            f"{num_layers} layers; write codec (.rrt) instead"
        )
    carried["num_layers"] = num_layers
    if fmt is FileFormat.VLLM:
        if not trace.routed_mask.all():
            raise ConfigError(
                "vLLM >= 0.22's wire form (uint8/uint16 .npy) has no -1 sentinel, and this trace has "
                f"{int((~trace.routed_mask).sum())} unrouted rows; write codec (.rrt) or sglang instead"
            )
        wire = _all_layers(trace, num_layers, np.dtype(np.uint8 if trace.num_experts <= 256 else np.uint16))
        text = base64.b64encode(npy_bytes(wire)).decode("ascii")
        return {"object": "text_completion", "choices": [{"index": 0, "routed_experts": text}], CARRIED_FIELD: carried}
    text = base64.b64encode(_all_layers(trace, num_layers, np.dtype("<i4")).tobytes()).decode("ascii")
    return {"meta_info": {"routed_experts": text}, CARRIED_FIELD: carried}


def format_for_path(path: str | Path) -> FileFormat | None:
    """The output format an extension implies (`.rrt`, `.npy`), or None when it does not say."""
    suffix = Path(path).suffix.lower()
    return {".rrt": FileFormat.CODEC, ".npy": FileFormat.NPY}.get(suffix)


def _all_layers(trace: RouteTrace, num_layers: int, dtype: np.dtype[Any]) -> np.ndarray:
    """(T, num_layers, K) in `dtype`: the trace's layers at their global numbers, zeros elsewhere."""
    if trace.layers == tuple(range(num_layers)):
        return np.ascontiguousarray(trace.experts, dtype=dtype)
    experts_TLK = np.zeros((trace.num_tokens, num_layers, trace.top_k), dtype)
    experts_TLK[:, list(trace.layers)] = trace.experts
    return experts_TLK


def _need(value: int | None, name: str, path: Path) -> int:
    if value is None:
        raise ConfigError(
            f"{path.name}: the payload does not record {name}; pass {name}= (CLI: {_flag(name)}), taken from the "
            "model's config.json"
        )
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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
            binary = head.startswith(codec.MAGIC) or head.startswith(NPY_MAGIC)
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


def _with_carried(hints: PayloadHints, document: Any, found: FileFormat, where: str) -> PayloadHints:
    """Fill what `hints` leave unsaid from the `"routereplay"` object of a payload `engine_payload` wrote."""
    carried = document.get(CARRIED_FIELD) if isinstance(document, dict) else None
    if carried is None:
        return hints
    problem = _carried_problem(carried)
    if problem:
        raise PayloadEncodingError(
            f"{where}: the '{CARRIED_FIELD}' object is malformed ({problem}); remove it and pass --num-experts, "
            "--moe-layers (and for SGLang --num-layers, --top-k)"
        )
    layers = [int(x) for x in carried["layers"]]
    written = carried.get("num_layers")
    if found is not FileFormat.MEGATRON and None not in (hints.num_layers, written) and hints.num_layers != written:
        raise LayerCountError(
            f"{where}: num_layers={hints.num_layers} (CLI: --num-layers), but routereplay wrote this payload with "
            f"{written} layers (every hidden layer; MoE layers {compact_ranges(layers)} in its '{CARRIED_FIELD}' "
            "object); leave --num-layers out"
        )
    update: dict[str, Any] = {
        "num_experts": hints.num_experts if hints.num_experts is not None else carried["num_experts"],
        "top_k": hints.top_k if hints.top_k is not None else carried["top_k"],
        "start": hints.start if hints.start else carried["start"],
    }
    if hints.moe_layers is None and hints.layers is None:
        update["layers" if found is FileFormat.MEGATRON else "moe_layers"] = layers
    if found is not FileFormat.MEGATRON and hints.num_layers is None:
        update["num_layers"] = carried.get("num_layers", max(layers) + 1)
    return replace(hints, **update)


def _carried_problem(carried: Any) -> str:
    """What is wrong with a `"routereplay"` object ("" when nothing)."""
    if not isinstance(carried, dict):
        return f"a {type(carried).__name__}, expected an object"
    layers = carried.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_CARRIED_LAYERS:
        return f"'layers' must be a list of 1 to {MAX_CARRIED_LAYERS} layer numbers"
    if not all(_is_int(x) and 0 <= x < MAX_CARRIED_LAYERS for x in layers) or len(set(layers)) != len(layers):
        return f"'layers' must hold distinct layer numbers in [0, {MAX_CARRIED_LAYERS})"
    for name in ("num_experts", "top_k"):
        if not (_is_int(carried.get(name)) and carried[name] >= 1):
            return f"'{name}' must be a positive int"
    if not (_is_int(carried.get("start")) and carried["start"] >= 0):
        return "'start' must be a non-negative int"
    if "num_layers" in carried and not (
        _is_int(carried["num_layers"]) and max(layers) < carried["num_layers"] <= MAX_CARRIED_LAYERS
    ):
        return f"'num_layers' must be an int above every layer number, at most {MAX_CARRIED_LAYERS}"
    return ""


__all__ = [
    "CARRIED_FIELD",
    "DEFAULT_MAX_FILE_BYTES",
    "MAX_FILE_BYTES",
    "FileFormat",
    "PayloadHints",
    "TraceFileLimits",
    "atomic_write",
    "engine_payload",
    "format_for_path",
    "read_trace",
    "sniff",
    "write_trace",
]
