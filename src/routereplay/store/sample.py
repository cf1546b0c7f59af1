"""One sample of a `RouteStore`, and what `add_turn` checks before it stores a call.

`Sample` is a sample's stored state: its full token ids, the routes merged so far (encoded:
`routereplay.store.pieces`), metadata and the count of re-sent rows that disagreed. Before a call
is stored its token ids must extend the stored ones (`check_prefix`, else `MisalignedRoutesError`),
its rows must stop at the last token (`check_rows`, which names the verl #6029 duplicated-prefix bug
as `DuplicatedPrefixError`) and a trace that names its tokens must name the sample's
(`check_token_ids`); `check_geometry` holds every trace to the store's model (num_experts, layers,
top_k), which `check_geometry_args` checks when it is given to `RouteStore(...)`.

Legend: T = rows (token positions fed as input), L = MoE layers, K = top-k, N = tokens of a sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routereplay.errors import ConfigError, DuplicatedPrefixError, LayerCountError, RowCountError, TopKMismatchError
from routereplay.indexer.trace import IndexerTrace, merged_indexer
from routereplay.store.pieces import SampleRoutes
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import check_slots
from routereplay.wire.limits import is_int

SampleId = str | int


class MisalignedRoutesError(RowCountError):
    """A sample's new token ids do not extend the stored ones: the trajectory was rewritten."""


@dataclass(slots=True)
class Sample:
    """One sample's stored state; the store's lock guards it."""

    tokens: np.ndarray  # (N,) int64, read-only
    routes: SampleRoutes  # encoded rows some engine calls returned (empty: no routes yet)
    metadata: dict[str, Any] = field(default_factory=dict)
    conflicting_rows: int = 0
    indexer: IndexerTrace | None = None  # DSA models: the indexer's choices of rows [0, indexer.num_tokens)


def add_indexer(sample: Sample, indexer: IndexerTrace | None, policy: MergePolicy) -> None:
    """Merge a turn's indexer choices into the sample's, row by row, under the routes' merge policy."""
    if indexer is None:
        return
    held = sample.indexer
    stop = max(indexer.start + indexer.num_tokens, 0 if held is None else held.num_tokens)
    first, second = (held, indexer) if policy is MergePolicy.KEEP else (indexer, held)
    sample.indexer = merged_indexer(first, second, 0, stop)


def indexer_rows(indexer: IndexerTrace | None, rows: int) -> IndexerTrace | None:
    """A sample's indexer choices over its trace's rows [0, rows): unknown rows past what was stored, added
    compactly (`IndexerTrace.padded`: L bits a row, never the dense rows x L x index_topk form)."""
    if indexer is None or indexer.num_tokens == rows:
        return indexer
    return indexer.slice(0, rows) if indexer.num_tokens > rows else indexer.padded(rows)


def check_id(sample_id: Any) -> SampleId:
    if isinstance(sample_id, np.integer):
        sample_id = int(sample_id)
    if isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)):
        raise ConfigError(f"sample id {sample_id!r} must be a str or an int (it is saved as JSON)")
    return sample_id


def as_tokens(token_ids: Sequence[int] | np.ndarray, sample_id: SampleId) -> np.ndarray:
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


def check_prefix(old: np.ndarray, new: np.ndarray, sample_id: SampleId) -> None:
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


def check_rows(
    trace: RouteTrace,
    num_tokens: int,
    sample_id: SampleId,
    stored_tokens: np.ndarray | None = None,
    stored_stop: int | None = None,
) -> None:
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
    held = set() if stored_tokens is None else {len(stored_tokens) - 1}  # rows the stored tokens span
    if stored_tokens is not None and stored_stop is not None:
        held.add(stored_stop)
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


def check_token_ids(trace: RouteTrace, tokens: np.ndarray, sample_id: SampleId) -> None:
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


def same_sample(a: Sample, b: Sample) -> bool:
    return (
        bool(np.array_equal(a.tokens, b.tokens))
        and a.routes.joined() == b.routes.joined()
        and a.metadata == b.metadata
        and a.conflicting_rows == b.conflicting_rows
        and a.indexer == b.indexer
    )


def check_geometry(
    geometry: tuple[int, tuple[int, ...], int] | None,
    trace: RouteTrace,
    sample_id: SampleId,
    slots: tuple[str, ...] | None = None,
) -> None:
    """A trace must match the store's model (num_experts, layers, top_k, slots); None: no geometry yet."""
    if geometry is None:
        return
    num_experts, layers, top_k = geometry
    where = f"sample {sample_id!r}"
    if trace.num_experts != num_experts:
        raise ConfigError(f"{where}: routes are for {trace.num_experts} experts, the store's model has {num_experts}")
    if trace.top_k != top_k:
        raise TopKMismatchError(f"{where}: routes have top-k {trace.top_k}, the store's model routes to {top_k}")
    if trace.layers != layers:
        raise LayerCountError(
            f"{where}: routes cover layers {list(trace.layers)}, the store holds layers {list(layers)}; decode "
            "with the same moe_layers= for every call"
        )
    if trace.slots != slots:
        raise LayerCountError(
            f"{where}: routes name router slots {trace.slots}, the store holds {slots}: routes of another model"
        )


def check_geometry_args(
    num_experts: Any, layers: Any, top_k: Any, slots: Any = None
) -> tuple[tuple[int, tuple[int, ...], int], tuple[str, ...] | None]:
    """The geometry given to `RouteStore(...)` and its router slots, checked and normalised."""
    if not (is_int(num_experts) and num_experts >= 1):
        raise ConfigError(f"num_experts={num_experts!r} must be a positive int")
    if not (is_int(top_k) and 1 <= top_k <= num_experts):
        raise ConfigError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, np.ndarray)):
        raise ConfigError(f"layers={layers!r} must be a sequence of global layer numbers")
    if not all(is_int(x) and x >= 0 for x in layers) or not len(layers):
        raise ConfigError(f"layers={list(layers)!r} must be distinct non-negative global layer numbers (at least one)")
    columns = tuple(int(x) for x in layers)
    return (int(num_experts), columns, int(top_k)), check_slots(slots, columns)
