"""SGLang `return_indexer_topk` payloads (meta_info.indexer_topk: base64 raw int32, (seqlen - 1, L, I), -1 padding,
unsorted) decoded into canonical `IndexerTrace`s, and hostile payloads refused with named errors."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from routereplay.errors import (
    ConfigError,
    DtypeError,
    IndexerRouteError,
    LayerCountError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadLimitError,
    PayloadSizeError,
    RowCountError,
    TopKMismatchError,
)
from routereplay.indexer import IndexerLimits
from routereplay.wire.indexer_topk import decode_sglang_indexer
from tests.indexer.choices import random_choices

PROMPT, COMPLETION, LAYERS, TOPK = 30, 11, 3, 8


def _engine_rows(canonical: np.ndarray, seed: int = 0) -> np.ndarray:
    """What the engine sends for canonical rows: each row's valid slots in score (random) order, -1 padding
    scattered, and some padding slots of short rows holding positions after the query (kernel leftovers)."""
    rng = np.random.default_rng(seed)
    raw = canonical.copy()
    for t in range(raw.shape[0]):
        for layer in range(raw.shape[1]):
            raw[t, layer] = rng.permutation(raw[t, layer])
            pad = np.flatnonzero(raw[t, layer] < 0)
            if pad.size and t % 2:
                raw[t, layer, pad[0]] = t + 1 + rng.integers(0, 100)
    return raw


def _response(raw: np.ndarray, *, num_layers: bool = True) -> dict:
    meta = {
        "indexer_topk": base64.b64encode(raw.astype("<i4").tobytes()).decode("ascii"),
        "prompt_tokens": PROMPT,
        "completion_tokens": COMPLETION,
        "finish_reason": {"type": "length", "length": COMPLETION},
    }
    if num_layers:
        meta["indexer_topk_num_layers"] = raw.shape[1]
    return {"text": "...", "meta_info": meta}


@pytest.fixture
def canonical() -> np.ndarray:
    return random_choices(PROMPT + COMPLETION - 1, LAYERS, TOPK, unknown=0.1, seed=21)


def test_generate_response_decodes_to_the_canonical_rows(canonical: np.ndarray) -> None:
    """Unsorted rows, scattered -1 and positions after the query must canonicalise to the sorted, padded rows;
    index_topk comes from the byte length and the row count from prompt + completion tokens."""
    trace = decode_sglang_indexer(_response(_engine_rows(canonical)), layers=[1, 4, 7])
    assert trace.index_topk == TOPK and trace.layers == (1, 4, 7) and trace.start == 0
    assert np.array_equal(trace.to_dense(), canonical)


def test_every_container_gives_the_same_trace(canonical: np.ndarray) -> None:
    """A batch, the meta_info alone, the base64 text, an ndarray, nested lists and an OpenAI-style choice agree."""
    raw = _engine_rows(canonical, seed=1)
    response = _response(raw)
    expected = decode_sglang_indexer(response)
    text = response["meta_info"]["indexer_topk"]
    assert decode_sglang_indexer([_response(raw[:, :, ::-1]), response], index=1) == expected
    assert decode_sglang_indexer(response["meta_info"]) == expected
    assert decode_sglang_indexer(text, num_layers=LAYERS, num_tokens=PROMPT + COMPLETION) == expected
    assert decode_sglang_indexer(text, num_layers=LAYERS, index_topk=TOPK) == expected
    assert decode_sglang_indexer(raw) == expected
    assert decode_sglang_indexer(raw.tolist()) == expected
    assert decode_sglang_indexer({"choices": [{"index": 0, "meta_info": response["meta_info"]}]}) == expected


def test_rows_left_empty_become_unknown() -> None:
    """A row holding only -1 (or only positions after its query) must become an unknown row, not an error."""
    canonical = random_choices(12, 1, 4, seed=2)
    raw = canonical.copy()
    raw[5, 0] = -1
    raw[7, 0] = [50, 60, -1, 99]
    trace = decode_sglang_indexer(raw)
    assert trace.unknown_rows()[:, 0].tolist() == [t in (5, 7) for t in range(12)]


@pytest.mark.parametrize(
    ("payload", "kwargs", "error", "match"),
    [
        (None, {}, MissingRoutesError, "return_indexer_topk"),
        ({"meta_info": {"prompt_tokens": 3}}, {}, MissingRoutesError, "no indexer_topk"),
        ({"meta_info": {"indexer_topk": {}}}, {"num_layers": 1}, PayloadEncodingError, "dict"),
        ("!!!notbase64", {"num_layers": 1, "index_topk": 1}, PayloadEncodingError, "base64"),
        (base64.b64encode(b"\0" * 6).decode(), {"num_layers": 1, "index_topk": 1}, PayloadSizeError, "int32"),
        ("AAAAAA==", {"index_topk": 1}, LayerCountError, "num_layers"),
        ("AAAAAA==", {"num_layers": 1}, TopKMismatchError, "index_topk or num_tokens"),
        ([[[0.5, 1.0]]], {}, DtypeError, "float"),
        ([[[0, 1]], [[0]]], {}, PayloadEncodingError, "ragged"),
        ([[[0, 2**40]]], {}, IndexerRouteError, "int32"),
        ([[[0, 2**70]]], {}, PayloadEncodingError, "64 bits"),
        ([[[[[[0]]]]]], {}, IndexerRouteError, "6-D"),
        ([[[0, -5]]], {}, IndexerRouteError, "-5"),
        ([[[0, 0]], [[0, 0]]], {}, IndexerRouteError, "twice"),  # an all-zero capture buffer
        ([[[0, 1]], [[1, -1]]], {}, IndexerRouteError, "partial row"),
        (np.zeros((2, 1, 1 << 17), np.int32), {}, PayloadLimitError, "max_index_topk"),
    ],
)
def test_hostile_payloads_are_refused(payload: object, kwargs: dict, error: type, match: str) -> None:
    """Wrong types, corrupt bytes, huge numbers, deep nesting, repeats and partial rows must raise named errors."""
    with pytest.raises(error, match=match):
        decode_sglang_indexer(payload, **kwargs)


def test_deeply_nested_lists_are_refused() -> None:
    """Lists nested thousands deep must give a named error, not a RecursionError."""
    deep: list = [0]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises((PayloadEncodingError, IndexerRouteError)):
        decode_sglang_indexer(deep)


def test_lengths_that_disagree_are_refused(canonical: np.ndarray) -> None:
    """Row count vs prompt + completion tokens, layers vs indexer_topk_num_layers, and slots vs index_topk must
    match; a mismatch names both numbers."""
    response = _response(_engine_rows(canonical))
    with pytest.raises(RowCountError, match="num_tokens=50"):
        decode_sglang_indexer(response, num_tokens=50, index_topk=TOPK)
    with pytest.raises(LayerCountError, match="indexer_topk_num_layers=3 but num_layers=4"):
        decode_sglang_indexer(response, num_layers=4)
    with pytest.raises(TopKMismatchError, match="index_topk=16"):
        decode_sglang_indexer(canonical, index_topk=16)
    with pytest.raises(LayerCountError, match="names 2"):
        decode_sglang_indexer(response, layers=[0, 1])
    with pytest.raises(PayloadSizeError, match="do not split"):
        text = response["meta_info"]["indexer_topk"]
        decode_sglang_indexer(text, num_layers=7, num_tokens=PROMPT + COMPLETION)
    without = _response(_engine_rows(canonical), num_layers=False)
    with pytest.raises(LayerCountError, match="indexer_topk_num_layers"):
        decode_sglang_indexer(without)
    assert decode_sglang_indexer(without, num_layers=LAYERS).num_layers == LAYERS


def test_oversized_payloads_are_refused_before_decoding() -> None:
    """max_bytes and IndexerLimits must bound a payload before its bytes or array are built."""
    text = base64.b64encode(np.zeros(4096, "<i4").tobytes()).decode()
    with pytest.raises(PayloadSizeError, match="max_bytes"):
        decode_sglang_indexer(text, num_layers=1, index_topk=4, max_bytes=1000)
    with pytest.raises(PayloadLimitError, match="max_tokens"):
        decode_sglang_indexer(text, num_layers=1, index_topk=4, limits=IndexerLimits(max_tokens=100))


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        (5, r"layers must be a sequence of global layer numbers, got int"),
        (1.5, r"layers must be a sequence of global layer numbers, got float"),
        ("012", r"layers must be a sequence of global layer numbers, got str"),
        ([0, 1.5, 2], r"layers\[1\]=1\.5 must be an int"),
        ([0, -1, 2], r"layers\[1\]=-1 must be an int in \[0, "),
        ([0, 1, 1], r"names a layer twice"),
    ],
)
def test_bad_layers_argument_is_a_config_error(canonical: np.ndarray, layers: object, match: str) -> None:
    """Issue 22 item 5: `layers=5` or `layers=1.5` raised TypeError from tuple(); the argument is checked
    like the decoder's others (ConfigError naming it), before the payload is decoded."""
    with pytest.raises(ConfigError, match=match):
        decode_sglang_indexer(_response(_engine_rows(canonical)), layers=layers)  # type: ignore[arg-type]


@pytest.mark.parametrize("limits", ["x", 5, {"max_tokens": 10}])
def test_limits_that_are_not_indexer_limits_are_a_config_error(canonical: np.ndarray, limits: object) -> None:
    """`limits="x"` raised AttributeError ('str' object has no attribute 'check_payload') mid-decode."""
    with pytest.raises(ConfigError, match="indexer limits must be a routereplay.indexer.IndexerLimits or None"):
        decode_sglang_indexer(_response(_engine_rows(canonical)), limits=limits)  # type: ignore[arg-type]


def test_limits_none_means_the_defaults(canonical: np.ndarray) -> None:
    payload = _response(_engine_rows(canonical))
    assert decode_sglang_indexer(payload, limits=None) == decode_sglang_indexer(payload)
