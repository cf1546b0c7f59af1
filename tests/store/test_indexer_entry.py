"""Issue 22 item 2: a store file's indexer entry is held to its sample and to `IndexerLimits` when read.

Before the fix a 6.3 KB file whose sample (200 tokens, 199 rows) carried an indexer blob of
1 token x 1024 layers x index_topk 65536 loaded, and `trace()` then padded it to the sample's rows
densely: np.full((199, 1024, 65536)) int32, 49.8 GiB. Now the entry must cover rows [0, k) with
k <= the sample's rows, and its padded (rows, L, I) form must fit the limits; `trace()` pads with
unknown rows compactly (`IndexerTrace.padded`), never through the dense form.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

from routereplay import RouteTrace
from routereplay.errors import CodecLimitError, ConfigError, StoreHeaderError
from routereplay.indexer import IndexerLimits, IndexerTrace
from routereplay.indexer.trace import merged_indexer
from routereplay.store.route_store import RouteStore
from tests.codec.blobs import traced_peak
from tests.indexer.choices import implicit_blob, random_choices
from tests.wire.payloads import distinct_routes

E, L, K = 8, 2, 2
MiB = 1 << 20


def forged_file(rng: np.random.Generator, tokens: int, indexer: IndexerTrace) -> bytes:
    """The bytes of a store whose one sample ("s": `tokens` token ids, routes on every row) carries `indexer`,
    whatever it is: what a forger writes (sample_record encodes the indexer as it is)."""
    store = RouteStore(num_experts=E, layers=range(L), top_k=K)
    store.add_turn("s", np.arange(tokens), RouteTrace(distinct_routes(rng, tokens - 1, L, K, E), E))
    store._samples["s"].indexer = indexer
    return store.to_bytes()


def refused(data: bytes, error: type[Exception], match: str, **limits: Any) -> int:
    """Peak traced bytes of `RouteStore.from_bytes(data)` raising `error`."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            RouteStore.from_bytes(data, **limits)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_6_kb_file_whose_indexer_entry_pads_to_50_gib_is_refused(rng: np.random.Generator) -> None:
    """Memory (issue 22 item 2): the issue's file. The blob alone (1 x 1024 x 65536, 4136 bytes) is a genuine
    shape; padded to the sample's 199 rows it is 1.3e10 entries (49.8 GiB dense), above max_entries."""
    indexer = IndexerTrace.decode(implicit_blob(1, 1024, 65536))
    data = forged_file(rng, 200, indexer)
    assert len(data) < 6600, len(data)
    peak = refused(data, CodecLimitError, r"sample 's': indexer choices padded to its 199 rows .*max_entries")
    assert peak < 4 * MiB, f"{peak} bytes traced to refuse a {len(data)}-byte file"


@pytest.mark.parametrize(
    ("rows", "start", "match"),
    [
        (12, 0, r"cover tokens \[0, 12\) but the sample's 10 tokens have rows \[0, 9\)"),
        (10, 0, r"cover tokens \[0, 10\) but the sample's 10 tokens have rows \[0, 9\)"),
        (4, 3, r"cover tokens \[3, 7\) but the sample's 10 tokens have rows \[0, 9\)"),
    ],
)
def test_indexer_entry_must_cover_its_sample_rows(rng: np.random.Generator, rows: int, start: int, match: str) -> None:
    """A stored sample's indexer choices start at token 0 and stop by its last row (what add_turn stores);
    anything else is a corrupt or forged entry, named as such."""
    indexer = IndexerTrace.from_dense(random_choices(rows, 2, 4, start=start, seed=3), [0, 1], 4, start)
    with pytest.raises(StoreHeaderError, match=match):
        RouteStore.from_bytes(forged_file(rng, 10, indexer))


def test_padded_form_is_held_to_max_expansion_per_file_byte(rng: np.random.Generator) -> None:
    """The padded form is bounded per byte of the file that declares it (indexer blob + 8 bytes a token id):
    1 x 60 x 65536 from a 280-byte blob is 14043 entries a byte, padded to 199 rows 416,223 a byte of the
    blob and the 200 token ids. A bound between the two refuses the entry, naming it."""
    indexer = IndexerTrace.decode(implicit_blob(1, 60, 65536))
    data = forged_file(rng, 200, indexer)
    limits = IndexerLimits(max_expansion=1 << 16)
    assert IndexerTrace.decode(indexer.encode(), limits) == indexer  # the blob alone fits
    peak = refused(
        data, CodecLimitError, r"padded to its 199 rows \(indexer blob and token ids\): .* from 1880 bytes .*"
        r"max_expansion=65536", indexer_limits=limits,
    )  # fmt: skip
    assert peak < 4 * MiB
    with pytest.raises(ConfigError, match="IndexerLimits or None, got int"):
        RouteStore.from_bytes(data, indexer_limits=5)  # type: ignore[arg-type]


def test_trace_pads_the_indexer_without_its_dense_form(rng: np.random.Generator) -> None:
    """Memory: an honest sample whose tokens grew past its last routed call (tool output) has 510 indexer rows
    to pad; `trace()` used to build them densely (511 x 16 x 2048 int32 = 64 MiB) to re-encode them. Now it
    costs L bits a row: the whole trace() peaks under 2 MiB, and the rows read back unknown."""
    first = random_choices(1, 16, 2048, seed=5)
    store = RouteStore(num_experts=E, layers=range(L), top_k=K)
    indexer = IndexerTrace.from_dense(first, range(16), 2048)
    store.add_turn("s", [0, 1], RouteTrace(distinct_routes(rng, 1, L, K, E), E, indexer=indexer))
    store.add_turn("s", np.arange(512), None)
    trace, peak = traced_peak(lambda: store.trace("s"))
    assert not isinstance(trace, Exception), trace
    assert peak < 2 * MiB, f"trace() of a 511-row sample peaked at {peak} bytes"
    padded = trace.indexer
    assert padded is not None and padded.num_tokens == 511 and padded.nbytes < 16 * 511
    unknown_TL = padded.unknown_rows()
    assert not unknown_TL[0].any() and unknown_TL[1:].all()
    assert np.array_equal(padded.slice(0, 3).to_dense()[0], first[0])
    loaded = RouteStore.from_bytes(store.to_bytes())
    assert loaded == store and loaded.trace("s").indexer == padded


@pytest.mark.parametrize(
    ("tokens", "layers", "topk", "start", "unknown", "block_rows", "to"),
    [
        (40, 3, 8, 0, 0.0, 8, 41),  # the last block grows by one unknown row
        (40, 3, 8, 0, 0.2, 8, 100),  # new empty blocks after each layer's last
        (5, 2, 16, 0, 0.0, 4, 50),  # all implicit, padded past index_topk: blocks appear, all empty
        (5, 2, 16, 20, 0.3, 4, 9),  # a start offset past index_topk
        (30, 1, 64, 2, 0.5, 128, 31),
    ],
)
def test_padded_equals_merging_with_nothing(
    tokens: int, layers: int, topk: int, start: int, unknown: float, block_rows: int, to: int
) -> None:
    """`padded(n)` is `merged_indexer(trace, None, start, n)` (rows past the trace unknown), built compactly:
    same dense rows, a valid blob, the payload shared."""
    dense_TLI = random_choices(tokens, layers, topk, start=start, unknown=unknown, seed=tokens + to)
    trace = IndexerTrace.from_dense(dense_TLI, range(layers), topk, start, block_rows=block_rows)
    padded = trace.padded(to)
    merged = merged_indexer(trace, None, start, to)
    assert merged is not None and np.array_equal(padded.to_dense(), merged.to_dense())
    assert IndexerTrace.decode(padded.encode()) == padded
    assert padded._payload is trace._payload and trace.padded(tokens) is trace
    with pytest.raises(ConfigError, match=r"padded\(39\) must be an int in \[40, "):
        IndexerTrace.from_dense(random_choices(40, 1, 4), [0], 4).padded(39)
