"""The route store file's envelope: fixed header, JSON header, data section and CRC32.

`RouteStore.to_bytes` builds the JSON header and the data section and `pack_envelope` frames them;
`check_envelope` checks magic, version, lengths and the CRC before the header is parsed (within
`JsonLimits`) and `sample_entries` reads the samples it lists. `check_json` refuses sample metadata
that `load` would refuse or change.

File format (`save` / `load`), little-endian, one file per batch, written atomically:

    0   4    magic b"RRST"
    4   u8   version (1), then 3 reserved zero bytes
    8   u64  header length H      16  u64  data length D
    24  H    UTF-8 JSON header: {"geometry": null | {"num_experts", "layers", "top_k"},
             "codec_mode": "set" | "ordered" (absent in files before the compact store: "ordered"),
             "samples": [{"id", "tokens": count, "routes": blob bytes | null, "metadata",
             "conflicting_rows", "indexer": IndexerTrace blob bytes (DSA models; absent: none)}, ...]}
        D    per sample in header order: its token ids as int64, then its codec blob in the store's
             codec mode (the resident blob itself; provenance included), then its indexer blob
        u32  CRC32 (zlib) of every byte before it
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.codec import blob as codec
from routereplay.codec.limits import CodecLimits
from routereplay.errors import (
    ChecksumError,
    CodecFormatError,
    CodecLimitError,
    CodecVersionError,
    ConfigError,
    StoreHeaderError,
)
from routereplay.indexer.limits import IndexerLimits
from routereplay.indexer.trace import IndexerTrace
from routereplay.jsondocument import JsonLimits, load_json
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.limits import is_int

if TYPE_CHECKING:
    from routereplay.store.sample import Sample, SampleId

MAGIC = b"RRST"
VERSION = 1
_FIXED = struct.Struct("<4sB3xQQ")  # magic, version, reserved, header length, data length
_CRC = struct.Struct("<I")
HEADER_DEPTH = 3  # levels of the header around a sample's metadata: {"samples": [{"metadata": ...}]}


def pack_envelope(header: dict[str, Any], data: bytes) -> bytes:
    """The whole file: fixed header, the JSON `header`, the data section, and the CRC32 of all before it."""
    text = json.dumps(header, allow_nan=False).encode()
    body = _FIXED.pack(MAGIC, VERSION, len(text), len(data)) + text + data
    return body + _CRC.pack(zlib.crc32(body))


def check_envelope(data: bytes, limits: JsonLimits | None) -> tuple[dict[str, Any], bytes]:
    if data[:4] != MAGIC:
        raise CodecFormatError(f"bad magic {data[:4]!r} at byte offset 0 (expected {MAGIC!r}): not a route store file")
    if len(data) < _FIXED.size + _CRC.size:
        raise CodecFormatError(f"truncated route store file: {len(data)} bytes; re-save the store")
    _, version, header_size, data_size = _FIXED.unpack_from(data)
    if version != VERSION:
        raise CodecVersionError(
            f"route store file version {version} (byte offset 4); this release reads version {VERSION}: "
            "upgrade routereplay"
        )
    expected = _FIXED.size + header_size + data_size + _CRC.size
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "followed by trailing bytes"
        raise CodecFormatError(f"route store file is {len(data)} bytes, its header declares {expected}: it was {what}")
    (stored,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    actual = zlib.crc32(memoryview(data)[: -_CRC.size])
    if stored != actual:
        raise ChecksumError(
            f"route store CRC32 mismatch: stored {stored:#010x}, computed {actual:#010x}: the file was corrupted or "
            "tampered with; re-save the store"
        )
    header_end = _FIXED.size + header_size
    header = load_json(
        data[_FIXED.size : header_end], what="route store header (corrupt file)", error=StoreHeaderError, limits=limits
    )
    if not isinstance(header, dict):
        raise StoreHeaderError("route store header is not a JSON object: corrupt file")
    return header, data[header_end : header_end + data_size]


def check_json(metadata: dict[str, Any], sample_id: SampleId) -> None:
    """Refuse metadata that `load` would refuse or change (the header limits apply to it too)."""
    defaults = JsonLimits()
    limits = JsonLimits(
        max_bytes=defaults.max_bytes,
        max_depth=defaults.max_depth - HEADER_DEPTH,
        max_number_digits=defaults.max_number_digits,
    )
    try:
        text = json.dumps(metadata, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as error:
        raise ConfigError(
            f"sample {sample_id!r}: metadata is not JSON ({error}); store plain str/int/float/list/dict"
        ) from None
    exact = load_json(text, what=f"sample {sample_id!r} metadata", error=ConfigError, limits=limits) == metadata
    if not exact:
        raise ConfigError(
            f"sample {sample_id!r}: metadata {metadata!r} changes through JSON (tuples, non-str keys); store lists "
            "and str keys so that load(save(store)) == store"
        )


def sample_record(sample_id: SampleId, sample: Sample) -> tuple[dict[str, Any], list[bytes]]:
    """One sample's header entry and its data chunks (token ids, routes blob, indexer blob)."""
    blob = sample.routes.one_blob()
    check_json(sample.metadata, sample_id)
    entry = {
        "id": sample_id,
        "tokens": len(sample.tokens),
        "routes": None if blob is None else len(blob),
        "metadata": sample.metadata,
        "conflicting_rows": sample.conflicting_rows,
    }
    indexer = b"" if sample.indexer is None else sample.indexer.encode()
    if sample.indexer is not None:
        entry["indexer"] = len(indexer)
    return entry, [sample.tokens.astype("<i8").tobytes(), blob or b"", indexer]


def sample_entries(
    samples: list[Any], body: bytes, codec_limits: CodecLimits, indexer_limits: IndexerLimits
) -> Iterator[tuple[SampleId, np.ndarray, RouteTrace | None, Any, int, IndexerTrace | None]]:
    """(id, token ids, decoded routes or None, metadata, conflicting rows, indexer choices) of each entry, its bytes
    taken from `body` in order; a malformed entry raises ValueError / TypeError / KeyError (the caller
    names them `StoreHeaderError`), a bad blob its `CodecError`. An indexer blob is decoded within
    `indexer_limits`, then held to its sample (`check_sample_indexer`)."""
    position, seen = 0, set()
    for entry in samples:
        if not isinstance(entry, dict):
            raise TypeError(f"a sample entry is a {type(entry).__name__}, not an object")
        sample_id, count, size = entry["id"], entry["tokens"], entry["routes"]
        conflicting = entry["conflicting_rows"]
        if not is_int(conflicting) or conflicting < 0:
            raise ValueError(f"sample {sample_id!r} has conflicting_rows={conflicting!r}")
        if isinstance(sample_id, (str, int)) and not isinstance(sample_id, bool) and sample_id in seen:
            raise ValueError(f"sample id {sample_id!r} appears twice")
        seen.add(sample_id)
        if not isinstance(count, int) or count < 1 or position + 8 * count > len(body):
            raise ValueError(f"sample {sample_id!r} declares {count!r} tokens past the data section")
        tokens = np.frombuffer(body, "<i8", count, position)
        position += 8 * count
        trace = None
        if size is not None:
            if not isinstance(size, int) or not 0 <= size <= len(body) - position:
                raise ValueError(f"sample {sample_id!r} declares a {size!r}-byte routes blob past the data")
            trace = codec.decode(body[position : position + size], limits=codec_limits)
            position += size
            if trace.num_tokens == 0:
                raise ValueError(f"sample {sample_id!r} has an empty routes blob")
        indexer, size = None, entry.get("indexer")
        if size is not None:
            if not is_int(size) or not 0 <= size <= len(body) - position:
                raise ValueError(f"sample {sample_id!r} declares a {size!r}-byte indexer blob past the data")
            indexer = IndexerTrace.decode(body[position : position + size], indexer_limits)
            check_sample_indexer(indexer, count, size, indexer_limits, sample_id)
            position += size
        yield sample_id, tokens, trace, entry["metadata"], conflicting, indexer
    if position != len(body):
        raise ValueError(f"{len(body) - position} stray bytes at the end of the data section")


def check_sample_indexer(
    indexer: IndexerTrace, num_tokens: int, blob_bytes: int, limits: IndexerLimits, sample_id: SampleId
) -> None:
    """A sample's indexer choices cover rows [0, k) with k <= num_tokens - 1 (what `add_turn` stores), and the
    form `trace()` gives them - padded with unknown rows to the sample's num_tokens - 1 rows, as `to_dense()`
    or replay would allocate it - fits `limits`: its axes and T * L * I, and `max_expansion` dense entries per
    byte of the file that declares it (the indexer blob and the sample's token ids, 8 bytes a token)."""
    rows = num_tokens - 1
    if indexer.start != 0 or indexer.num_tokens > rows:
        raise ValueError(
            f"sample {sample_id!r}: its indexer choices cover tokens [{indexer.start}, "
            f"{indexer.start + indexer.num_tokens}) but the sample's {num_tokens} tokens have rows [0, {rows}) "
            "(a stored sample's choices start at token 0 and stop by its last row): corrupt or forged entry"
        )
    what = f"sample {sample_id!r}: indexer choices padded to its {rows} rows (indexer blob and token ids)"
    problem = limits.violation(rows, indexer.num_layers, indexer.index_topk)
    if problem:
        raise CodecLimitError(
            f"{what}: (T, L, I) = ({rows}, {indexer.num_layers}, {indexer.index_topk}): {problem}; refused before "
            "allocating. A forged or corrupt entry - or pass indexer_limits=IndexerLimits(...) if it is trusted"
        )
    limits.check_expansion(rows, indexer.num_layers, indexer.index_topk, blob_bytes + 8 * num_tokens, what)
