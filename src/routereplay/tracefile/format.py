"""Which format a trace file is in: the `FileFormat` names, and recognising one from a file's bytes.

Codec files and `.npy` arrays are recognised by their magic bytes; anything else must be a JSON engine
response (parsed within `JsonLimits`), whose fields say which engine sent it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routereplay.codec.header import MAGIC
from routereplay.enums import StrEnum
from routereplay.errors import JsonDocumentError, PayloadEncodingError
from routereplay.jsondocument import JsonLimits, load_json, looks_like_json
from routereplay.wire.payload import NPY_MAGIC


class FileFormat(StrEnum):
    CODEC = "rrt"
    NPY = "npy"
    VLLM = "vllm"
    SGLANG = "sglang"
    MEGATRON = "megatron"


def sniff(data: bytes, limits: JsonLimits | None = None) -> tuple[FileFormat, Any]:
    """Recognise a file's format from its bytes; JSON documents come back parsed (else None)."""
    if data.startswith(MAGIC):
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


def format_for_path(path: str | Path) -> FileFormat | None:
    """The output format an extension implies (`.rrt`, `.npy`), or None when it does not say."""
    suffix = Path(path).suffix.lower()
    return {".rrt": FileFormat.CODEC, ".npy": FileFormat.NPY}.get(suffix)
