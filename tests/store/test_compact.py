"""The compact resident RouteStore: encoded pieces, codec modes, random access, old files."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.errors import ConfigError, RowCountError
from routereplay.store.file import pack_envelope
from routereplay.store.pieces import MAX_PIECES
from routereplay.store.route_store import RouteStore
from routereplay.testing.synthetic import random_trace
from routereplay.trace.provenance import MergePolicy, Segment
from routereplay.trace.route_trace import RouteTrace

L, K, E = 4, 2, 16


def _routes(rng: np.random.Generator, rows: int, unrouted: float = 0.0) -> np.ndarray:
    return random_trace(rng, num_tokens=rows, num_layers=L, top_k=K, num_experts=E, unrouted_fraction=unrouted).experts


def _piece(experts: np.ndarray, begin: int, end: int, version: int) -> RouteTrace:
    return RouteTrace(experts[begin:end].copy(), E, None, begin, (Segment(begin, end, "vllm", version),))


def test_many_streamed_turns_equal_one_merge_of_decoded_rows() -> None:
    """A rollout streamed in more chunks than MAX_PIECES (with re-sent overlaps) must read back exactly what
    merging the decoded rows call by call gives: pieces, coalescing and overlap merges lose nothing."""
    rng = np.random.default_rng(0)
    n = 3 * MAX_PIECES + 10
    experts = np.sort(_routes(rng, n, unrouted=0.05), axis=-1)
    resent = np.sort(_routes(rng, n), axis=-1)
    tokens = rng.integers(0, 100, n + 1)
    store = RouteStore()
    reference: RouteTrace | None = None
    conflicts = 0
    for t in range(0, n, 3):
        calls = [_piece(experts, t, min(n, t + 3), t)]
        if t and t % 15 == 0:  # a resumed call re-sends the previous 5 rows routed by new weights
            calls.append(_piece(resent, t - 5, min(n, t + 3), t + 1))
        for call in calls:
            store.add_turn("s", tokens[: call.stop + 1], call, policy="replace")
            if reference is not None:
                begin, end = max(reference.start, call.start), min(reference.stop, call.stop)
                if begin < end:
                    a, b = (
                        reference.experts[begin - reference.start : end - reference.start],
                        call.experts[begin - call.start : end - call.start],
                    )
                    conflicts += int(
                        ((a != b).any(axis=(1, 2)) & (a[..., 0] >= 0).any(axis=1) & (b[..., 0] >= 0).any(axis=1)).sum()
                    )
            reference = call if reference is None else reference.merge(call, policy=MergePolicy.REPLACE)
    assert reference is not None
    got = store.trace("s")
    assert np.array_equal(got.experts, reference.experts) and got.segments == reference.segments
    assert store.stats().conflicting_rows == conflicts > 0
    assert len(store.encoded("s")) <= MAX_PIECES


def test_ordered_store_keeps_id_order_and_set_store_is_smaller() -> None:
    """Order-preserving replay needs the engine's id order; the default set store keeps only the set."""
    rng = np.random.default_rng(1)
    experts = _routes(rng, 40)
    ordered, sets = RouteStore(codec_mode="ordered"), RouteStore()
    for store in (ordered, sets):
        store.add_turn(0, np.arange(41), RouteTrace(experts, E))
    assert np.array_equal(ordered.trace(0).experts, experts)
    assert np.array_equal(sets.trace(0).experts, np.sort(experts, axis=-1))
    assert sets.nbytes < ordered.nbytes
    assert RouteStore.from_bytes(ordered.to_bytes()).codec_mode == "ordered"
    assert RouteStore.from_bytes(sets.to_bytes()) == sets
    with pytest.raises(ConfigError, match="codec_mode='sorted' is not a codec mode; use 'set'"):
        RouteStore(codec_mode="sorted")


def test_files_written_before_the_compact_store_load_as_ordered() -> None:
    """Files saved by earlier releases have no codec_mode and hold ordered blobs: the order must survive."""
    rng = np.random.default_rng(2)
    experts = _routes(rng, 9)
    new = RouteStore(codec_mode="ordered")
    new.add_turn("a", np.arange(10), RouteTrace(experts, E))
    data = new.to_bytes()
    old_header = {"geometry": {"num_experts": E, "layers": list(range(L)), "top_k": K},
                  "samples": [{"id": "a", "tokens": 10, "routes": len(new.encoded("a")[0].blob), "metadata": {},
                               "conflicting_rows": 0}]}  # fmt: skip
    body = np.arange(10, dtype="<i8").tobytes() + new.encoded("a")[0].blob
    loaded = RouteStore.from_bytes(pack_envelope(old_header, body))
    assert loaded.codec_mode == "ordered" and np.array_equal(loaded.trace("a").experts, experts)
    assert RouteStore.from_bytes(data) == loaded


def test_rows_reads_a_range_and_names_a_bad_one() -> None:
    """`rows` must equal the same slice of the whole trace, -1 across gaps no call routed."""
    rng = np.random.default_rng(3)
    experts = np.sort(_routes(rng, 30), axis=-1)
    store = RouteStore()
    tokens = np.arange(100, 131)
    store.add_turn("s", tokens[:11], _piece(experts, 0, 10, 0))
    store.add_turn("s", tokens, _piece(experts, 14, 30, 1))  # rows 10..13: tool tokens, no routes
    whole = store.trace("s").experts
    for begin, end in [(0, 30), (5, 20), (10, 14), (29, 30), (7, 7)]:
        assert np.array_equal(store.rows("s", begin, end), whole[begin:end])
    assert (store.rows("s", 10, 14) == -1).all()
    with pytest.raises(RowCountError, match=r"rows \[0, 31\) are not within \[0, 30\)"):
        store.rows("s", 0, 31)
    with pytest.raises(RowCountError, match="pass ints"):
        store.rows("s", "0", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no sample 'x'"):
        store.rows("x", 0, 1)


def test_qwen3_shaped_store_is_a_third_of_its_int16_rows() -> None:
    """The reason for the compact store (slime #2384: drivers out of host memory): <= 0.35x int16 ids."""
    rng = np.random.default_rng(4)
    store = RouteStore()
    payload = 0
    for i in range(4):
        n = 300 + 50 * i
        trace = random_trace(rng, num_tokens=n - 1, num_layers=48, top_k=8, num_experts=128, unrouted_fraction=0.01)
        store.add_turn(i, rng.integers(0, 150_000, n), trace)
        payload += trace.experts.size * 2
    assert store.nbytes <= 0.35 * payload
