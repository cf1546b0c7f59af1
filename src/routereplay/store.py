"""`RouteStore`: routes of a batch of samples, assembled from several engine calls per sample.

Legend: T = rows (token positions fed as input), L = MoE layers, K = top-k, N = tokens of a sample.
A sample holds its full token ids (prompt, every turn, tool/observation tokens) and one `RouteTrace`
merged by absolute token position from every engine call that returned routes:

- multi-turn: each call returns rows from token 0 (whole prefix again) or from `start_len`
  (SGLang `routed_experts_start_len`, vLLM `routed_experts_prompt_start`); both merge by offset;
- tool tokens no engine routed stay -1 rows: the replayer falls back to the live router there, and
  `stats()` counts them;
- a partial rollout resumed after an abort or a weight update sends the full sequence again or
  only the delta; `policy="keep"` keeps the rows used when each token was sampled, `"replace"`
  takes the newer ones.

`trace(sample_id)` covers rows [0, N - 1): the last token is never fed back, so never routed. It
names the token of every row (`token_ids`, from the sample's tokens), so replay can check that the
batch it is applied to holds the same tokens. A trace given to `add_turn` that names its tokens must
name the sample's tokens at its positions.

Threads: every method holds the store's lock (a `threading.RLock`), so `add_turn` from rollout
threads and `to_bytes` / `save` / `trace` / `stats` from another thread are safe together; `save`
serialises under the lock and writes the file outside it. The dict `metadata(sample_id)` returns is
the stored one: edit it from one thread at a time. Pickling and `copy.deepcopy` leave the lock out
and give the copy a new one.

Limits: `from_bytes` / `load` parse the JSON header within `routereplay.jsondocument.JsonLimits`
(256 MiB, 64 levels deep, 100-digit numbers, finite numbers only), and each sample's routes blob
within `codec_limits` (`routereplay.codec_limits.CodecLimits`, default 2**28 ids per sample and 4096x
expansion); raise them to load a trusted store beyond those (e.g. one sample of more than 2**28 ids).
`save` refuses metadata that `load` would refuse.

File format (`save` / `load`), little-endian, one file per batch, written atomically:

    0   4    magic b"RRST"
    4   u8   version (1), then 3 reserved zero bytes
    8   u64  header length H      16  u64  data length D
    24  H    UTF-8 JSON header: {"geometry": null | {"num_experts", "layers", "top_k"},
             "samples": [{"id", "tokens": count, "routes": blob bytes | null, "metadata",
             "conflicting_rows"}, ...]}
        D    per sample in header order: its token ids as int64, then its codec blob
             (`routereplay.codec.encode(trace, mode="ordered")`: exact ids and provenance)
        u32  CRC32 (zlib) of every byte before it
"""

from __future__ import annotations

import json
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from routereplay import codec
from routereplay.atomicfile import atomic_write
from routereplay.codec_limits import CodecLimits, checked_limits
from routereplay.enums import CodecMode
from routereplay.errors import (
    ChecksumError,
    CodecError,
    CodecFormatError,
    CodecVersionError,
    ConfigError,
    LayerCountError,
    RowCountError,
    StoreHeaderError,
    TopKMismatchError,
)
from routereplay.jsondocument import JsonLimits, load_json
from routereplay.trace import UNROUTED_SOURCE, MergePolicy, RouteTrace, Segment, canonical_dtype

MAGIC = b"RRST"
VERSION = 1
_FIXED = struct.Struct("<4sB3xQQ")  # magic, version, reserved, header length, data length
_CRC = struct.Struct("<I")
TOKEN_ID_MAX = np.iinfo(np.int32).max  # largest id a trace's token_ids holds (vocabularies are far smaller)
HEADER_DEPTH = 3  # levels of the header around a sample's metadata: {"samples": [{"metadata": ...}]}

SampleId = str | int


class MisalignedRoutesError(RowCountError):
    """A sample's new token ids do not extend the stored ones: the trajectory was rewritten."""


class DuplicatedPrefixError(RowCountError):
    """The routes hold a prefix twice (the verl #6029 partial-rollout concatenation bug): an exact
    repeat, or an excess of rows equal to the rows the store already holds for the sample (the
    prefix re-sent after a weight update routes differently), or token ids that repeat the prefix."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts over the assembled traces. A row is one token position; `routed_rows` have ids in every
    layer, `fallback_rows` have -1 in some layer (the live router decides there)."""

    samples: int
    tokens: int
    rows: int
    routed_rows: int
    fallback_rows: int
    conflicting_rows: int  # re-sent rows whose routes disagreed with the stored ones (as sets)
    rows_by_source: dict[str, int]


@dataclass(slots=True)
class _Sample:
    tokens: np.ndarray  # (N,) int64, read-only
    trace: RouteTrace | None = None  # rows some engine call returned (None: no routes yet)
    metadata: dict[str, Any] = field(default_factory=dict)
    conflicting_rows: int = 0


class RouteStore:
    """Samples keyed by id (str or int): token ids, merged routes and a metadata dict each.

    The model geometry (num_experts, layers, top_k) is given here or taken from the first trace;
    every later trace must match it. Safe to use from several threads (see the module docstring).
    """

    def __init__(
        self, *, num_experts: int | None = None, layers: Sequence[int] | None = None, top_k: int | None = None
    ) -> None:
        given = [num_experts is not None, layers is not None, top_k is not None]
        if any(given) and not all(given):
            raise ConfigError("give all of num_experts, layers and top_k, or none (taken from the first trace)")
        self._geometry: tuple[int, tuple[int, ...], int] | None = None
        if num_experts is not None and layers is not None and top_k is not None:
            self._geometry = _check_geometry_args(num_experts, layers, top_k)
        self._samples: dict[SampleId, _Sample] = {}
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # --- adding -------------------------------------------------------------------------------
    def add_turn(
        self,
        sample_id: SampleId,
        token_ids: Sequence[int] | np.ndarray,
        trace: RouteTrace | None,
        *,
        policy: MergePolicy | str = MergePolicy.KEEP,
        policy_version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        validate: bool = True,
    ) -> None:
        """Record one engine call: `token_ids` is the sample's FULL sequence after it (prompt, every turn,
        tool tokens); `trace` the rows it returned ([trace.start, trace.stop), None when it returned none).

        The stored tokens must be a prefix of `token_ids`, and rows stop at len(token_ids) - 1. Rows
        merge by absolute position under `policy`; `policy_version` stamps every row of `trace`.
        Nothing is stored unless every check passes.
        """
        sample_id = _check_id(sample_id)
        tokens = _as_tokens(token_ids, sample_id)
        if policy_version is not None and not (_is_int(policy_version) and policy_version >= 0):
            raise ConfigError(f"sample {sample_id!r}: policy_version={policy_version!r} must be a non-negative int")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise ConfigError(f"sample {sample_id!r}: metadata must be a mapping (dict) or None, got {metadata!r}")
        if trace is not None and not isinstance(trace, RouteTrace):
            raise ConfigError(f"sample {sample_id!r}: trace must be a RouteTrace or None, got {type(trace).__name__}")
        with self._lock:
            self._add_turn(sample_id, tokens, trace, policy, policy_version, metadata, validate)

    def _add_turn(
        self,
        sample_id: SampleId,
        tokens: np.ndarray,
        trace: RouteTrace | None,
        policy: MergePolicy | str,
        policy_version: int | None,
        metadata: Mapping[str, Any] | None,
        validate: bool,
    ) -> None:
        sample = self._samples.get(sample_id)
        if sample is not None:
            _check_prefix(sample.tokens, tokens, sample_id)
        try:
            policy = MergePolicy(policy)
        except ValueError:
            raise ConfigError(f"policy={policy!r} is not a merge policy; use 'keep' or 'replace'") from None
        if trace is not None:
            self._check_geometry(trace, sample_id)
            _check_rows(trace, len(tokens), sample_id, sample)
            _check_token_ids(trace, tokens, sample_id)
            if validate:
                trace.validate(sample_id)
            segments = trace.segments
            if policy_version is not None:
                segments = tuple(replace(s, policy_version=int(policy_version)) for s in trace.segments)
            # the sample holds the tokens: stored rows carry none (`trace()` names them from the tokens)
            trace = RouteTrace(trace.experts, trace.num_experts, trace.layers, trace.start, segments)
            if self._geometry is None:
                self._geometry = (trace.num_experts, trace.layers, trace.top_k)
        if sample is None:
            sample = self._samples[sample_id] = _Sample(tokens)
        sample.tokens = tokens
        if trace is not None and trace.num_tokens:
            if sample.trace is None:
                sample.trace = RouteTrace(
                    trace.experts.copy(), trace.num_experts, trace.layers, trace.start, trace.segments
                )
            else:
                sample.conflicting_rows += _conflicts(sample.trace, trace)
                sample.trace = sample.trace.merge(trace, policy=policy)
        if metadata:
            sample.metadata.update(metadata)

    # --- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def __contains__(self, sample_id: object) -> bool:
        with self._lock:
            try:
                return sample_id in self._samples
            except TypeError:  # unhashable: never a sample id
                return False

    def __iter__(self) -> Iterator[SampleId]:
        """Sample ids in insertion order (a snapshot: adding while iterating is safe)."""
        with self._lock:
            return iter(list(self._samples))

    @property
    def geometry(self) -> tuple[int, tuple[int, ...], int] | None:
        """(num_experts, layers, top_k), or None before the first trace."""
        with self._lock:
            return self._geometry

    def tokens(self, sample_id: SampleId) -> list[int]:
        with self._lock:
            return self._get(sample_id).tokens.tolist()

    def metadata(self, sample_id: SampleId) -> dict[str, Any]:
        """The sample's metadata dict itself (edits are kept; it must stay JSON for `save`)."""
        with self._lock:
            return self._get(sample_id).metadata

    def trace(self, sample_id: SampleId) -> RouteTrace:
        """The routes of rows [0, N - 1), -1 where no engine call routed the token (under a "none" segment)."""
        with self._lock:
            return self._trace(sample_id)

    def _trace(self, sample_id: SampleId) -> RouteTrace:
        sample = self._get(sample_id)
        if self._geometry is None:
            raise ConfigError(
                f"sample {sample_id!r} has no routes and the store has seen no trace; pass num_experts, layers "
                "and top_k to RouteStore(...) to get all -1 traces"
            )
        num_experts, layers, top_k = self._geometry
        rows = len(sample.tokens) - 1
        empty = np.full((rows, len(layers), top_k), -1, canonical_dtype(num_experts))
        ids_T = np.array(sample.tokens[:rows])
        ids_T[(ids_T < 0) | (ids_T > TOKEN_ID_MAX)] = -1  # not a vocabulary id: unknown, never checked
        segments = (Segment(0, rows, UNROUTED_SOURCE),) if rows else ()
        frame = RouteTrace(empty, num_experts, layers, 0, segments, ids_T)
        return frame if sample.trace is None else frame.merge(sample.trace, policy=MergePolicy.REPLACE)

    def stale_fraction(self, sample_id: SampleId | None, current_version: int) -> float:
        """Fraction of routed rows produced under a policy version older than `current_version`, over one
        sample or (None) all. Rows of unknown version count as stale: they cannot be shown current."""
        if not _is_int(current_version):
            raise ConfigError(f"current_version={current_version!r} must be an int (the trainer's policy version)")
        with self._lock:
            return self._stale_fraction(sample_id, current_version)

    def _stale_fraction(self, sample_id: SampleId | None, current_version: int) -> float:
        samples = self._samples.values() if sample_id is None else [self._get(sample_id)]
        stale = routed = 0
        for trace in (sample.trace for sample in samples if sample.trace is not None):
            cumulative = np.concatenate([[0], np.cumsum(trace.routed_mask.all(axis=1))])
            for segment in trace.segments:
                count = int(cumulative[segment.end - trace.start] - cumulative[segment.begin - trace.start])
                routed += count
                if segment.policy_version is None or segment.policy_version < current_version:
                    stale += count
        return stale / routed if routed else 0.0

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats()

    def _stats(self) -> StoreStats:
        samples = self._samples.values()
        by_source: Counter[str] = Counter()
        for sample in samples:
            trace = sample.trace
            for segment in () if trace is None else trace.segments:
                by_source[str(segment.source)] += segment.end - segment.begin
            by_source[UNROUTED_SOURCE] += len(sample.tokens) - 1 - (0 if trace is None else trace.num_tokens)
        tokens = sum(len(sample.tokens) for sample in samples)
        rows = tokens - len(samples)
        routed = sum(sample.trace.num_routed for sample in samples if sample.trace is not None)
        conflicts = sum(sample.conflicting_rows for sample in samples)
        sources = {name: count for name, count in by_source.items() if count}
        return StoreStats(len(samples), tokens, rows, routed, rows - routed, conflicts, sources)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteStore):
            return NotImplemented
        first, second = sorted((self, other), key=id)  # one lock order, so a == b and b == a cannot deadlock
        with first._lock, second._lock:
            return (
                self._geometry == other._geometry
                and list(self._samples) == list(other._samples)
                and all(_same_sample(a, other._samples[key]) for key, a in self._samples.items())
            )

    __hash__ = None  # type: ignore[assignment]

    # --- persistence --------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The whole store in the versioned container format (see the module docstring)."""
        with self._lock:
            return self._to_bytes()

    def _to_bytes(self) -> bytes:
        entries, chunks = [], []
        for sample_id, sample in self._samples.items():
            blob = b"" if sample.trace is None else codec.encode(sample.trace, mode=CodecMode.ORDERED)
            _check_json(sample.metadata, sample_id)
            entries.append({
                "id": sample_id,
                "tokens": len(sample.tokens),
                "routes": None if sample.trace is None else len(blob),
                "metadata": sample.metadata,
                "conflicting_rows": sample.conflicting_rows,
            })  # fmt: skip
            chunks += [sample.tokens.astype("<i8").tobytes(), blob]
        geometry = None
        if self._geometry is not None:
            num_experts, layers, top_k = self._geometry
            geometry = {"num_experts": num_experts, "layers": list(layers), "top_k": top_k}
        header = json.dumps({"geometry": geometry, "samples": entries}, allow_nan=False).encode()
        data = b"".join(chunks)
        body = _FIXED.pack(MAGIC, VERSION, len(header), len(data)) + header + data
        return body + _CRC.pack(zlib.crc32(body))

    def save(self, path: str | Path) -> int:
        """Write the store to one file atomically; returns the bytes written."""
        data = self.to_bytes()
        atomic_write(Path(path), data)
        return len(data)

    @classmethod
    def from_bytes(
        cls,
        data: bytes | bytearray | memoryview,
        *,
        limits: JsonLimits | None = None,
        codec_limits: CodecLimits | None = None,
    ) -> RouteStore:
        """Parse `to_bytes` output; corruption raises `CodecFormatError` (`StoreHeaderError` for the JSON
        header), `CodecVersionError` or `ChecksumError`. The header is parsed within `limits`, each
        sample's routes blob decoded within `codec_limits` (default `CodecLimits()`; a blob beyond them
        raises `CodecLimitError` before allocating: pass e.g. `codec_limits=CodecLimits(max_entries=1 << 30)`
        for a trusted store)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"from_bytes needs bytes, got {type(data).__name__}")
        if limits is not None and not isinstance(limits, JsonLimits):
            raise ConfigError(f"limits must be a JsonLimits or None, got {type(limits).__name__}")
        codec_limits = checked_limits(codec_limits)
        header, body = _check_envelope(bytes(data), limits)
        try:
            geometry = header["geometry"]
            if geometry is not None and not isinstance(geometry, dict):
                raise TypeError(f"geometry is a {type(geometry).__name__}, not an object")
            store = cls() if geometry is None else cls(**geometry)
            samples = header["samples"]
            if not isinstance(samples, list):
                raise TypeError(f"samples is a {type(samples).__name__}, not a list")
            position = 0
            for entry in samples:
                if not isinstance(entry, dict):
                    raise TypeError(f"a sample entry is a {type(entry).__name__}, not an object")
                sample_id, count, size = entry["id"], entry["tokens"], entry["routes"]
                conflicting = entry["conflicting_rows"]
                if not _is_int(conflicting) or conflicting < 0:
                    raise ValueError(f"sample {sample_id!r} has conflicting_rows={conflicting!r}")
                if sample_id in store:
                    raise ValueError(f"sample id {sample_id!r} appears twice")
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
                store.add_turn(sample_id, tokens, trace, metadata=entry["metadata"])
                store._samples[sample_id].conflicting_rows = conflicting
            if position != len(body):
                raise ValueError(f"{len(body) - position} stray bytes at the end of the data section")
        except CodecError:
            raise
        except (KeyError, TypeError, ValueError) as error:  # ConfigError / RowCountError are ValueErrors
            what = f"missing field {error!s}" if isinstance(error, KeyError) else str(error)
            raise StoreHeaderError(f"route store file is malformed: {what}; re-save the store") from error
        return store

    @classmethod
    def load(
        cls, path: str | Path, *, limits: JsonLimits | None = None, codec_limits: CodecLimits | None = None
    ) -> RouteStore:
        """`from_bytes` of the file at `path` (the same `limits` and `codec_limits`)."""
        return cls.from_bytes(Path(path).read_bytes(), limits=limits, codec_limits=codec_limits)

    # --- internals ----------------------------------------------------------------------------
    def _get(self, sample_id: SampleId) -> _Sample:
        try:
            return self._samples[sample_id]
        except (KeyError, TypeError):
            raise ConfigError(f"no sample {sample_id!r} in this store ({len(self._samples)} samples)") from None

    def _check_geometry(self, trace: RouteTrace, sample_id: SampleId) -> None:
        if self._geometry is None:
            return
        num_experts, layers, top_k = self._geometry
        where = f"sample {sample_id!r}"
        if trace.num_experts != num_experts:
            raise ConfigError(
                f"{where}: routes are for {trace.num_experts} experts, the store's model has {num_experts}"
            )
        if trace.top_k != top_k:
            raise TopKMismatchError(f"{where}: routes have top-k {trace.top_k}, the store's model routes to {top_k}")
        if trace.layers != layers:
            raise LayerCountError(
                f"{where}: routes cover layers {list(trace.layers)}, the store holds layers {list(layers)}; decode "
                "with the same moe_layers= for every call"
            )


def _check_id(sample_id: Any) -> SampleId:
    if isinstance(sample_id, np.integer):
        sample_id = int(sample_id)
    if isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)):
        raise ConfigError(f"sample id {sample_id!r} must be a str or an int (it is saved as JSON)")
    return sample_id


def _as_tokens(token_ids: Sequence[int] | np.ndarray, sample_id: SampleId) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise ConfigError(
            f"sample {sample_id!r}: token_ids must be a non-empty 1-D sequence of ints, got dtype {array.dtype}, "
            f"shape {array.shape}"
        )
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"sample {sample_id!r}: token id {int(array.max())} does not fit int64")
    tokens = np.array(array, dtype=np.int64)
    tokens.setflags(write=False)
    return tokens


def _check_prefix(old: np.ndarray, new: np.ndarray, sample_id: SampleId) -> None:
    n = min(len(old), len(new))
    differ = np.flatnonzero(old[:n] != new[:n])
    if differ.size:
        at = int(differ[0])
        raise MisalignedRoutesError(
            f"sample {sample_id!r}: token ids differ from the stored ones at position {at} (stored {int(old[at])}, "
            f"now {int(new[at])}): the trajectory was rewritten (re-tokenised chat template, trimmed history?), so "
            "stored routes no longer line up. Pass the full sequence with the stored tokens as its prefix, or use a "
            "new sample id"
        )
    if len(new) < len(old):
        raise MisalignedRoutesError(
            f"sample {sample_id!r}: {len(new)} token ids, fewer than the {len(old)} stored (first missing position "
            f"{len(new)}); token_ids must be the FULL sequence after this call, not only the new tokens"
        )


def _check_rows(trace: RouteTrace, num_tokens: int, sample_id: SampleId, sample: _Sample | None = None) -> None:
    """Rows must stop at num_tokens - 1. An excess is the duplicated-prefix bug (verl #6029) when the
    first rows repeat the next ones exactly, when the excess equals the rows the store already holds
    for the sample (a resumed rollout's re-sent prefix, routed again under new weights, so not an
    exact repeat), or when the trace's token ids repeat the prefix."""
    limit = num_tokens - 1
    if trace.stop <= limit:
        return
    extra = trace.num_tokens - max(limit - trace.start, 0)
    head = trace.experts[:extra]
    fix = (
        f"keep one copy: drop the first {extra} rows (or send only the rows from the resume point with their "
        "start offset), or add the re-sent full sequence as its own add_turn call: it merges by offset, and "
        "policy='replace' takes the newer routes"
    )
    if (
        0 < extra <= trace.num_tokens - extra
        and (head >= 0).any()
        and np.array_equal(head, trace.experts[extra : 2 * extra])
    ):
        raise DuplicatedPrefixError(
            f"sample {sample_id!r}: routes have {trace.num_tokens} rows from token {trace.start} but {num_tokens} "
            f"token ids allow {limit - trace.start}, and the first {extra} rows repeat the next {extra}: a prefix's "
            f"routes were concatenated twice (the verl #6029 partial-rollout merge bug). {fix}"
        )
    held = set() if sample is None else {len(sample.tokens) - 1}  # rows the stored tokens span
    if sample is not None and sample.trace is not None:
        held.add(sample.trace.stop)
    held.discard(1)  # one extra row is the off-by-one "row for the last token", not a re-sent prefix
    ids = getattr(trace, "token_ids", None)
    repeated_ids = (
        ids is not None
        and 0 < extra <= trace.num_tokens - extra
        and bool((ids[:extra] >= 0).all())
        and bool(np.array_equal(ids[:extra], ids[extra : 2 * extra]))
    )
    if trace.start == 0 and (extra in held or repeated_ids):
        why = (
            f"the trace's token ids repeat its first {extra} tokens"
            if repeated_ids
            else f"the {extra} extra rows are exactly the rows the store already holds for this sample"
        )
        raise DuplicatedPrefixError(
            f"sample {sample_id!r}: routes have {trace.num_tokens} rows from token 0 but {num_tokens} token ids "
            f"allow {limit}, and {why}: the prefix was sent again and its routes concatenated before the new "
            "ones (the verl #6029 bug of a resumed / partial rollout after a weight update: the re-sent prefix "
            f"was routed by the new weights, so its rows differ from the first copy). {fix}"
        )
    raise RowCountError(
        f"sample {sample_id!r}: routes cover token positions [{trace.start}, {trace.stop}) but the sample has "
        f"{num_tokens} token ids, so rows stop at {limit} (the last token is never fed back). Check the call's "
        "start offset (start_len / prompt_start) and that token_ids is the full sequence after this call"
    )


def _check_token_ids(trace: RouteTrace, tokens: np.ndarray, sample_id: SampleId) -> None:
    """A trace that names its tokens must name the sample's tokens at its positions (-1 = unknown)."""
    ids_T = trace.token_ids
    if ids_T is None or not trace.num_tokens:
        return
    differ_T = (ids_T >= 0) & (ids_T != tokens[trace.start : trace.stop])
    if differ_T.any():
        row = int(np.flatnonzero(differ_T)[0])
        position = trace.start + row
        raise MisalignedRoutesError(
            f"sample {sample_id!r}: the routes were captured for token id {int(ids_T[row])} at position {position}, "
            f"but the sample's token there is {int(tokens[position])} ({int(differ_T.sum())} such positions): these "
            "routes belong to another tokenisation (an extra or stripped BOS, a re-rendered chat template) or "
            "another sample; pass the token ids the engine saw"
        )


def _conflicts(old: RouteTrace, new: RouteTrace) -> int:
    """Rows routed by both traces whose route sets differ in some layer."""
    begin, end = max(old.start, new.start), min(old.stop, new.stop)
    if begin >= end:
        return 0
    a = np.sort(old.experts[begin - old.start : end - old.start], axis=2)
    b = np.sort(new.experts[begin - new.start : end - new.start], axis=2)
    both_T = (a[..., 0] >= 0).any(axis=1) & (b[..., 0] >= 0).any(axis=1)
    return int(((a != b).any(axis=(1, 2)) & both_T).sum())


def _check_json(metadata: dict[str, Any], sample_id: SampleId) -> None:
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


def _check_envelope(data: bytes, limits: JsonLimits | None) -> tuple[dict[str, Any], bytes]:
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


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_geometry_args(num_experts: Any, layers: Any, top_k: Any) -> tuple[int, tuple[int, ...], int]:
    if not (_is_int(num_experts) and num_experts >= 1):
        raise ConfigError(f"num_experts={num_experts!r} must be a positive int")
    if not (_is_int(top_k) and 1 <= top_k <= num_experts):
        raise ConfigError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)):
        raise ConfigError(f"layers={layers!r} must be a sequence of global layer numbers")
    if not all(_is_int(x) and x >= 0 for x in layers) or len(set(layers)) != len(layers) or not len(layers):
        raise ConfigError(f"layers={list(layers)!r} must be distinct non-negative global layer numbers (at least one)")
    return int(num_experts), tuple(int(x) for x in layers), int(top_k)


def _same_sample(a: _Sample, b: _Sample) -> bool:
    return (
        bool(np.array_equal(a.tokens, b.tokens))
        and a.trace == b.trace
        and a.metadata == b.metadata
        and a.conflicting_rows == b.conflicting_rows
    )


__all__ = ["DuplicatedPrefixError", "MergePolicy", "MisalignedRoutesError", "RouteStore", "StoreStats"]
