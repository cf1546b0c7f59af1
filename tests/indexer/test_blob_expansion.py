"""Issue 22 item 2: an indexer blob's dense form is bounded per blob byte (`IndexerLimits.max_expansion`).

Rows whose query sees at most index_topk keys cost no bytes, so before the cap a 44-byte blob
could declare T = I = 65536, L = 1: 2^32 dense entries (16 GiB of int32), inside `max_entries`,
that `to_dense()` or replay would allocate. Honest blobs stay below I^2 / 4 entries a byte
(`routereplay.indexer.limits`), far under the default cap of 2^22 for real index_topk (2048).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from routereplay.bench.indexer import synthetic_choices
from routereplay.errors import CodecLimitError, ConfigError
from routereplay.indexer import IndexerLimits, IndexerTrace
from routereplay.indexer.limits import DEFAULT_MAX_EXPANSION
from tests.codec.blobs import traced_peak
from tests.indexer.choices import implicit_blob, random_choices

DENSE_SLACK = 1 << 20  # bytes beyond the output allowed to to_dense(): Python objects, the per-block index arrays


def test_implicit_blob_is_what_encode_writes() -> None:
    """The helper's bytes are a genuine blob: the same as encoding the dense rows."""
    dense_TLI = random_choices(40, 3, 64, start=5)
    assert implicit_blob(40, 3, 64, start=5) == IndexerTrace.from_dense(dense_TLI, range(3), 64, 5).encode()


def test_forged_44_byte_blob_of_16_gib_is_refused_before_allocating() -> None:
    """Memory (issue 22 item 2): 44 bytes declaring (65536, 1, 65536) = 2^32 entries passed every bound
    (max_entries is 2^32), and to_dense() would have allocated 16 GiB. Refused now, with < 1 MiB traced."""
    blob = implicit_blob(65536, 1, 65536)
    assert len(blob) == 44
    tracemalloc.start()
    try:
        with pytest.raises(CodecLimitError, match=r"from 44 bytes \(97612893 a byte\), above IndexerLimits\.max_exp"):
            IndexerTrace.decode(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes traced to refuse a 44-byte blob"


@pytest.mark.parametrize(
    ("shape", "what"),
    [
        ((2048, 61, 2048), "DeepSeek-V3.2: 61 DSA layers, index_topk 2048, 2048 tokens (900,889 a byte)"),
        ((2048, 1024, 2048), "index_topk 2048, the most layers IndexerLimits allows (1,038,435 a byte)"),
        ((4096, 256, 4096), "index_topk 4096 (4,036,623 a byte)"),
        ((4096, 64, 4096), "index_topk 4096, 64 layers (3,627,506 a byte)"),
    ],
)
def test_honest_all_implicit_blobs_pass_the_default_cap(shape: tuple[int, int, int], what: str) -> None:
    """The cap must admit honest blobs: the most a genuine blob expands is a trace of T = I rows, all of them
    implicit (40 + 4 L bytes). Every such trace of index_topk <= 4096 decodes under the defaults."""
    T, L, I = shape
    blob = implicit_blob(T, L, I)
    assert T * L * I / len(blob) < I * I / 4 <= DEFAULT_MAX_EXPANSION, what
    trace = IndexerTrace.decode(blob)
    assert (trace.num_tokens, trace.num_layers, trace.index_topk) == shape
    assert trace.encode() == blob


def test_measured_honest_blobs_sit_far_below_the_cap() -> None:
    """The `bench indexer` choices (recency-biased and uniform, with rows stored as gaps, Rice or bitmaps) and
    the tests' random choices expand a few entries a byte; short prefixes and unknown rows a few thousand."""
    cases = {
        "bench recent 1024 x 4 x 512": (synthetic_choices(1024, 4, 512, recent=True), 512),
        "bench uniform 1024 x 4 x 512": (synthetic_choices(1024, 4, 512, recent=False), 512),
        "random, 10% unknown, 300 x 3 x 16": (random_choices(300, 3, 16, unknown=0.1, seed=4), 16),
        "512 tokens, index_topk 512 (all implicit)": (synthetic_choices(512, 4, 512, recent=True), 512),
    }
    ratios = {}
    for name, (dense_TLI, topk) in cases.items():
        blob = IndexerTrace.from_dense(dense_TLI, range(dense_TLI.shape[1]), topk).encode()
        ratios[name] = dense_TLI.size / len(blob)
        assert np.array_equal(IndexerTrace.decode(blob).to_dense(), dense_TLI), name
    assert max(ratios.values()) < DEFAULT_MAX_EXPANSION / 64, ratios


def test_the_cap_is_adjustable_for_a_trusted_blob() -> None:
    """Above the cap is refused, at it decodes; a trusted blob passes with a raised `max_expansion`."""
    blob = implicit_blob(1024, 2, 1024)  # 2^21 entries from 48 bytes: 43690.7 a byte
    with pytest.raises(CodecLimitError, match="max_expansion=43690;"):
        IndexerTrace.decode(blob, IndexerLimits(max_expansion=43690))
    assert IndexerTrace.decode(blob, IndexerLimits(max_expansion=43691)).num_tokens == 1024
    forged = implicit_blob(65536, 1, 65536)
    assert IndexerTrace.decode(forged, IndexerLimits(max_expansion=1 << 27)).dense_nbytes == 16 << 30
    with pytest.raises(ConfigError, match=r"IndexerLimits\.max_expansion=0 must be an int >= 1"):
        IndexerLimits(max_expansion=0)
    with pytest.raises(ConfigError, match="must be a routereplay.indexer.IndexerLimits or None, got dict"):
        IndexerTrace.decode(blob, {"max_expansion": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(1024, 1, 1024), (256, 8, 300), (100, 3, 128)])
def test_dense_form_of_an_accepted_blob_stays_within_the_documented_bound(shape: tuple[int, int, int]) -> None:
    """What a blob of n bytes that passes costs dense: decode + to_dense() peaks within 3 x the output + 1 MiB
    (measured 2.25x at L = 1: the output and one (T, I) row pattern; 1.3x at L = 4), and the output is at most
    4 x max_expansion x n bytes (here max_expansion is set to the blob's own ratio)."""
    T, L, I = shape
    blob = implicit_blob(T, L, I)
    limits = IndexerLimits(max_expansion=-(-T * L * I // len(blob)))
    dense_TLI, peak = traced_peak(lambda: IndexerTrace.decode(blob, limits).to_dense())
    assert isinstance(dense_TLI, np.ndarray), dense_TLI
    assert dense_TLI.nbytes <= 4 * limits.max_expansion * len(blob)
    assert peak <= 3 * dense_TLI.nbytes + DENSE_SLACK, f"peak {peak} for {dense_TLI.nbytes} dense bytes"
