"""Combine weights in the codec: an optional float16 section (flag bit 5), 2 * K bytes per row; blobs
without weights are byte for byte what they were."""

from __future__ import annotations

import numpy as np
import pytest

from routereplay.codec import decode, encode, header_info
from routereplay.codec.header import FLAG_WEIGHTS
from routereplay.errors import CodecFormatError, ConfigError, WeightsShapeError, WeightsValueError
from routereplay.trace.route_trace import RouteTrace


def weighted_trace(rows: int = 6, layers: int = 3, top_k: int = 2, experts: int = 8) -> RouteTrace:
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(rows)])
    ids[2] = -1
    weights = rng.random(ids.shape).astype(np.float32)
    weights[2] = 0
    return RouteTrace(ids, experts, token_ids=np.arange(rows)).with_weights(weights)


def per_id(trace: RouteTrace) -> list[dict[int, float]]:
    assert trace.weights is not None
    return [
        dict(zip(i.tolist(), w.tolist(), strict=True))
        for i, w in zip(trace.experts.reshape(-1, trace.top_k), trace.weights.reshape(-1, trace.top_k), strict=True)
    ]


@pytest.mark.parametrize("mode", ["set", "ordered"])
@pytest.mark.parametrize("compress", [False, True])
def test_weights_round_trip_at_half_precision_each_with_its_id(mode: str, compress: bool) -> None:
    pytest.importorskip("zstandard") if compress else None
    trace = weighted_trace()
    blob = encode(trace, mode=mode, compress=compress)
    back = decode(blob)
    assert trace.weights is not None and back.weights is not None
    as_half = trace.with_weights(trace.weights.astype(np.float16).astype(np.float32))
    assert per_id(back) == per_id(as_half)
    if mode == "ordered":
        assert np.array_equal(back.experts, trace.experts) and np.array_equal(back.weights, as_half.weights)
    assert np.array_equal(back.token_ids, trace.token_ids)  # type: ignore[arg-type]


def test_ids_only_blobs_are_unchanged_and_weights_cost_two_bytes_per_weight() -> None:
    trace = weighted_trace()
    ids_only = RouteTrace(trace.experts, trace.num_experts, token_ids=trace.token_ids)
    plain, weighted = encode(ids_only), encode(trace)
    assert plain[6] & FLAG_WEIGHTS == 0 and weighted[6] & FLAG_WEIGHTS
    assert len(weighted) - len(plain) == 2 * trace.top_k * trace.num_tokens * trace.num_layers
    assert decode(plain).weights is None and header_info(weighted).weights_offset > 0


def test_hostile_weight_sections_are_refused() -> None:
    trace = weighted_trace()
    blob = bytearray(encode(trace))
    at = header_info(bytes(blob)).weights_offset
    blob[at : at + 2] = np.array([np.nan], dtype="<f2").tobytes()
    blob[-4:] = _crc(bytes(blob[:-4]))
    with pytest.raises(CodecFormatError, match="is nan: combine weights are finite"):
        decode(bytes(blob))
    blob[at : at + 2] = np.array([-1.0], dtype="<f2").tobytes()
    blob[-4:] = _crc(bytes(blob[:-4]))
    with pytest.raises(CodecFormatError, match="finite, >= 0"):
        decode(bytes(blob))
    with pytest.raises(CodecFormatError, match="truncated|declares"):
        decode(bytes(blob[: at + 3]) + bytes(blob[-4:]))
    with pytest.raises(ConfigError, match="float16's range"):
        encode(trace.with_weights(trace.weights * 1e6))  # type: ignore[operator]


def test_trace_weights_are_checked_and_follow_their_ids() -> None:
    trace = weighted_trace()
    assert trace.weights is not None
    with pytest.raises(WeightsShapeError, match="shape"):
        trace.with_weights(trace.weights[:, :2])
    bad = trace.weights.copy()
    bad[2, 0, 0] = 0.5
    with pytest.raises(WeightsValueError, match="0 where the route is -1"):
        trace.with_weights(bad)
    assert per_id(trace.sorted_rows()) == per_id(trace)
    selected = RouteTrace(trace.experts[:, [2, 0]], 8, (2, 0)).with_weights(trace.weights[:, [2, 0]])
    assert per_id(trace.select_layers([2, 0])) == per_id(selected)
    assert np.array_equal(trace.slice(1, 4).weights, trace.weights[1:4])  # type: ignore[arg-type]
    assert trace.merge(trace).weights is None  # merged rows come from two passes: weights are dropped


def _crc(data: bytes) -> bytes:
    import zlib

    return zlib.crc32(data).to_bytes(4, "little")


def test_encoded_routes_keep_the_ids_only() -> None:
    from routereplay.codec.encoded import EncodedRoutes

    trace = weighted_trace()
    encoded = EncodedRoutes.encode(RouteTrace(trace.experts, 8).with_weights(trace.weights))
    assert encoded.trace().weights is None and np.array_equal(
        np.sort(encoded.trace().experts, 2), trace.sorted_rows().experts
    )


@pytest.mark.parametrize("mode", ["set", "ordered"])
@pytest.mark.parametrize(
    ("value", "stored"),
    [(65504.0, True), (65504.5, False), (65519.99, False), (65520.0, False), (float("inf"), False)],
    ids=["65504", "65504.5", "65519.99", "65520", "inf"],
)
def test_weights_at_float16s_edge_round_trip_exactly_or_are_refused(mode: str, value: float, stored: bool) -> None:
    """Issue 38 item 10: weights in (65504, 65520) were stored as 65504 although docs/codec.md says refused.
    65504 (float16's largest value) round-trips exactly; anything above is refused at encode, inf by the trace."""
    trace = weighted_trace()
    assert trace.weights is not None
    weights = trace.weights.copy()
    weights[4, 1, 0] = value
    if value == float("inf"):
        with pytest.raises(WeightsValueError, match=r"weight 0 of row 4, layer column 1 is inf"):
            trace.with_weights(weights)
        return
    edged = trace.with_weights(weights)
    if stored:
        back = decode(encode(edged, mode=mode))
        assert per_id(back)[4 * 3 + 1][int(trace.experts[4, 1, 0])] == value  # row 4, layer 1: exact
        return
    shown = repr(float(np.float32(value)))
    with pytest.raises(ConfigError, match=rf"combine weight 0 of row 4, layer column 1 is {shown}, above 65504"):
        encode(edged, mode=mode)
