"""Pipeline stage slicing by global layer number: dense-first models, VPP, uneven stages, and
all-layer vs MoE-only payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from routereplay.errors import ConfigError, DivisibilityError, LayerCountError, StageLayerError
from routereplay.layout import LayerKind, LayerMap, PipelineLayout


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[LayerMap, PipelineLayout]:
    pp = draw(st.integers(1, 4))
    vpp = draw(st.integers(1, 3))
    per_chunk = draw(st.integers(1, 3))
    num_layers = pp * vpp * per_chunk
    first_dense = draw(st.integers(0, num_layers - 1))
    return LayerMap.dense_first(num_layers, first_dense), PipelineLayout(
        num_layers=num_layers, pp_size=pp, vpp_size=vpp
    )


def payload(layer_map: LayerMap, layers: tuple[int, ...]) -> np.ndarray:
    """(T=2, L, K=1) routes whose value is the global layer number (dense slots -1, as engines send)."""
    values = np.array([layer if layer_map.kind(layer) is LayerKind.MOE else -1 for layer in layers])
    return np.broadcast_to(values[None, :, None], (2, len(layers), 1)).copy()


@given(pipelines())
def test_every_moe_layer_goes_to_exactly_the_stage_that_runs_it(case: tuple[LayerMap, PipelineLayout]) -> None:
    layer_map, pipeline = case
    seen: list[int] = []
    for pp_rank in range(pipeline.pp_size):
        for vpp_rank in range(pipeline.vpp_size):
            layers = layer_map.stage_layers(pipeline, pp_rank, vpp_rank)
            assert all(pipeline.stage_of(x) == (pp_rank, vpp_rank) for x in layers)
            all_layer = payload(layer_map, tuple(range(layer_map.num_layers)))
            moe_only = payload(layer_map, layer_map.moe_layers)
            from_all = layer_map.stage_routes(all_layer, pipeline, pp_rank, vpp_rank)
            from_moe = layer_map.stage_routes(torch.from_numpy(moe_only), pipeline, pp_rank, vpp_rank)
            assert isinstance(from_moe, torch.Tensor)
            assert np.array_equal(from_all, from_moe.numpy())
            assert from_all[0, :, 0].tolist() == list(layers)  # each slot is its own layer's routes
            seen.extend(layers)
    assert sorted(seen) == list(layer_map.replayed)


def test_virtual_pipeline_chunks_follow_megatron_offsets() -> None:
    pipeline = PipelineLayout(num_layers=8, pp_size=2, vpp_size=2)
    assert [list(pipeline.layers_of(r, v)) for v in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_uneven_first_and_last_stages() -> None:
    pipeline = PipelineLayout(num_layers=61, pp_size=4, first_stage_layers=13, last_stage_layers=12)
    assert [(p.start, p.stop) for p in (pipeline.layers_of(r) for r in range(4))] == [
        (0, 13),
        (13, 31),
        (31, 49),
        (49, 61),
    ]


def test_hash_and_mtp_layers_stay_natural() -> None:
    layer_map = LayerMap(num_layers=4, moe_layers=(1, 2, 3), hash_layers=(1,), mtp_layers=(4,))
    assert layer_map.replayed == (2, 3)
    assert layer_map.stage_layers(PipelineLayout(num_layers=4), 0) == (2, 3)
    with pytest.raises(StageLayerError, match="layer 1 is hash: only MoE layers are replayed"):
        layer_map.select(np.zeros((1, 3, 1)), [1])
    with pytest.raises(StageLayerError, match="layer 0 is dense"):
        layer_map.select(np.zeros((1, 4, 1)), [0])


def test_a_stage_refuses_layers_it_does_not_own() -> None:
    pipeline = PipelineLayout(num_layers=8, pp_size=2)
    with pytest.raises(
        StageLayerError, match=r"layer 5 is run by pipeline stage \(1, 0\).*not by \(0, 0\) which owns layers 0..3"
    ):
        pipeline.check_owned([1, 5], 0)


def test_misuse_raises_named_errors() -> None:
    with pytest.raises(DivisibilityError, match="10 layers do not split over 4 pipeline stages"):
        PipelineLayout(num_layers=10, pp_size=4)
    with pytest.raises(DivisibilityError, match="do not divide by 3 virtual pipeline chunks"):
        PipelineLayout(num_layers=8, pp_size=2, vpp_size=3)
    with pytest.raises(LayerCountError, match="a payload with 5 layers is neither all-layer \\(4\\) nor MoE-only \\(3"):
        LayerMap.dense_first(4, 1).payload_layers(5)
    with pytest.raises(ConfigError, match="mtp_layers \\[3\\] collide with decoder layers"):
        LayerMap(num_layers=4, moe_layers=(1,), mtp_layers=(3,))
    with pytest.raises(ConfigError, match="no model chunk \\(pp_rank 2, vpp_rank 0\\)"):
        PipelineLayout(num_layers=4, pp_size=2).layers_of(2)
