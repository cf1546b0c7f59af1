"""RouteStore under threads, hostile files and wrong arguments (issue 11 items 3, 11, 13, 22)."""

from __future__ import annotations

import copy
import json
import pickle
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace
from routereplay.errors import ConfigError, RowCountError, StoreHeaderError
from routereplay.jsondocument import JsonLimits
from routereplay.store.file import MAGIC, VERSION
from routereplay.store.route_store import RouteStore
from routereplay.store.sample import DuplicatedPrefixError, MisalignedRoutesError
from tests.wire.payloads import distinct_routes

E, L, K = 8, 2, 2


def container(header: bytes | str, body: bytes = b"") -> bytes:
    """A route store file around `header` with a correct envelope and CRC32: only the header is hostile."""
    header = header.encode() if isinstance(header, str) else header
    data = struct.pack("<4sB3xQQ", MAGIC, VERSION, len(header), len(body)) + header + body
    return data + struct.pack("<I", zlib.crc32(data))


def routes(rng: np.random.Generator, rows: int) -> RouteTrace:
    return RouteTrace(distinct_routes(rng, rows, L, K, E), E)


# --- item 3: threads ---------------------------------------------------------------------------


def test_add_turn_and_to_bytes_from_two_threads(tmp_path: Path) -> None:
    """Concurrency (issue 11 item 3): `to_bytes` while another thread ran `add_turn` raised
    `RuntimeError: dictionary changed size during iteration`. With the store's lock every snapshot
    taken from a second thread loads, and equals the writer's store at some moment of its progress."""
    rng = np.random.default_rng(0)
    samples = 400
    full = [distinct_routes(rng, 15, L, K, E) for _ in range(samples)]
    store = RouteStore(num_experts=E, layers=range(L), top_k=K)
    tokens = np.arange(100, 116)
    start = threading.Barrier(2)
    done = threading.Event()
    errors: list[BaseException] = []
    snapshots: list[bytes] = []

    def writer() -> None:
        try:
            start.wait()
            for i in range(samples):  # two turns per sample: a new key, then the same key grows
                store.add_turn(i, tokens[:9], RouteTrace(full[i][:8], E))
                store.add_turn(i, tokens, RouteTrace(full[i][8:], E, start=8))
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    def reader() -> None:
        try:
            start.wait()
            while not done.is_set():
                snapshots.append(store.to_bytes())
                store.stats()
                for sample_id in list(store)[-3:]:
                    store.trace(sample_id)
                store.save(tmp_path / "live.rrst")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store) == samples and snapshots
    for snapshot in [*snapshots[:: max(1, len(snapshots) // 20)], snapshots[-1]]:
        seen = RouteStore.from_bytes(snapshot)
        for i in seen:  # every sample is one of the writer's two states, never half of one
            trace = seen.trace(i)
            assert len(seen.tokens(i)) in (9, 16)
            expected = np.sort(full[int(i)][: len(seen.tokens(i)) - 1], axis=-1)  # a "set" store reads sets back
            assert np.array_equal(trace.experts, expected)
        assert list(seen) == list(range(len(seen)))
    assert RouteStore.load(tmp_path / "live.rrst") is not None


def test_pickle_and_deepcopy_leave_the_lock_out(rng: np.random.Generator) -> None:
    """Concurrency (issue 11 item 3): the lock is not state: pickling and deep copies work, equal the
    original, and get their own lock."""
    store = RouteStore()
    store.add_turn("s", range(10), routes(rng, 9), metadata={"reward": 1.0})
    for twin in (pickle.loads(pickle.dumps(store)), copy.deepcopy(store)):
        assert twin == store and twin._lock is not store._lock
        twin.add_turn("t", range(3), None)
        assert "t" not in store


# --- item 11: hostile headers under a valid CRC --------------------------------------------------

GEOMETRY = '{"num_experts": 8, "layers": [0, 1], "top_k": 2}'


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ('{"geometry": {"num_experts": Infinity, "layers": [0], "top_k": 1}, "samples": []}', "non-finite"),
        ('{"geometry": null, "samples": [], "x": NaN}', "non-finite number NaN"),
        ('{"geometry": null, "samples": [], "x": 1e999}', "non-finite number 1e999"),
        ('{"geometry": null, "samples": ' + "[" * 10_000 + "]" * 10_000 + "}", "nested more than 64"),
        ('{"geometry": null, "samples": [], "x": ' + "9" * 5000 + "}", "more than 100 digits"),
        ('{"geometry": null, "samples": [{"id": "s", "tokens": 1e300', "invalid JSON at line 1"),
        ('{"geometry": 5, "samples": []}', "geometry is a int"),
        ('{"geometry": {"num_experts": "8", "layers": [0], "top_k": 1}, "samples": []}', "num_experts='8'"),
        ('{"geometry": {"num_experts": 8, "layers": 3, "top_k": 1}, "samples": []}', "layers=3"),
        ('{"geometry": {"num_experts": 8}, "samples": []}', "give all of num_experts"),
        ('{"geometry": {"bogus": 1}, "samples": []}', "unexpected keyword"),
        (f'{{"geometry": {GEOMETRY}, "samples": {{}}}}', "samples is a dict"),
        (f'{{"geometry": {GEOMETRY}, "samples": [5]}}', "sample entry is a int"),
        (f'{{"geometry": {GEOMETRY}, "samples": [{{"id": "s"}}]}}', "missing field 'tokens'"),
        ('{"geometry": null}', "missing field 'samples'"),
        ("[]", "not a JSON object"),
        ('"text"', "not a JSON object"),
    ],
)
def test_hostile_headers_with_a_valid_crc_raise_store_header_error(header: str, match: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 11): a header that passes the CRC but holds
    Infinity (OverflowError), deep nesting (RecursionError), huge numbers (ValueError) or fields of the
    wrong type is a StoreHeaderError (a CodecFormatError) naming the problem."""
    with pytest.raises(StoreHeaderError, match=match):
        RouteStore.from_bytes(container(header))


@pytest.mark.parametrize(
    "entry",
    [
        {"id": [1], "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 0},
        {"id": "s", "tokens": 1.0, "routes": None, "metadata": {}, "conflicting_rows": 0},
        {"id": "s", "tokens": 10**30, "routes": None, "metadata": {}, "conflicting_rows": 0},
        {"id": "s", "tokens": 1, "routes": "12", "metadata": {}, "conflicting_rows": 0},
        {"id": "s", "tokens": 1, "routes": None, "metadata": [1, 2], "conflicting_rows": 0},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 1.5},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": -3},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": True},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 0, "indexer": "8"},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 0, "indexer": -1},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 0, "indexer": 10**30},
        {"id": "s", "tokens": 1, "routes": None, "metadata": {}, "conflicting_rows": 0, "indexer": True},
    ],
)
def test_wrong_entry_types_raise_store_header_error(entry: dict[str, object]) -> None:
    """Error that is not a RouteReplayError (issue 11 item 11): wrong-typed sample fields are named."""
    header = json.dumps({"geometry": None, "samples": [entry]})
    with pytest.raises(StoreHeaderError, match="route store file is malformed"):
        RouteStore.from_bytes(container(header, np.zeros(1, "<i8").tobytes()))


def test_header_limits_are_adjustable_and_save_refuses_what_load_would(rng: np.random.Generator) -> None:
    """Resource bound (issue 11 item 11): the header limits are JsonLimits; `save` refuses metadata
    that `load` would refuse, so a saved store always loads."""
    store = RouteStore()
    store.add_turn("s", range(10), routes(rng, 9), metadata={"deep": [[[1]]]})
    data = store.to_bytes()
    assert RouteStore.from_bytes(data) == store
    with pytest.raises(StoreHeaderError, match="nested more than 4 levels"):
        RouteStore.from_bytes(data, limits=JsonLimits(max_depth=4))
    nested: object = 1
    for _ in range(70):
        nested = [nested]
    with pytest.raises(ConfigError, match=r"sample 's' metadata: JSON nested more than 61 levels"):
        store.add_turn("s", range(10), None, metadata={"deep": nested})
        store.to_bytes()
    with pytest.raises(ConfigError, match="metadata is not JSON"):
        store.metadata("s")["bad"] = float("inf")
        store.to_bytes()


# --- item 13: argument types ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": "abc", "layers": [0], "top_k": 1}, "num_experts='abc' must be a positive int"),
        ({"num_experts": 8, "layers": [0], "top_k": None}, "give all of"),
        ({"num_experts": 8, "layers": None, "top_k": 2}, "give all of"),
        ({"num_experts": 8, "layers": [0, 0], "top_k": 2}, "distinct non-negative"),
        ({"num_experts": 8, "layers": "01", "top_k": 2}, "sequence of global layer numbers"),
        ({"num_experts": 8, "layers": [0], "top_k": 9}, r"top_k=9 must be an int in \[1, num_experts=8\]"),
        ({"num_experts": 8.0, "layers": [0], "top_k": 2}, "num_experts=8.0"),
    ],
)
def test_store_geometry_types_are_config_errors(kwargs: dict[str, object], match: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): `int("abc")` leaked a ValueError."""
    with pytest.raises(ConfigError, match=match):
        RouteStore(**kwargs)  # type: ignore[arg-type]


def test_store_method_argument_types_are_config_errors(rng: np.random.Generator) -> None:
    """Error that is not a RouteReplayError (issue 11 item 13): None or wrong types for policy_version,
    metadata, trace, current_version and from_bytes' data raised TypeError."""
    store = RouteStore()
    trace = routes(rng, 9)
    with pytest.raises(ConfigError, match="policy_version='1'"):
        store.add_turn("s", range(10), trace, policy_version="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="policy_version=-1"):
        store.add_turn("s", range(10), trace, policy_version=-1)
    with pytest.raises(ConfigError, match="metadata must be a mapping"):
        store.add_turn("s", range(10), trace, metadata=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="trace must be a RouteTrace or None, got ndarray"):
        store.add_turn("s", range(10), trace.experts)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="policy='newest' is not a merge policy"):
        store.add_turn("s", range(10), trace, policy="newest")
    assert "s" not in store
    store.add_turn("s", range(10), trace)
    with pytest.raises(ConfigError, match="current_version=None must be an int"):
        store.stale_fraction(None, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="from_bytes needs bytes, got NoneType"):
        RouteStore.from_bytes(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"no sample \[1\]"):
        store.trace([1])  # type: ignore[arg-type]
    assert [1] not in store


# --- item 22: the verl #6029 duplicated prefix after a weight update ---------------------------


def test_resumed_rollout_prefix_resent_under_new_weights_is_named(rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 22): a partial rollout resumed after a weight update re-sends
    its prefix, which the new weights route differently; verl #6029 concatenated the old rows and the
    new full-sequence rows. The exact-repeat check missed it and a generic RowCountError was raised.
    The excess equals the rows the store holds for the sample: the error names the cause and the fix."""
    store = RouteStore()
    tokens = list(range(200, 216))  # prompt + first chunk: 9 tokens; after resume: 16
    first = distinct_routes(rng, 8, L, K, E)
    store.add_turn("s", tokens[:9], RouteTrace(first, E), policy_version=0)
    resent = distinct_routes(rng, 15, L, K, E)  # new weights: the prefix rows differ from `first`
    assert not np.array_equal(resent[:8], first)
    doubled = np.concatenate([first, resent])
    with pytest.raises(
        DuplicatedPrefixError,
        match=r"the 8 extra rows are exactly the rows the store already holds.*verl #6029.*weight update.*"
        r"drop the first 8 rows",
    ):
        store.add_turn("s", tokens, RouteTrace(doubled, E), policy_version=1)
    assert store.tokens("s") == tokens[:9], "a refused call leaves the sample untouched"
    store.add_turn("s", tokens, RouteTrace(resent, E), policy_version=1, policy="replace")  # the fix
    assert np.array_equal(store.trace("s").experts, np.sort(resent, axis=-1))


def test_other_excess_rows_stay_a_plain_row_count_error(rng: np.random.Generator) -> None:
    """Misleading message guard (issue 11 item 22): an off-by-one row (a route for the last token) or an
    excess unrelated to the stored rows is not called a duplicated prefix."""
    store = RouteStore()
    tokens = list(range(16))
    store.add_turn("s", tokens[:9], routes(rng, 8))
    for rows in (16, 20):  # one extra row; 5 extra rows (the store holds 8)
        with pytest.raises(RowCountError, match="rows stop at 15") as caught:
            store.add_turn("s", tokens, routes(rng, rows))
        assert not isinstance(caught.value, DuplicatedPrefixError)


def test_token_ids_that_repeat_the_prefix_name_the_duplicated_prefix(rng: np.random.Generator) -> None:
    """Misleading message (issue 11 item 22): on a sample's first call the store holds nothing to
    compare with; a trace whose token ids repeat its first tokens shows the prefix was re-sent."""
    tokens = list(range(300, 316))
    old, new = distinct_routes(rng, 8, L, K, E), distinct_routes(rng, 15, L, K, E)
    ids = tokens[:8] + tokens[:15]  # the rows' tokens: the old prefix, then the whole re-send
    doubled = RouteTrace(np.concatenate([old, new]), E, token_ids=ids)
    with pytest.raises(DuplicatedPrefixError, match="token ids repeat its first 8 tokens.*verl #6029"):
        RouteStore().add_turn("s", tokens, doubled)


def test_traces_name_the_sample_tokens_and_foreign_ids_are_refused(rng: np.random.Generator) -> None:
    """Silent misroute (issue 11 items 21, 22): the store knows every sample's tokens, so `trace()` names
    them (replay can check the batch), and a trace routed for other tokens (a shifted BOS) is refused
    at `add_turn` with the first differing position."""
    tokens = list(range(400, 410))
    store = RouteStore()
    trace = routes(rng, 9)
    store.add_turn("s", tokens, trace.with_token_ids(tokens))
    named = store.trace("s").token_ids
    assert named is not None and named.tolist() == tokens[:9]
    shifted = [1, *tokens[:8]]  # an extra BOS: every row routed the previous token
    with pytest.raises(MisalignedRoutesError, match="token id 1 at position 0, but the sample's token there is 400"):
        store.add_turn("t", tokens, trace.with_token_ids(shifted))
    assert "t" not in store
    unknown = [-1] * 9  # -1 = id unknown: nothing to check
    store.add_turn("u", tokens, trace.with_token_ids(unknown))
    assert store.trace("u") == store.trace("s").with_provenance("unknown")
