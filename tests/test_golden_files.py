"""Codec and store files are byte-for-byte what routereplay wrote before its modules moved into folders.

`tests/data/golden/` holds files written by the code as it stood before the layout change (commit
f41e3a9): a set-mode and an ordered codec file of one trace (a -1 row, -1 tail rows, token ids, a
start offset, non-contiguous layer numbers) and a store file of two samples. Today's code must write
exactly those bytes from the same inputs, and read them back to the same routes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import routereplay as rr

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
T, L, K, E = 37, 4, 4, 64
LAYERS = (1, 2, 3, 5)


def inputs() -> tuple[rr.RouteTrace, rr.RouteStore]:
    rng = np.random.default_rng(20261124)
    experts = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)
    experts[5, 2] = -1
    experts[30:] = -1
    token_ids = rng.integers(0, 50000, size=T)
    trace = rr.RouteTrace(experts, E, layers=LAYERS, start=3, token_ids=token_ids)
    store = rr.RouteStore()
    tokens = rng.integers(0, 50000, size=T + 4).tolist()
    store.add_turn("a", tokens[: T + 4], rr.RouteTrace(experts, E, layers=LAYERS, start=3), policy_version=2)
    store.add_turn(7, tokens[:10], rr.RouteTrace(experts[:9], E, layers=LAYERS), policy_version=0)
    return trace, store


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_codec_files_are_unchanged(mode: str) -> None:
    trace, _ = inputs()
    golden = (GOLDEN / f"{mode}.rrt").read_bytes()
    assert rr.encode(trace, mode=mode) == golden
    decoded = rr.decode(golden)
    assert decoded.equal_sets(trace) and decoded.layers == LAYERS and decoded.start == 3
    if mode == "ordered":
        assert np.array_equal(decoded.experts, trace.experts)


def test_store_file_is_unchanged(tmp_path: Path) -> None:
    _, store = inputs()
    store.save(tmp_path / "store.rrs")
    golden = (GOLDEN / "store.rrs").read_bytes()
    assert (tmp_path / "store.rrs").read_bytes() == golden
    loaded = rr.RouteStore.from_bytes(golden)
    assert loaded == store
    assert loaded.trace("a").equal_sets(store.trace("a")) and loaded.tokens(7) == store.tokens(7)
