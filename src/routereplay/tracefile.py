"""Trace files on disk: recognise, read and write every format routereplay speaks.

Formats: the compact codec (`.rrt`, self-describing), `.npy` arrays (ids only), and engine payloads
saved as JSON (a vLLM response, an SGLang `/generate` response or `meta_info`, a Megatron response).
Engine payloads do not say how many experts the model has (nor, for SGLang, the layer count and
top-k): those come from `PayloadHints`. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from routereplay import codec
from routereplay.engines.megatron import decode_megatron
from routereplay.engines.payload import NPY_MAGIC, load_npy, npy_bytes
from routereplay.engines.sglang import decode_sglang
from routereplay.engines.vllm import decode_vllm
from routereplay.enums import CodecMode, StrEnum
from routereplay.errors import ConfigError, PayloadEncodingError
from routereplay.trace import RouteTrace

MAX_FILE_BYTES = 8 << 30


class FileFormat(StrEnum):
    CODEC = "rrt"
    NPY = "npy"
    VLLM = "vllm"
    SGLANG = "sglang"
    MEGATRON = "megatron"


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHints:
    """Model facts an engine payload does not carry (None = unknown)."""

    num_experts: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    moe_layers: Sequence[int] | None = None
    layers: Sequence[int] | None = None
    num_tokens: int | None = None
    start: int = 0
    index: int = 0  # choice / request index inside a response


def sniff(data: bytes) -> tuple[FileFormat, Any]:
    """Recognise a file's format from its bytes; JSON documents come back parsed (else None)."""
    if data.startswith(codec.MAGIC):
        return FileFormat.CODEC, None
    if data.startswith(NPY_MAGIC):
        return FileFormat.NPY, None
    document = parse_json(data)
    return engine_of(document), document


def parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PayloadEncodingError(
            "not a routereplay codec file, a .npy array, nor a JSON engine response; "
            f"the file starts with {data[:12]!r}"
        ) from None


def engine_of(document: Any) -> FileFormat:
    """Which engine produced a parsed JSON response (by the fields it carries)."""
    if isinstance(document, list) and document and isinstance(document[0], dict):
        document = document[0]
    if isinstance(document, dict):
        if "moe_topk_indices" in document or any(
            isinstance(c, dict) and "moe_topk_indices" in c for c in document.get("choices", []) or []
        ):
            return FileFormat.MEGATRON
        if {"meta_info", "sglext"} & document.keys() or "routed_experts_dtype" in document:
            return FileFormat.SGLANG
        choices = document.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            if "sgl_ext" in choices[0]:
                return FileFormat.SGLANG
            if "routed_experts" in choices[0]:
                return FileFormat.VLLM
        if "prompt_routed_experts" in document:
            return FileFormat.VLLM
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
) -> tuple[RouteTrace, FileFormat]:
    """Read any supported file into a `RouteTrace`; returns the trace and the format it had."""
    hints = hints or PayloadHints()
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is {size} bytes, above the {MAX_FILE_BYTES}-byte limit for one trace file")
    data = path.read_bytes()
    if engine is None:
        found, document = sniff(data)
    else:
        found = FileFormat(engine)
        document = parse_json(data) if found not in (FileFormat.CODEC, FileFormat.NPY) else None
    where = path.name
    if found is FileFormat.CODEC:
        trace = codec.decode(data)
        return (trace.validate(where) if validate else trace), found
    if found is FileFormat.NPY:
        array = load_npy(data, where)
        num_experts = _need(hints.num_experts, "num_experts", path)
        trace = RouteTrace(array, num_experts, hints.layers, hints.start)
        return (trace.validate(where) if validate else trace), found
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
    atomic_write(Path(path), data)
    return len(data)


def engine_payload(trace: RouteTrace, fmt: FileFormat | str) -> dict[str, Any]:
    """The JSON response an engine would send for this trace, in that engine's exact wire form."""
    import base64

    fmt = FileFormat(fmt)
    if fmt is FileFormat.VLLM:
        if not trace.routed_mask.all():
            raise ConfigError(
                "vLLM >= 0.22's wire form (uint8/uint16 .npy) has no -1 sentinel, and this trace has "
                f"{int((~trace.routed_mask).sum())} unrouted rows; write codec (.rrt) or sglang instead"
            )
        wire = trace.experts.astype(np.uint8 if trace.num_experts <= 256 else np.uint16)
        text = base64.b64encode(npy_bytes(wire)).decode("ascii")
        return {"object": "text_completion", "choices": [{"index": 0, "routed_experts": text}]}
    if fmt is FileFormat.SGLANG:
        text = base64.b64encode(trace.experts.astype("<i4").tobytes()).decode("ascii")
        return {"meta_info": {"routed_experts": text}}
    if fmt is FileFormat.MEGATRON:
        return {"moe_topk_indices": trace.experts.tolist()}
    raise ConfigError(f"{fmt} is not an engine payload format")


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def format_for_path(path: str | Path) -> FileFormat | None:
    """The output format an extension implies (`.rrt`, `.npy`), or None when it does not say."""
    suffix = Path(path).suffix.lower()
    return {".rrt": FileFormat.CODEC, ".npy": FileFormat.NPY}.get(suffix)


def _need(value: int | None, name: str, path: Path) -> int:
    if value is None:
        flag = "--" + name.replace("_", "-")
        raise ConfigError(
            f"{path.name}: the payload does not record {name}; pass {name}= (CLI: {flag}), taken from the "
            "model's config.json"
        )
    return value


__all__ = [
    "FileFormat",
    "PayloadHints",
    "atomic_write",
    "engine_payload",
    "format_for_path",
    "read_trace",
    "sniff",
    "write_trace",
]
