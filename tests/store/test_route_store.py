"""RouteStore and RouteTrace.merge: multi-turn, tool tokens, partial rollouts, versions, persistence."""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, Segment, Source
from routereplay.codec.blob import encode
from routereplay.errors import (
    ChecksumError,
    CodecFormatError,
    CodecVersionError,
    ConfigError,
    LayerCountError,
    RowCountError,
    TopKMismatchError,
)
from routereplay.store.route_store import RouteStore
from routereplay.store.sample import DuplicatedPrefixError, MisalignedRoutesError
from routereplay.trace.provenance import UNROUTED_SOURCE, MergePolicy
from tests.wire.payloads import distinct_routes

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
L, K, E = 2, 2, 8
SGL = Source.SGLANG


def make(rows: np.ndarray, start: int = 0, version: int | None = 0, source: Source | str = SGL) -> RouteTrace:
    segments = (Segment(start, start + len(rows), source, version),) if len(rows) else ()
    return RouteTrace(rows, E, start=start, segments=segments)


def provenance(trace: RouteTrace) -> list[tuple[str, int | None]]:
    """(source, version) of every token position, expanded from the segments."""
    return [(str(s.source), s.policy_version) for s in trace.segments for _ in range(s.end - s.begin)]


@pytest.fixture
def truth(rng: np.random.Generator) -> np.ndarray:
    """Ground-truth routes of a 16-token sample: rows 0..14, each row's ids ascending (what a "set" store,
    the default, reads back; `test_ordered_store_keeps_id_order` covers the order-keeping store)."""
    return np.sort(distinct_routes(rng, 15, L, K, E), axis=-1)


TOKENS = list(range(100, 116))  # 16 token ids: prompt 0..4, turn 1 5..8, tool 9..11, turn 2 12..15


# --- multi-turn -------------------------------------------------------------------------------


def test_multi_turn_whole_prefix_payloads(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]))
    store.add_turn("s", TOKENS, make(truth))  # the second call re-sends rows from token 0
    assert store.tokens("s") == TOKENS
    assert store.trace("s") == make(truth).with_token_ids(TOKENS), "a whole-prefix re-send must give the truth"
    stats = store.stats()
    assert (stats.rows, stats.routed_rows, stats.fallback_rows, stats.conflicting_rows) == (15, 15, 0, 0)
    assert stats.rows_by_source == {"sglang": 15}


def test_multi_turn_start_len_deltas_with_tool_tokens(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]))
    store.add_turn("s", TOKENS[:12], None)  # tool tokens 9..11 appended, no engine call
    mid = store.trace("s")
    assert mid.num_tokens == 11 and np.array_equal(mid.experts[:8], truth[:8]) and (mid.experts[8:] == -1).all()
    store.add_turn("s", TOKENS, make(truth[12:], start=12))  # routed_experts_start_len = 12
    expected = truth.copy()
    expected[8:12] = -1  # the last token of turn 1 and the tool tokens: never routed
    segments = (Segment(0, 8, SGL, 0), Segment(8, 12, UNROUTED_SOURCE), Segment(12, 15, SGL, 0))
    assert store.trace("s") == RouteTrace(expected, E, segments=segments).with_token_ids(TOKENS)
    stats = store.stats()
    assert (stats.samples, stats.tokens, stats.rows, stats.routed_rows, stats.fallback_rows) == (1, 16, 15, 11, 4)
    assert stats.rows_by_source == {"sglang": 11, "none": 4}


def test_sample_without_routes_needs_geometry() -> None:
    store = RouteStore()
    store.add_turn(7, [1, 2, 3], None)
    with pytest.raises(ConfigError, match="has no routes"):
        store.trace(7)
    store = RouteStore(num_experts=E, layers=(0, 1), top_k=K)
    store.add_turn(7, [1, 2, 3], None)
    unrouted = RouteTrace(np.full((2, L, K), -1), E, segments=(Segment(0, 2, "none"),))
    assert store.trace(7) == unrouted.with_token_ids([1, 2, 3])
    assert store.stats().fallback_rows == 2


# --- partial rollouts -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["keep", "replace"])
def test_resume_after_weight_update_full_resend(truth: np.ndarray, policy: str) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]), policy_version=0)  # aborted after 4 generated tokens
    resent = truth.copy()
    resent[:8] = np.sort((truth[:8] + 1) % E, axis=-1)  # the re-prefill under new weights routes them differently
    store.add_turn("s", TOKENS, make(resent, version=None), policy=policy, policy_version=1)
    got = store.trace("s")
    if policy == "keep":  # the rows used when tokens 0..7 were sampled stay
        assert np.array_equal(got.experts, truth)
        assert got.segments == (Segment(0, 8, SGL, 0), Segment(8, 15, SGL, 1))
        assert store.stale_fraction("s", 1) == pytest.approx(8 / 15)
    else:
        assert np.array_equal(got.experts, resent)
        assert got.segments == (Segment(0, 15, SGL, 1),)
        assert store.stale_fraction("s", 1) == 0.0
    assert store.stats().conflicting_rows == 8


@pytest.mark.parametrize("policy", list(MergePolicy))
def test_resume_with_delta(truth: np.ndarray, policy: MergePolicy) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8], version=0))
    store.add_turn("s", TOKENS, make(truth[8:], start=8, version=1), policy=policy)
    expected = RouteTrace(truth, E, segments=(Segment(0, 8, SGL, 0), Segment(8, 15, SGL, 1)))
    assert store.trace("s") == expected.with_token_ids(TOKENS)
    assert store.stats().conflicting_rows == 0


def test_stale_fraction_over_the_batch(rng: np.random.Generator) -> None:
    store = RouteStore()
    first = distinct_routes(rng, 9, L, K, E)
    first[:3] = -1  # unrouted rows count neither way
    store.add_turn("a", list(range(10)), make(first, version=0))
    store.add_turn("b", list(range(5)), make(distinct_routes(rng, 4, L, K, E), version=2))
    store.add_turn("c", list(range(4)), make(distinct_routes(rng, 3, L, K, E), version=None))
    assert store.stale_fraction("a", 1) == 1.0 and store.stale_fraction("b", 2) == 0.0
    assert store.stale_fraction("c", 0) == 1.0, "rows of unknown version cannot be shown current"
    assert store.stale_fraction(None, 2) == pytest.approx((6 + 3) / (6 + 4 + 3))
    assert store.stale_fraction(None, 0) == pytest.approx(3 / 13)
    assert RouteStore().stale_fraction(None, 5) == 0.0


# --- alignment errors -------------------------------------------------------------------------


def test_duplicated_prefix_concatenation_raises(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]))
    doubled = np.concatenate([truth[:8], truth])  # old prefix rows + the full re-send (verl #6029)
    with pytest.raises(DuplicatedPrefixError, match=r"first 8 rows repeat the next 8.*verl #6029.*keep one copy"):
        store.add_turn("s", TOKENS, make(doubled))
    assert issubclass(DuplicatedPrefixError, RowCountError)
    assert store.tokens("s") == TOKENS[:9], "a refused call must leave the sample untouched"
    store.add_turn("s", TOKENS, make(doubled[8:]))  # one copy kept: accepted
    assert store.trace("s") == make(truth).with_token_ids(TOKENS)


def test_token_prefix_mismatch_names_the_position(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]))
    rewritten = list(TOKENS)
    rewritten[3] = 7
    with pytest.raises(MisalignedRoutesError, match=r"position 3 \(stored 103, now 7\)"):
        store.add_turn("s", rewritten, None)
    with pytest.raises(MisalignedRoutesError, match="fewer than the 9 stored .first missing position 5"):
        store.add_turn("s", TOKENS[:5], None)


def test_routes_longer_than_tokens(truth: np.ndarray) -> None:
    store = RouteStore()
    with pytest.raises(RowCountError, match=r"\[0, 9\) but the sample has 9 token ids, so rows stop at 8"):
        store.add_turn("s", TOKENS[:9], make(truth[:9]))
    with pytest.raises(RowCountError, match=r"\[12, 15\) but the sample has 13"):
        store.add_turn("s", TOKENS[:13], make(truth[12:], start=12))
    assert "s" not in store
    with pytest.raises(ConfigError, match="non-empty 1-D sequence of ints"):
        store.add_turn("s", [], None)
    with pytest.raises(ConfigError, match="str or an int"):
        store.add_turn(("s", 1), TOKENS, None)  # type: ignore[arg-type]


def test_geometry_mismatch(rng: np.random.Generator, truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS[:9], make(truth[:8]))
    rows = distinct_routes(rng, 3, L, K, E)
    with pytest.raises(ConfigError, match="routes are for 16 experts, the store's model has 8"):
        store.add_turn("t", TOKENS[:4], RouteTrace(rows, 16))
    with pytest.raises(TopKMismatchError, match="top-k 3"):
        store.add_turn("t", TOKENS[:4], RouteTrace(distinct_routes(rng, 3, L, 3, E), E))
    with pytest.raises(LayerCountError, match=r"layers \[0, 1, 2\]"):
        store.add_turn("t", TOKENS[:4], RouteTrace(distinct_routes(rng, 3, 3, K, E), E))
    with pytest.raises(LayerCountError, match=r"layers \[4, 5\]"):
        store.add_turn("t", TOKENS[:4], RouteTrace(rows, E, layers=(4, 5)))
    base = RouteTrace(rows, E)
    with pytest.raises(ConfigError, match="8 and 16 experts"):
        base.merge(RouteTrace(rows, 16))
    with pytest.raises(TopKMismatchError, match="top-k 2 and 3"):
        base.merge(RouteTrace(distinct_routes(rng, 3, L, 3, E), E))
    with pytest.raises(LayerCountError, match="select the same"):
        base.merge(RouteTrace(rows, E, layers=(4, 5)))
    with pytest.raises(ConfigError, match="'newest' is not a merge policy"):
        base.merge(base, policy="newest")


# --- merge properties -------------------------------------------------------------------------


@st.composite
def traces(draw: st.DrawFn, *, min_rows: int = 1) -> RouteTrace:
    """A random trace with -1 rows and several provenance segments, adjacent ones distinct."""
    num_rows = draw(st.integers(min_rows, 30))
    start = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = distinct_routes(rng, num_rows, L, K, E)
    rows[rng.random((num_rows, L)) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -1
    cuts = sorted(draw(st.sets(st.integers(1, num_rows - 1), max_size=4))) if num_rows > 1 else []
    bounds = [start, *(start + c for c in cuts), start + num_rows]
    segments: list[Segment] = []
    for begin, end in itertools.pairwise(bounds):
        source, version = draw(st.sampled_from([Source.VLLM, SGL, "custom"])), draw(st.none() | st.integers(0, 3))
        if segments and (segments[-1].source, segments[-1].policy_version) == (source, version):
            version = (version or 0) + 1
        segments.append(Segment(begin, end, source, version))
    return RouteTrace(rows, E, start=start, segments=segments)


@FAST
@given(trace=traces(), data=st.data(), policy=st.sampled_from(list(MergePolicy)))
def test_merge_of_split_halves_gives_back_the_trace(trace: RouteTrace, data: st.DataObject, policy: str) -> None:
    cut = data.draw(st.integers(trace.start, trace.stop))
    head, tail = trace.slice(trace.start, cut), trace.slice(cut, trace.stop)
    assert head.merge(tail, policy=policy) == trace
    assert tail.merge(head, policy=policy) == trace
    assert trace.merge(trace.slice(cut, min(cut + 3, trace.stop)), policy=policy) == trace


@FAST
@given(a=traces(), b=traces(), policy=st.sampled_from(list(MergePolicy)))
def test_merge_matches_a_per_token_reference(a: RouteTrace, b: RouteTrace, policy: MergePolicy) -> None:
    merged = a.merge(b, policy=policy)
    preferred, fallback = (a, b) if policy is MergePolicy.KEEP else (b, a)
    start, stop = min(a.start, b.start), max(a.stop, b.stop)
    expected_rows = np.full((stop - start, L, K), -1)
    expected_source: list[tuple[str, int | None]] = []
    for t in range(start, stop):
        covered = {id(x): x.start <= t < x.stop for x in (a, b)}
        routed = {id(x): covered[id(x)] and bool((x.experts[t - x.start, :, 0] >= 0).any()) for x in (a, b)}
        if covered[id(fallback)] and (
            not covered[id(preferred)] or (routed[id(fallback)] and not routed[id(preferred)])
        ):
            chosen: RouteTrace | None = fallback
        else:
            chosen = preferred if covered[id(preferred)] else None
        if chosen is None:
            expected_source.append((UNROUTED_SOURCE, None))
        else:
            expected_rows[t - start] = chosen.experts[t - chosen.start]
            expected_source.append(provenance(chosen)[t - chosen.start])
    assert (merged.start, merged.stop) == (start, stop)
    assert np.array_equal(merged.experts, expected_rows)
    assert provenance(merged) == expected_source
    pairs = [(str(s.source), s.policy_version) for s in merged.segments]
    assert all(x != y for x, y in itertools.pairwise(pairs)), "adjacent segments must be coalesced"


# --- persistence ------------------------------------------------------------------------------


@st.composite
def stores(draw: st.DrawFn) -> RouteStore:
    store = RouteStore()
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for sample in range(draw(st.integers(0, 4))):
        sample_id: str | int = sample if draw(st.booleans()) else f"sample-{sample}"
        length = draw(st.integers(1, 12))
        tokens = rng.integers(0, 2**40, size=40).tolist()
        for _ in range(draw(st.integers(1, 3))):
            begin = draw(st.integers(0, length - 1))
            rows = distinct_routes(rng, length - 1 - begin, L, K, E)
            rows[rng.random(rows.shape[:2]) < 0.2] = -1
            trace = None if draw(st.booleans()) else make(rows, begin, draw(st.none() | st.integers(0, 9)))
            meta = draw(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=2))
            store.add_turn(
                sample_id, tokens[:length], trace, policy=draw(st.sampled_from(["keep", "replace"])), metadata=meta
            )
            length = min(length + draw(st.integers(0, 6)), 40)
    return store


@FAST
@given(store=stores())
def test_save_load_round_trip_is_exact(store: RouteStore) -> None:
    back = RouteStore.from_bytes(store.to_bytes())
    assert back == store
    assert back.stats() == store.stats()
    for sample_id in store:
        assert back.tokens(sample_id) == store.tokens(sample_id)
        assert back.metadata(sample_id) == store.metadata(sample_id)
        if store.geometry is not None:
            assert back.trace(sample_id) == store.trace(sample_id)
    assert back.to_bytes() == store.to_bytes()


def test_file_layout_is_byte_exact(tmp_path: Path, truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS, make(truth[2:], start=2, version=3), metadata={"reward": 1.5})
    store.add_turn(5, [9, 8], None)
    path = tmp_path / "batch.rrs"
    size = store.save(path)
    data = path.read_bytes()
    assert size == len(data)
    magic, version, header_size, data_size = struct.unpack_from("<4sB3xQQ", data)
    assert (magic, version) == (b"RRST", 1)
    header = json.loads(data[24 : 24 + header_size])
    blob = encode(make(truth[2:], start=2, version=3), mode="set")
    assert header == {
        "geometry": {"num_experts": E, "layers": [0, 1], "top_k": K},
        "codec_mode": "set",
        "samples": [
            {"id": "s", "tokens": 16, "routes": len(blob), "metadata": {"reward": 1.5}, "conflicting_rows": 0},
            {"id": 5, "tokens": 2, "routes": None, "metadata": {}, "conflicting_rows": 0},
        ],
    }
    body = np.array(TOKENS, "<i8").tobytes() + blob + np.array([9, 8], "<i8").tobytes()
    assert data[24 + header_size : -4] == body and data_size == len(body)
    assert struct.unpack("<I", data[-4:])[0] == zlib.crc32(data[:-4])
    assert RouteStore.load(path) == store


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_corrupt_files_raise_named_errors(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS, make(truth))
    data = store.to_bytes()
    for cut in (3, 20, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecFormatError, match="truncated|bad magic"):
            RouteStore.from_bytes(data[:cut])
    with pytest.raises(CodecFormatError, match="trailing bytes"):
        RouteStore.from_bytes(data + b"\0")
    flipped = bytearray(data)
    flipped[-10] ^= 0x40
    with pytest.raises(ChecksumError, match="CRC32 mismatch"):
        RouteStore.from_bytes(bytes(flipped))
    with pytest.raises(CodecFormatError, match="bad magic"):
        RouteStore.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(CodecVersionError, match="version 9"):
        RouteStore.from_bytes(data[:4] + b"\x09" + data[5:])
    # forged files with a valid outer CRC: the inner codec blob and the header are still checked
    inner = bytearray(data[:-4])
    inner[-10] ^= 0x40
    with pytest.raises(ChecksumError, match="CRC32 mismatch"):
        RouteStore.from_bytes(reseal(bytes(inner)))
    header_size = struct.unpack_from("<Q", data, 8)[0]
    forged = data[: 24 + header_size].replace(b'"tokens": 16', b'"tokens": 99')
    with pytest.raises(CodecFormatError, match="malformed"):
        RouteStore.from_bytes(reseal(forged + data[24 + header_size : -4]))
    forged = data[: 24 + header_size].replace(b'"top_k": 2', b'"top_k": 3')
    with pytest.raises(CodecFormatError, match="malformed.*the store's model routes to 3"):
        RouteStore.from_bytes(reseal(forged + data[24 + header_size : -4]))


def test_metadata_must_survive_json(truth: np.ndarray) -> None:
    store = RouteStore()
    store.add_turn("s", TOKENS, make(truth), metadata={"turns": (1, 2)})
    with pytest.raises(ConfigError, match="changes through JSON"):
        store.to_bytes()
    store.metadata("s")["turns"] = object()
    with pytest.raises(ConfigError, match="not JSON"):
        store.to_bytes()
