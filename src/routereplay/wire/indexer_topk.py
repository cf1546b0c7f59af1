"""Decode SGLang's DSA indexer top-k (`return_indexer_topk`) into an `IndexerTrace`.

SGLang captures, per token and DSA layer, the `index_topk` key positions the indexer picked, when
the server runs with `--enable-return-indexer-topk` and a request sets `return_indexer_topk: true`
(Miles: `--use-rollout-indexer-replay`). The wire form mirrors routed experts
(sglang `python/sglang/srt/state_capturer/indexer_topk.py`, `extract_indexer_topk_from_meta_info`):
- `/generate`: `meta_info.indexer_topk` = base64 of the RAW flattened int32 bytes, no shape header,
  shape (seqlen - 1, num_indexer_layers, index_topk): one row per token but the last, every layer
  that owns an indexer. The sglang-miles build adds `meta_info.indexer_topk_num_layers`; Miles
  recovers index_topk from the byte length. Values are token positions, -1 is padding
  (`test/registered/rl/test_return_indexer_topk.py`). The OpenAI surface (`SglExt.indexer_topk`)
  is not wired upstream yet; a per-choice `meta_info` or `sgl_ext` is read when present.
- In-process (`skip_tokenizer_init`, an output store) an ndarray / tensor; nested lists are accepted too.
Rows are canonicalised (`routereplay.indexer.canonical`): -1 and positions after the query are
dropped (the kernel's padding for short prefixes), the rest sorted. Repeats and partial rows are
refused, never guessed; a row left empty becomes "unknown" (all -1: replay computes it live).
Legend: T = rows (tokens but the last), L = indexer layers, I = index_topk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.errors import (
    DtypeError,
    IndexerRouteError,
    LayerCountError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadSizeError,
    RowCountError,
    TopKMismatchError,
    location,
)
from routereplay.indexer.canonical import canonicalise
from routereplay.indexer.limits import DEFAULT_INDEXER_LIMITS, MAX_POSITION, IndexerLimits, checked_indexer_limits
from routereplay.indexer.trace import DEFAULT_BLOCK_ROWS, IndexerTrace, checked_layers
from routereplay.wire.limits import checked_int, checked_optional_int, checked_sequence_name, is_int
from routereplay.wire.payload import (
    DEFAULT_MAX_BYTES,
    b64_to_bytes,
    is_array_like,
    lists_to_array,
    mapping,
    pick,
    pick_choice,
    require_present,
    to_numpy,
)

_HINT = (
    "the request did not set return_indexer_topk: true, the server lacks --enable-return-indexer-topk, the "
    "model has no DSA indexer layers, or the request was aborted before any forward pass"
)


def decode_sglang_indexer(
    value: Any,
    *,
    num_layers: int | None = None,
    index_topk: int | None = None,
    layers: Sequence[int] | None = None,
    num_tokens: int | None = None,
    index: int = 0,
    choice: int = 0,
    sequence: str | int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    limits: IndexerLimits | None = DEFAULT_INDEXER_LIMITS,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> IndexerTrace:
    """One SGLang request's indexer choices as a canonical `IndexerTrace` (row 0 = token 0).

    `value` is a `/generate` response (a list of them: `index` picks one), its `meta_info`, an
    OpenAI-style response (`choice`), the base64 text, an ndarray / tensor or nested lists.
    `num_layers` defaults to `meta_info.indexer_topk_num_layers` (both given must agree);
    `index_topk` (the config's `index_topk`) is recovered from the byte length when the row count is
    known. `num_tokens` (prompt + output) defaults to `meta_info` prompt_tokens + completion_tokens;
    the payload must hold num_tokens - 1 rows. `layers` are the global numbers of the indexer layers
    (default 0 .. L - 1). Shapes beyond `limits` (an `IndexerLimits`; None = the defaults) are refused
    before anything is allocated.
    """
    limits = checked_indexer_limits(limits)  # ConfigError for anything but IndexerLimits / None
    num_layers = checked_optional_int(num_layers, "num_layers", minimum=1)
    index_topk = checked_optional_int(index_topk, "index_topk", minimum=1)
    num_tokens = checked_optional_int(num_tokens, "num_tokens", minimum=1)
    layer_tuple = None if layers is None else checked_layers(layers)  # ConfigError for 5, 1.5, "0,1", [1.5]
    index, choice, max_bytes = (
        checked_int(index, "index"),
        checked_int(choice, "choice"),
        checked_int(max_bytes, "max_bytes"),
    )
    where = checked_sequence_name(sequence)
    what = f"{location(where)} indexer_topk" if where is not None else "indexer_topk"
    meta, payload = _locate(value, index, choice, what)
    if meta is not None:
        num_layers = _meta_layers(meta, num_layers, what)
        if num_tokens is None:
            prompt: Any = meta.get("prompt_tokens")
            completion: Any = meta.get("completion_tokens")
            if is_int(prompt) and is_int(completion):
                total = int(prompt) + int(completion)
                if int(prompt) >= 0 and int(completion) >= 0 and total >= 1:
                    num_tokens = min(total, limits.max_tokens + 1)
    rows = None if num_tokens is None else num_tokens - 1
    array = _to_array(payload, num_layers, index_topk, rows, max_bytes, limits, what)
    T, L, I = array.shape
    if rows is not None and T != rows:
        raise RowCountError(
            f"{what}: {T} rows, but num_tokens={num_tokens} gives {rows} (SGLang returns seqlen - 1 rows: every token "
            "but the last); check num_tokens, or whether a prefix was returned twice or cut"
        )
    if num_layers is not None and L != num_layers:
        raise LayerCountError(
            f"{what}: {L} layers in the payload, num_layers={num_layers}: pass the indexer layer count"
        )
    if index_topk is not None and I != index_topk:
        raise TopKMismatchError(f"{what}: rows of {I} slots, index_topk={index_topk}: pass the config's index_topk")
    layer_numbers = tuple(range(L)) if layer_tuple is None else layer_tuple
    if len(layer_numbers) != L:
        raise LayerCountError(f"{what}: {L} indexer layers in the payload but layers= names {len(layer_numbers)}")
    if array.size and int(array.max()) > MAX_POSITION:
        raise IndexerRouteError(f"{what}: position {int(array.max())} does not fit int32; the payload is corrupt")
    canonical_TLI = canonicalise(array, 0, what)
    return IndexerTrace.from_dense(canonical_TLI, layer_numbers, I, 0, block_rows=block_rows)


def _locate(value: Any, index: int, choice: int, what: str) -> tuple[dict[str, Any] | None, Any]:
    """(meta_info or None, payload) from whichever response shape was given."""
    if isinstance(value, list) and value and isinstance(value[0], dict):  # a batched /generate
        value = pick(value, index, "requests", what)
    if not isinstance(value, dict):
        return None, require_present(value, what, _HINT)
    if "choices" in value:
        found = mapping(pick_choice(value["choices"], choice, what), "choices[]", what)
        for key in ("meta_info", "sgl_ext"):
            ext = found.get(key)
            if ext is not None and "indexer_topk" in mapping(ext, key, what):
                return ext, require_present(ext["indexer_topk"], what, _HINT)
        raise MissingRoutesError(
            f"{what}: choices[{choice}] carries no meta_info.indexer_topk or sgl_ext.indexer_topk: {_HINT}"
        )
    meta = mapping(value["meta_info"], "meta_info", what) if "meta_info" in value else value
    if "indexer_topk" not in meta:
        raise MissingRoutesError(f"{what}: meta_info has no indexer_topk field: {_HINT}")
    return meta, require_present(meta["indexer_topk"], what, _HINT)


def _meta_layers(meta: dict[str, Any], num_layers: int | None, what: str) -> int | None:
    declared = meta.get("indexer_topk_num_layers")
    if declared is None:
        return num_layers
    if not is_int(declared) or declared < 1:
        raise PayloadEncodingError(
            f"{what}: meta_info.indexer_topk_num_layers is {str(declared)[:20]!r}, not an int >= 1"
        )
    if num_layers is not None and declared != num_layers:
        raise LayerCountError(
            f"{what}: meta_info.indexer_topk_num_layers={declared} but num_layers={num_layers}; the server and the "
            "caller disagree on the model's indexer layers"
        )
    return int(declared)


def _to_array(
    payload: Any,
    num_layers: int | None,
    index_topk: int | None,
    rows: int | None,
    max_bytes: int,
    limits: IndexerLimits,
    what: str,
) -> np.ndarray:
    if isinstance(payload, (str, bytes, bytearray)):
        data = b64_to_bytes(payload, what, max_bytes)
        if len(data) % 4:
            raise PayloadSizeError(f"{what}: {len(data)} bytes is not a whole number of int32 positions")
        flat = np.frombuffer(data, "<i4")
    elif is_array_like(payload) or isinstance(payload, list):
        flat = to_numpy(payload) if is_array_like(payload) else lists_to_array(payload, what)
        if flat.dtype.kind not in "iu" and flat.size:
            raise DtypeError(f"{what}: {flat.dtype} values; indexer positions are integers")
        if flat.ndim == 3:
            limits.check_payload(flat.shape[0], flat.shape[1], flat.shape[2], what)
            return flat
        if flat.ndim > 3:
            raise IndexerRouteError(
                f"{what}: {flat.ndim}-D array {flat.shape[:6]}; expected (tokens, layers, index_topk)"
            )
        flat = flat.ravel()
    elif isinstance(payload, dict):
        raise PayloadEncodingError(
            f"{what}: got a dict; with skip_tokenizer_init SGLang puts a tensor in meta_info, which a JSON gateway "
            "serialises as {} and loses. Read it in-process, or let SGLang base64-encode it"
        )
    else:
        raise PayloadEncodingError(f"{what}: unsupported payload type {type(payload).__name__}")
    return _shape_flat(flat, num_layers, index_topk, rows, limits, what)


def _shape_flat(
    flat: np.ndarray, num_layers: int | None, index_topk: int | None, rows: int | None, limits: IndexerLimits, what: str
) -> np.ndarray:
    """A flat payload as (T, L, I): L must be known, and I or T (then I = size / (T * L))."""
    if num_layers is None:
        raise LayerCountError(
            f"{what}: a flat payload of {flat.size} positions has no shape; pass num_layers (the model's indexer "
            "layer count), or use a server that sends meta_info.indexer_topk_num_layers"
        )
    if index_topk is None:
        if rows is None:
            raise TopKMismatchError(
                f"{what}: pass index_topk or num_tokens: neither the row count nor the slots are known"
            )
        if rows == 0 or flat.size % (rows * num_layers):
            if flat.size == 0 and rows == 0:
                raise TopKMismatchError(f"{what}: an empty payload (one token) cannot tell index_topk; pass index_topk")
            raise PayloadSizeError(
                f"{what}: {flat.size} positions do not split into {rows} rows x {num_layers} layers; check num_tokens "
                "(prompt + output) and num_layers"
            )
        index_topk = flat.size // (rows * num_layers)
        if index_topk == 0:
            raise PayloadSizeError(f"{what}: {flat.size} positions for {rows} rows x {num_layers} layers: no slots")
    if flat.size % (num_layers * index_topk):
        raise PayloadSizeError(
            f"{what}: {flat.size} positions are not a whole number of rows of num_layers({num_layers}) x "
            f"index_topk({index_topk}); check both against the model config"
        )
    shape = (flat.size // (num_layers * index_topk), num_layers, index_topk)
    limits.check_payload(*shape, what)
    return flat.reshape(shape)


__all__ = ["decode_sglang_indexer"]
