"""Fuzz suite for files from outside (issue 11, "Must show"): `read_trace` and `RouteStore.from_bytes` /
`load` on hostile JSON (deep nesting, huge numbers, non-finite floats, wrong types) and hostile store
headers under a valid CRC.

Asserted for every input: only a `RouteReplayError` escapes, and the peak memory traced while the
call runs (tracemalloc, which numpy reports to) stays under `MEMORY_BOUND_BYTES` = 64 MiB. Inputs are
at most a few hundred KiB; the bound holds because sizes, depth and number length are checked
before parsing (`JsonLimits`: 256 MiB, 64 levels, 100 digits) and declared sizes before allocating.
Time is bounded by the same checks (work is linear in the input); it is measured in benchmarks, not
asserted here.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace
from routereplay.errors import RouteReplayError
from routereplay.store.file import MAGIC, VERSION
from routereplay.store.route_store import RouteStore
from routereplay.tracefile.format import FileFormat
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints, engine_payload

MEMORY_BOUND_BYTES = 64 << 20
FUZZ = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HOLE = "\x00hole\x00"  # placeholder replaced by raw hostile JSON text

HOSTILE_TEXT = st.sampled_from(
    [
        "[" * 5_000 + "]" * 5_000,
        '{"a":' * 3_000 + "1" + "}" * 3_000,
        "[" * 100_000,
        "9" * 5_000,
        "-" + "1" * 4_400,
        "1" + "0" * 400 + ".5",
        "1e999",
        "-1e999",
        "Infinity",
        "-Infinity",
        "NaN",
        "1e-999",
        "0.1e400",
        "true",
        "null",
        '""',
        '"\\ud800"',
        "{}",
        "[]",
        "[[[]]]",
        "-1",
        "4294967296",
        "18446744073709551616",
        "2.5",
    ]
)
SIMPLE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(-2, 70), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@pytest.fixture(scope="module")
def traced() -> Iterator[Callable[[Callable[[], Any]], int]]:
    """Run a call under tracemalloc; returns the peak bytes traced during it. Non-routereplay errors propagate."""
    tracemalloc.start()

    def run(call: Callable[[], Any]) -> int:
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
        try:
            call()
        except RouteReplayError:
            pass
        return tracemalloc.get_traced_memory()[1] - baseline

    yield run
    tracemalloc.stop()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def seed_trace() -> RouteTrace:
    rng = np.random.default_rng(7)
    experts = np.argsort(rng.random((6, 3, 8)), axis=2)[..., :2]
    return RouteTrace(experts, 8, layers=(1, 2, 3), start=2)


SEEDS = {fmt: engine_payload(seed_trace(), fmt) for fmt in (FileFormat.VLLM, FileFormat.SGLANG, FileFormat.MEGATRON)}


def paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path inside a JSON document (the root included)."""
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document[:4]):
            found += paths(value, (*prefix, index))
    return found


def replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[path[0]] = replaced(copy[path[0]], path[1:], value)
    return copy


@st.composite
def hostile_documents(draw: st.DrawFn) -> bytes:
    """An engine response with one value replaced by hostile text or a wrong type, maybe truncated or flipped."""
    fmt = draw(st.sampled_from(sorted(SEEDS)))
    document = SEEDS[fmt]
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(paths(document)))
        document = replaced(document, path, HOLE if draw(st.booleans()) else draw(SIMPLE))
    text = json.dumps(document).replace(json.dumps(HOLE), draw(HOSTILE_TEXT))
    data = text.encode("utf-8", "surrogatepass")
    cut = draw(st.sampled_from(["none", "truncate", "flip"]))
    if cut == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif cut == "flip" and data:
        where = draw(st.integers(0, len(data) - 1))
        data = data[:where] + bytes([data[where] ^ draw(st.integers(1, 255))]) + data[where + 1 :]
    return data


HINTS = st.builds(
    PayloadHints,
    num_experts=st.sampled_from([None, 8, 64]),
    num_layers=st.sampled_from([None, 3, 4]),
    top_k=st.sampled_from([None, 2]),
    moe_layers=st.sampled_from([None, [1, 2, 3]]),
    start=st.sampled_from([0, 2]),
    index=st.sampled_from([0, 1]),
)


@FUZZ
@given(data=hostile_documents(), hints=HINTS, engine=st.sampled_from([None, "vllm", "sglang", "megatron"]))
def test_read_trace_on_hostile_json(
    folder: Path, traced: Callable[[Callable[[], Any]], int], data: bytes, hints: PayloadHints, engine: str | None
) -> None:
    """Error that is not a RouteReplayError / resource exhaustion (issue 11 items 10, 31; fuzz suite):
    any hostile engine JSON read by `read_trace` raises only RouteReplayError, within the memory bound."""
    path = folder / "resp.json"
    path.write_bytes(data)
    peak = traced(lambda: read_trace(path, hints, engine=engine))
    assert peak < MEMORY_BOUND_BYTES, f"{peak} bytes traced for a {len(data)}-byte input"


def seed_store() -> RouteStore:
    store = RouteStore()
    store.add_turn("a", np.arange(8), seed_trace().slice(2, 7).with_provenance("sglang", 1), metadata={"r": 1.5})
    store.add_turn(7, np.arange(4), None, metadata={"tags": ["x"]})
    return store


SEED_STORE = seed_store().to_bytes()
_FIXED = struct.Struct("<4sB3xQQ")


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    _, _, header_size, data_size = _FIXED.unpack_from(data)
    header = json.loads(data[_FIXED.size : _FIXED.size + header_size])
    return header, data[_FIXED.size + header_size : _FIXED.size + header_size + data_size]


def container(header: bytes, body: bytes) -> bytes:
    data = _FIXED.pack(MAGIC, VERSION, len(header), len(body)) + header + body
    return data + struct.pack("<I", zlib.crc32(data))


@st.composite
def hostile_stores(draw: st.DrawFn) -> bytes:
    """A real store file whose header (and maybe body) was edited, re-wrapped with a valid CRC."""
    header, body = split(SEED_STORE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(header)))
        header = replaced(header, path, HOLE if draw(st.booleans()) else draw(SIMPLE))
    text = json.dumps(header).replace(json.dumps(HOLE), draw(HOSTILE_TEXT)).encode("utf-8", "surrogatepass")
    if draw(st.booleans()) and body:
        where = draw(st.integers(0, len(body) - 1))
        body = body[:where] + bytes([body[where] ^ draw(st.integers(1, 255))]) + body[where + 1 :]
    return container(text, body)


@FUZZ
@given(data=hostile_stores())
def test_store_load_on_hostile_headers(folder: Path, traced: Callable[[Callable[[], Any]], int], data: bytes) -> None:
    """Error that is not a RouteReplayError / resource exhaustion (issue 11 item 11; fuzz suite): a store
    file with a hostile header (or body) under a valid CRC raises only RouteReplayError, within the bound."""
    path = folder / "store.rrst"
    path.write_bytes(data)
    assert traced(lambda: RouteStore.from_bytes(data)) < MEMORY_BOUND_BYTES
    assert traced(lambda: RouteStore.load(path)) < MEMORY_BOUND_BYTES


def test_seeds_are_valid(folder: Path) -> None:
    """The fuzz seeds themselves load, so the suite mutates real files (not already-broken ones)."""
    assert RouteStore.from_bytes(SEED_STORE) == seed_store()
    for fmt, document in SEEDS.items():
        path = folder / f"seed.{fmt}.json"
        path.write_text(json.dumps(document))
        trace, found = read_trace(path)
        assert found is fmt and trace.layers == (1, 2, 3) and trace.start == 2
