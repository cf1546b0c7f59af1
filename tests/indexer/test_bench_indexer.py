"""`routereplay.bench.indexer`: the figure dict's structure and the exactness of its cases (no timed assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from routereplay.bench.indexer import IndexerBenchConfig, indexer_bench, synthetic_choices
from routereplay.indexer.canonical import check_dense


def test_bench_dict_has_both_cases_and_every_field() -> None:
    """A missing case or field would leave the lead's table without it; sizes must be the real T * L * I * 4."""
    config = IndexerBenchConfig(num_tokens=96, num_layers=2, index_topk=16, repeats=2)
    result = indexer_bench(config)
    json.dumps(result)
    assert result["suite"] == "indexer" and result["config"]["num_tokens"] == 96
    assert [case["case"] for case in result["cases"]] == ["recent", "uniform"]
    for case in result["cases"]:
        assert case["dense_bytes"] == 96 * 2 * 16 * 4
        assert 0 < case["blob_bytes"] < case["dense_bytes"] and case["dense_over_blob"] > 1
        assert case["resident_bytes"] > 0 and case["bytes_per_token"] == case["blob_bytes"] / 96
        for key in ("encode_seconds", "decode_seconds"):
            assert set(case[key]) == {"median", "low", "high", "repeats"} and case[key]["repeats"] == 2
        assert case["encode_dense_mb_per_s"] > 0 and case["decode_dense_mb_per_s"] > 0


def test_synthetic_choices_are_canonical_and_biased() -> None:
    """The generator must emit valid rows, and the recent case must favour recent keys over the uniform one."""
    recent = synthetic_choices(400, 2, 32, recent=True, seed=1)
    uniform = synthetic_choices(400, 2, 32, recent=False, seed=1)
    for dense in (recent, uniform):
        check_dense(dense, (0, 1), 32, 0)
    query = np.arange(400)[:, None, None]
    rows = slice(100, None)
    assert np.median((query - recent)[rows]) < np.median((query - uniform)[rows]) / 2


def test_bench_config_refuses_bad_sizes() -> None:
    """A zero or negative size must be refused with the field named."""
    with pytest.raises(ValueError, match="index_topk"):
        IndexerBenchConfig(index_topk=0)
