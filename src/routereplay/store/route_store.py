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

Threads: every method holds the store's lock (a `threading.RLock`): `add_turn` from rollout threads
and `to_bytes` / `save` / `trace` / `stats` from another are safe together (`save` writes outside it).
Edit the dict `metadata(sample_id)` returns from one thread at a time. Copies get a new lock.

Limits: `from_bytes` / `load` parse the JSON header within `JsonLimits` (256 MiB, 64 levels deep,
100-digit numbers, finite only) and each routes blob within `codec_limits` (`CodecLimits`: 2**28 ids per
sample, 4096x expansion) and each indexer blob within `indexer_limits` (`IndexerLimits`: its shape, and
2**22 dense entries per byte; padded to its sample's rows it must fit again): raise them for a trusted
store. A pickled store is not checked: unpickling runs code, so only trusted pickles may be loaded at
all, and limits would guard nothing. `save` refuses metadata `load` would refuse.

File format (`save` / `load`): one file per batch, written atomically (`routereplay.store.file`): each
sample's token ids and codec blob (the store's codec mode; ids, provenance, router slots). Stored state
and `add_turn`'s checks: `routereplay.store.sample`; `stats()` / `stale_fraction()`: `routereplay.store.stats`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from routereplay.atomicfile import atomic_write
from routereplay.codec.encoded import EncodedRoutes, UnrankerCache
from routereplay.codec.limits import CodecLimits, checked_limits
from routereplay.enums import CodecMode
from routereplay.errors import CodecError, ConfigError, RouteValueError, RowCountError, StoreHeaderError
from routereplay.indexer.limits import IndexerLimits, checked_indexer_limits
from routereplay.jsondocument import JsonLimits
from routereplay.store.file import check_envelope, pack_envelope, sample_entries, sample_record
from routereplay.store.pieces import SampleRoutes
from routereplay.store.sample import (
    Sample,
    SampleId,
    add_indexer,
    as_tokens,
    check_geometry,
    check_geometry_args,
    check_id,
    check_prefix,
    check_rows,
    check_token_ids,
    indexer_rows,
    same_sample,
)
from routereplay.store.stats import StoreStats, stale_fraction_of, summarise
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.limits import is_int

TOKEN_ID_MAX = np.iinfo(np.int32).max  # largest id a trace's token_ids holds (vocabularies are far smaller)

_Sample = Sample  # the name pickles of earlier releases use


class RouteStore:
    """Samples keyed by id (str or int): token ids, merged routes and a metadata dict each.

    The model geometry (num_experts, layers, top_k) is given here or taken from the first trace;
    every later trace must match it. Safe to use from several threads (see the module docstring).
    """

    def __init__(
        self,
        *,
        num_experts: int | None = None,
        layers: Sequence[int] | None = None,
        top_k: int | None = None,
        codec_mode: CodecMode | str = CodecMode.SET,
        slots: Sequence[str] | None = None,
    ) -> None:
        """`codec_mode` is how samples are kept resident: "set" (default; rows read back sorted, all that
        replay forces) or "ordered" (keeps each row's id order, for order-preserving replay: 1.37x larger
        for top-8 of 128). `slots` names the router slot of each layer column (`RouteTrace.slots`)."""
        try:
            self._mode = CodecMode(codec_mode)
        except (ValueError, TypeError):
            raise ConfigError(
                f"codec_mode={codec_mode!r} is not a codec mode; use 'set' (route sets, smallest) or 'ordered' "
                "(keeps the id order of every row)"
            ) from None
        given = [num_experts is not None, layers is not None, top_k is not None]
        if any(given) and not all(given):
            raise ConfigError("give all of num_experts, layers and top_k, or none (taken from the first trace)")
        self._geometry: tuple[int, tuple[int, ...], int] | None = None
        self._slots: tuple[str, ...] | None = None  # router slot of each layer column (several routers in a layer)
        if num_experts is not None and layers is not None and top_k is not None:
            self._geometry, self._slots = check_geometry_args(num_experts, layers, top_k, slots)
        self._samples: dict[SampleId, Sample] = {}
        self._unrankers = UnrankerCache()  # one set-mode unranker shared by every sample's pieces
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
        Nothing is stored unless every check passes. Every row is validated while it is encoded (one
        pass; a fault is named with the sample), so a trace decoded with `validate=False` is checked
        here; `validate` is kept for compatibility and changes nothing (the codec never stores a row
        it has not checked).
        """
        sample_id = check_id(sample_id)
        tokens = as_tokens(token_ids, sample_id)
        if policy_version is not None and not (is_int(policy_version) and policy_version >= 0):
            raise ConfigError(f"sample {sample_id!r}: policy_version={policy_version!r} must be a non-negative int")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise ConfigError(f"sample {sample_id!r}: metadata must be a mapping (dict) or None, got {metadata!r}")
        if trace is not None and not isinstance(trace, RouteTrace):
            raise ConfigError(f"sample {sample_id!r}: trace must be a RouteTrace or None, got {type(trace).__name__}")
        with self._lock:
            self._add_turn(sample_id, tokens, trace, policy, policy_version, metadata)

    def _add_turn(
        self,
        sample_id: SampleId,
        tokens: np.ndarray,
        trace: RouteTrace | None,
        policy: MergePolicy | str,
        policy_version: int | None,
        metadata: Mapping[str, Any] | None,
    ) -> None:
        sample = self._samples.get(sample_id)
        if sample is not None:
            check_prefix(sample.tokens, tokens, sample_id)
        try:
            policy = MergePolicy(policy)
        except ValueError:
            raise ConfigError(f"policy={policy!r} is not a merge policy; use 'keep' or 'replace'") from None
        encoded: EncodedRoutes | None = None
        if trace is not None:
            check_geometry(self._geometry, trace, sample_id, self._slots)
            stored = (None, None) if sample is None else (sample.tokens, sample.routes.stop)
            check_rows(trace, len(tokens), sample_id, *stored)
            check_token_ids(trace, tokens, sample_id)
            segments = trace.segments
            if policy_version is not None:
                segments = tuple(replace(s, policy_version=int(policy_version)) for s in trace.segments)
            # the sample holds the tokens: stored rows carry none (`trace()` names them from the tokens)
            indexer = trace.indexer  # kept by the sample beside its routes (`sample.add_indexer`)
            given = trace
            trace = RouteTrace(trace.experts, trace.num_experts, trace.layers, trace.start, segments, slots=trace.slots)
            if trace.num_tokens:  # encoded before anything is stored: the codec checks every row as it ranks it
                try:
                    encoded = EncodedRoutes.encode(trace, mode=self._mode, unrankers=self._unrankers)
                except RouteValueError:
                    given.validate(sample_id)  # the same fault, named with the sample
                    raise
            if self._geometry is None:
                self._geometry, self._slots = (trace.num_experts, trace.layers, trace.top_k), trace.slots
        if sample is None:
            sample = self._samples[sample_id] = Sample(tokens, SampleRoutes(self._mode, self._unrankers))
        sample.tokens = tokens
        if trace is not None and trace.num_tokens:
            sample.conflicting_rows += sample.routes.add(trace, policy, encoded)
            add_indexer(sample, indexer, policy)
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
    def codec_mode(self) -> CodecMode:
        """How samples are kept resident (and saved): "set" or "ordered"."""
        return self._mode

    @property
    def nbytes(self) -> int:
        """Resident bytes of every sample's token ids and encoded routes (what the store holds)."""
        with self._lock:
            return sum(s.tokens.nbytes + s.routes.nbytes for s in self._samples.values())

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
        """The routes of rows [0, N - 1), -1 where no engine call routed the token (under a "none" segment).
        Decoded from the resident encoding: rows read back sorted in a "set" store."""
        with self._lock:
            return self._trace(sample_id)

    def _trace(self, sample_id: SampleId) -> RouteTrace:
        sample = self._get(sample_id)
        num_experts, layers, top_k = self._require_geometry(sample_id)
        rows = len(sample.tokens) - 1
        ids_T = np.array(sample.tokens[:rows])
        ids_T[(ids_T < 0) | (ids_T > TOKEN_ID_MAX)] = -1  # not a vocabulary id: unknown, never checked
        experts_TLK = sample.routes.assemble(rows, num_experts, layers, top_k)
        segments, ordered, indexer = sample.routes.segments(rows), self._mode is CodecMode.ORDERED, sample.indexer
        return RouteTrace(
            experts_TLK, num_experts, layers, 0, segments, ids_T, slots=self._slots, ordered=ordered,
            indexer=indexer_rows(indexer, rows),
        )  # fmt: skip

    def rows(self, sample_id: SampleId, begin: int, end: int) -> np.ndarray:
        """(end - begin, L, K) ids of positions [begin, end) of one sample, -1 where unrouted; decodes only
        those rows (time proportional to end - begin, not to the sample)."""
        with self._lock:
            sample = self._get(sample_id)
            num_experts, layers, top_k = self._require_geometry(sample_id)
            limit = len(sample.tokens) - 1
            if not (is_int(begin) and is_int(end) and 0 <= begin <= end <= limit):
                raise RowCountError(
                    f"sample {sample_id!r}: rows [{begin!r}, {end!r}) are not within [0, {limit}) (rows stop one "
                    "before the last token); pass ints with 0 <= begin <= end <= len(tokens) - 1"
                )
            return sample.routes.rows(int(begin), int(end), num_experts, layers, top_k)

    def encoded(self, sample_id: SampleId) -> list[EncodedRoutes]:
        """The sample's resident pieces (disjoint, by position): cut them with `span` to ship rows encoded."""
        with self._lock:
            return list(self._get(sample_id).routes.pieces)

    def _require_geometry(self, sample_id: SampleId) -> tuple[int, tuple[int, ...], int]:
        if self._geometry is None:
            raise ConfigError(
                f"sample {sample_id!r} has no routes and the store has seen no trace; pass num_experts, layers "
                "and top_k to RouteStore(...) to get all -1 traces"
            )
        return self._geometry

    def stale_fraction(self, sample_id: SampleId | None, current_version: int) -> float:
        """Fraction of routed rows produced under a policy version older than `current_version`, over one
        sample or (None) all. Rows of unknown version count as stale: they cannot be shown current."""
        if not is_int(current_version):
            raise ConfigError(f"current_version={current_version!r} must be an int (the trainer's policy version)")
        with self._lock:
            samples = self._samples.values() if sample_id is None else [self._get(sample_id)]
            return stale_fraction_of(samples, current_version)

    def stats(self) -> StoreStats:
        with self._lock:
            return summarise(self._samples.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteStore):
            return NotImplemented
        first, second = sorted((self, other), key=id)  # one lock order, so a == b and b == a cannot deadlock
        with first._lock, second._lock:
            return (
                self._geometry == other._geometry
                and list(self._samples) == list(other._samples)
                and all(same_sample(a, other._samples[key]) for key, a in self._samples.items())
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
            entry, data = sample_record(sample_id, sample)
            entries.append(entry)
            chunks += data
        geometry = None
        if self._geometry is not None:
            num_experts, layers, top_k = self._geometry
            geometry = {"num_experts": num_experts, "layers": list(layers), "top_k": top_k}
            geometry.update({"slots": list(self._slots)} if self._slots else {})
        header = {"geometry": geometry, "codec_mode": str(self._mode), "samples": entries}
        return pack_envelope(header, b"".join(chunks))

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
        indexer_limits: IndexerLimits | None = None,
    ) -> RouteStore:
        """Parse `to_bytes` output; corruption raises `CodecFormatError` (`StoreHeaderError` for the JSON
        header), `CodecVersionError` or `ChecksumError`. The header is parsed within `limits`, each
        sample's routes blob decoded within `codec_limits` (default `CodecLimits()`; a blob beyond them
        raises `CodecLimitError` before allocating: pass e.g. `codec_limits=CodecLimits(max_entries=1 << 30)`
        for a trusted store), and each indexer blob within `indexer_limits` (default `IndexerLimits()`),
        held to its sample: rows [0, k) with k < its token count, and padded to the sample's rows as
        `trace()` gives it, within the limits again (`store.file.check_sample_indexer`)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"from_bytes needs bytes, got {type(data).__name__}")
        if limits is not None and not isinstance(limits, JsonLimits):
            raise ConfigError(f"limits must be a JsonLimits or None, got {type(limits).__name__}")
        codec_limits = checked_limits(codec_limits)
        indexers = checked_indexer_limits(indexer_limits)
        header, body = check_envelope(bytes(data), limits)
        try:
            geometry = header["geometry"]
            if geometry is not None and not isinstance(geometry, dict):
                raise TypeError(f"geometry is a {type(geometry).__name__}, not an object")
            mode = header.get("codec_mode", "ordered")  # files before the compact store were written ordered
            if mode not in ("set", "ordered"):
                raise ValueError(f"codec_mode is {mode!r}, not 'set' or 'ordered'")
            store = cls(codec_mode=mode) if geometry is None else cls(**geometry, codec_mode=mode)
            samples = header["samples"]
            if not isinstance(samples, list):
                raise TypeError(f"samples is a {type(samples).__name__}, not a list")
            entries = sample_entries(samples, body, codec_limits, indexers)
            for sample_id, tokens, trace, metadata, conflicting, indexer in entries:
                store.add_turn(sample_id, tokens, trace, metadata=metadata)
                store._samples[sample_id].conflicting_rows, store._samples[sample_id].indexer = conflicting, indexer
        except CodecError:
            raise
        except (KeyError, TypeError, ValueError) as error:  # ConfigError / RowCountError are ValueErrors
            what = f"missing field {error!s}" if isinstance(error, KeyError) else str(error)
            raise StoreHeaderError(f"route store file is malformed: {what}; re-save the store") from error
        return store

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        limits: JsonLimits | None = None,
        codec_limits: CodecLimits | None = None,
        indexer_limits: IndexerLimits | None = None,
    ) -> RouteStore:
        """`from_bytes` of the file at `path` (the same `limits`, `codec_limits` and `indexer_limits`)."""
        return cls.from_bytes(
            Path(path).read_bytes(), limits=limits, codec_limits=codec_limits, indexer_limits=indexer_limits
        )

    # --- internals ----------------------------------------------------------------------------
    def _get(self, sample_id: SampleId) -> Sample:
        try:
            return self._samples[sample_id]
        except (KeyError, TypeError):
            raise ConfigError(f"no sample {sample_id!r} in this store ({len(self._samples)} samples)") from None


__all__ = ["RouteStore"]
