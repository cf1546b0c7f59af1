"""RouteTrace: construction, transforms, comparison and the content validation catalogue."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay import RouteTrace, Segment, Source
from routereplay.errors import (
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    PartialRowError,
    RouteReplayError,
    TopKMismatchError,
    TraceShapeError,
    ZeroLayerError,
)
from routereplay.testing.synthetic import random_trace
from tests.wire.payloads import distinct_routes


def test_defaults_and_dtype(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 3, 2, 16)
    trace = RouteTrace(experts=routes, num_experts=16, layers=(1, 2, 3))
    assert trace.experts.dtype == np.int16
    assert trace.start == 0 and trace.stop == 5
    assert trace.segments == (Segment(0, 5, Source.UNKNOWN, None),)
    assert (trace.num_tokens, trace.num_layers, trace.top_k) == (5, 3, 2)
    assert RouteTrace(routes, 40000).experts.dtype == np.int32
    assert RouteTrace(routes, 16).layers == (0, 1, 2)


def test_accepts_tensor_and_refuses_floats(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 4, 2, 2, 8)
    assert RouteTrace(torch.from_numpy(routes), 8) == RouteTrace(routes, 8)
    with pytest.raises(DtypeError, match="integer array, got dtype float32"):
        RouteTrace(routes.astype(np.float32), 8)


def test_lossy_cast_refused_before_wrapping() -> None:
    # 65535 in uint16 would wrap to -1 in int16: it must be caught, never become "no route"
    routes = np.full((2, 1, 1), 65535, dtype=np.uint16)
    with pytest.raises(ExpertIdRangeError, match=r"span \[65535, 65535\]"):
        RouteTrace(routes, 128)


def test_shape_errors(rng: np.random.Generator) -> None:
    with pytest.raises(TraceShapeError, match=r"shape \(tokens, layers, top_k\), got shape \(4, 2\)"):
        RouteTrace(np.zeros((4, 2), dtype=np.int16), 8)
    with pytest.raises(LayerCountError, match="layers has 3 entries but experts has 2 layers"):
        RouteTrace(distinct_routes(rng, 4, 2, 2, 8), 8, layers=(0, 1, 2))
    with pytest.raises(ConfigError, match="distinct non-negative"):
        RouteTrace(distinct_routes(rng, 4, 2, 2, 8), 8, layers=(3, 3))
    with pytest.raises(ConfigError, match="tile rows"):
        RouteTrace(distinct_routes(rng, 4, 2, 2, 8), 8, segments=(Segment(1, 4),))


def test_num_routed_and_coverage(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 6, 2, 2, 8)
    routes[0] = -1  # token 0 unrouted in both layers
    routes[3, 1] = -1  # token 3 unrouted in layer 1 only
    trace = RouteTrace(routes, 8).validate()
    assert trace.num_routed == 4
    assert trace.coverage == pytest.approx(9 / 12)
    assert trace.routed_mask.tolist()[3] == [True, False]


def test_slice_keeps_positions_and_clips_provenance(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 10, 2, 2, 8)
    segments = (Segment(5, 9, Source.VLLM, 0), Segment(9, 15, Source.SGLANG, 1))
    trace = RouteTrace(routes, 8, start=5, segments=segments)
    part = trace.slice(7, 12)
    assert (part.start, part.stop) == (7, 12)
    assert np.array_equal(part.experts, routes[2:7])
    assert part.segments == (Segment(7, 9, Source.VLLM, 0), Segment(9, 12, Source.SGLANG, 1))
    part.experts[0, 0, 0] = 7 if part.experts[0, 0, 0] != 7 else 6
    assert not np.array_equal(part.experts, routes[2:7]), "slice must copy, not alias"
    with pytest.raises(ConfigError, match=r"outside this trace's token range \[5, 15\)"):
        trace.slice(3, 8)
    assert trace.slice(8, 8).segments == ()


def test_select_layers_and_to_torch(rng: np.random.Generator) -> None:
    trace = RouteTrace(distinct_routes(rng, 4, 3, 2, 8), 8, layers=(1, 3, 5))
    picked = trace.select_layers([5, 1])
    assert picked.layers == (5, 1)
    assert np.array_equal(picked.experts, trace.experts[:, [2, 0]])
    with pytest.raises(ConfigError, match=r"layers \[2\] are not in this trace"):
        trace.select_layers([2])
    tensor = trace.to_torch(dtype=torch.long)
    assert tensor.dtype == torch.long and tuple(tensor.shape) == (4, 3, 2)
    assert torch.equal(tensor, torch.from_numpy(trace.experts.astype(np.int64)))


def test_equality_and_sets(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 4, 2, 3, 8)
    a = RouteTrace(routes, 8)
    b = RouteTrace(routes[..., ::-1].copy(), 8)
    assert a != b and a.equal_sets(b)
    assert a != RouteTrace(routes, 9)
    assert a != RouteTrace(routes, 8, start=1)
    assert a != a.with_provenance(Source.VLLM, 3)
    assert a == RouteTrace(routes.astype(np.int64), 8)


def test_repr_is_readable(rng: np.random.Generator) -> None:
    trace = random_trace(
        rng, num_tokens=7, num_layers=48, top_k=8, num_experts=128, start=3, source="vllm", policy_version=2
    )
    text = repr(trace)
    assert "tokens 3..10 (7 rows)" in text and "48 layers [0..47]" in text
    assert "top_k=8, num_experts=128" in text and "vllm@v2[3:10]" in text


def test_expert_load_counts(rng: np.random.Generator) -> None:
    routes = np.array([[[0, 1]], [[1, 2]], [[-1, -1]]])
    load = RouteTrace(routes, 4).expert_load()
    assert load.tolist() == [[1, 2, 1, 0]]


# --- the content validation catalogue --------------------------------------------------------


def test_out_of_range_names_token_and_layer(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 6, 3, 2, 8)
    routes[4, 1] = [3, 8]
    with pytest.raises(ExpertIdRangeError, match=r"token 14 \(row 4\), layer 21: expert id 8 is outside \[0, 8\)"):
        RouteTrace(routes, 8, layers=(20, 21, 22), start=10).validate()


def test_negative_other_than_sentinel(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 3, 1, 2, 8)
    routes[1, 0] = [-2, -2]
    with pytest.raises(ExpertIdRangeError, match="expert id -2"):
        RouteTrace(routes, 8).validate()


def test_partial_row(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 3, 2, 3, 8)
    routes[2, 1] = [4, -1, -1]
    with pytest.raises(PartialRowError, match=r"sequence 'req-7', token 2, layer 1: row \[4, -1, -1\] mixes -1"):
        RouteTrace(routes, 8).validate("req-7")


def test_duplicate_ids(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 3, 2, 3, 8)
    routes[1, 0] = [5, 2, 5]
    with pytest.raises(DuplicateExpertError, match=r"token 1, layer 0: row \[5, 2, 5\] names an expert twice"):
        RouteTrace(routes, 8).validate()


def test_all_zero_layer(rng: np.random.Generator) -> None:
    routes = distinct_routes(rng, 5, 3, 2, 8)
    routes[:, 1] = 0
    with pytest.raises(ZeroLayerError, match=r"MoE layer\(s\) \[7\] are all zeros over 5 routed rows"):
        RouteTrace(routes, 8, layers=(6, 7, 8)).validate()


def test_all_zero_top1_layer_needs_many_rows() -> None:
    short = np.zeros((4, 1, 1), dtype=np.int16)  # four tokens all on expert 0: can be chance
    RouteTrace(short, 8).validate()
    long = np.zeros((64, 1, 1), dtype=np.int16)
    with pytest.raises(ZeroLayerError, match="all zeros over 64 routed rows"):
        RouteTrace(long, 8).validate()


def test_expectation_checks(rng: np.random.Generator) -> None:
    trace = RouteTrace(distinct_routes(rng, 3, 2, 2, 8), 8)
    with pytest.raises(TopKMismatchError, match="top-k 2 but the model routes to 4"):
        trace.validate(top_k=4)
    with pytest.raises(LayerCountError, match="cover 2 layers, expected 5"):
        trace.validate(num_layers=5)


def test_every_error_is_a_route_replay_error_and_value_error() -> None:
    for cls in (DtypeError, DuplicateExpertError, ExpertIdRangeError, PartialRowError, ZeroLayerError, LayerCountError):
        assert issubclass(cls, RouteReplayError) and issubclass(cls, ValueError)


def _reference_verdict(routes: np.ndarray, num_experts: int) -> str | None:
    """Row-by-row reference of the validation order: range, partial, zero layer, duplicates."""
    T, L, K = routes.shape
    if ((routes < -1) | (routes >= num_experts)).any():
        return "ExpertIdRangeError"
    rows = [(t, l, list(routes[t, l])) for t in range(T) for l in range(L)]
    if any(-1 in r and any(v != -1 for v in r) for _, _, r in rows):
        return "PartialRowError"
    for l in range(L):
        routed = [list(routes[t, l]) for t in range(T) if routes[t, l, 0] != -1]
        if len(routed) >= (1 if K > 1 else 32) and all(all(v == 0 for v in r) for r in routed):
            return "ZeroLayerError"
    if any(r[0] != -1 and len(set(r)) < K for _, _, r in rows):
        return "DuplicateExpertError"
    return None


@given(
    st.integers(1, 20).flatmap(
        lambda k: st.tuples(
            st.just(k), st.integers(k, k + 6), st.integers(0, 6), st.integers(1, 3), st.integers(0, 2**31)
        )
    )
)
@settings(max_examples=300, deadline=None)
def test_validate_matches_reference(params: tuple[int, int, int, int, int]) -> None:
    top_k, num_experts, tokens, layers, seed = params
    rng = np.random.default_rng(seed)
    routes = distinct_routes(rng, tokens, layers, top_k, num_experts)
    for _ in range(int(rng.integers(0, 3))):  # sprinkle the defects the catalogue names
        t, l = int(rng.integers(0, max(tokens, 1))), int(rng.integers(0, layers))
        if tokens == 0:
            break
        kind = int(rng.integers(0, 4))
        if kind == 0:
            routes[t, l] = -1
        elif kind == 1:
            routes[t, l, int(rng.integers(0, top_k))] = -1
        elif kind == 2 and top_k > 1:
            routes[t, l, 0] = routes[t, l, 1]
        else:
            routes[:, l] = 0
    expected = _reference_verdict(routes, num_experts)
    try:
        RouteTrace(routes, num_experts).validate()
        actual = None
    except RouteReplayError as exc:
        actual = type(exc).__name__
    assert actual == expected
