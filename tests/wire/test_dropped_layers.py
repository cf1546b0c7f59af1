"""`moe_layers` drops the dense layers' columns of an all-layer payload: a dropped column must hold "no route" (0, as
vLLM, SGLang and Megatron leave their zero-filled capture buffers, or -1), never expert ids. A payload whose
"dense" layer holds real ids has a layer axis that is not the model's (a shifted or wrong `moe_layers`): every
engine's decoder refuses it with `DenseLayerRouteError` instead of silently discarding those routes.

Payloads are built the way each engine builds them (`payloads.py`). Legend: T tokens, L payload layers, K top-k.
"""

from __future__ import annotations

import numpy as np
import pytest

from routereplay import decode_megatron, decode_sglang, decode_vllm
from routereplay.errors import DenseLayerRouteError
from tests.wire.payloads import (
    distinct_routes,
    sglang_generate,
    vllm_021_response,
    vllm_npy_b64,
    vllm_response,
)

E, K = 16, 2
MOE_LAYERS = (1, 2)  # a dense-first model: layer 0 has no router
PROMPT, GENERATED = 4, 3  # 7 tokens, 6 rows


def all_layer_routes(dense_value: int = 0) -> np.ndarray:
    """(T, 3, K) routes of a dense-first model as an engine fills them: layer 0's rows all `dense_value`."""
    experts_TLK = distinct_routes(np.random.default_rng(0), PROMPT + GENERATED - 1, 3, K, E).astype(np.int32)
    experts_TLK[:, 0] = dense_value
    return experts_TLK


def decoders() -> dict[str, object]:
    """Each engine's wire form of `routes_TLK`, decoded with moe_layers=MOE_LAYERS."""
    tokens = PROMPT + GENERATED
    return {
        "vllm npy": lambda r: decode_vllm(vllm_response([vllm_npy_b64(r, E)]), num_experts=E, moe_layers=MOE_LAYERS),
        "vllm ndarray": lambda r: decode_vllm(r, num_experts=E, moe_layers=MOE_LAYERS, num_tokens=tokens),
        "vllm 0.21 lists": lambda r: decode_vllm(
            vllm_021_response(r[:PROMPT], r[PROMPT:]), num_experts=E, moe_layers=MOE_LAYERS, num_tokens=tokens
        ),
        "sglang raw int32": lambda r: decode_sglang(
            sglang_generate(r, PROMPT, GENERATED), num_layers=3, top_k=K, num_experts=E, moe_layers=MOE_LAYERS
        ),
        "megatron lists": lambda r: decode_megatron(
            {"moe_topk_indices": r.astype(np.int16).tolist()}, num_experts=E, moe_layers=MOE_LAYERS, num_tokens=tokens
        ),
    }


@pytest.mark.parametrize("wire", list(decoders()))
def test_a_zero_filled_dense_layer_is_dropped(wire: str) -> None:
    routes_TLK = all_layer_routes(0)
    trace = decoders()[wire](routes_TLK)  # type: ignore[operator]
    assert trace.layers == MOE_LAYERS
    for t in range(routes_TLK.shape[0]):
        for column, layer in enumerate(MOE_LAYERS):
            assert set(trace.experts[t, column].tolist()) == set(routes_TLK[t, layer].tolist())


@pytest.mark.parametrize("wire", ["vllm ndarray", "vllm 0.21 lists", "sglang raw int32", "megatron lists"])
def test_a_dense_layer_of_no_route_rows_is_dropped(wire: str) -> None:
    """vLLM 0.21 sends -1 rows for prefix-cached positions across every layer, dense ones included."""
    routes_TLK = all_layer_routes(0)
    routes_TLK[:2] = -1  # two cached prompt rows: -1 in every layer
    trace = decoders()[wire](routes_TLK)  # type: ignore[operator]
    assert (trace.experts[:2] == -1).all() and (trace.experts[2:] >= 0).all()


@pytest.mark.parametrize("wire", list(decoders()))
def test_a_dense_layer_holding_expert_ids_is_refused(wire: str) -> None:
    """The acceptance tester's payload: layer 0, declared dense by moe_layers=(1, 2), holds real routes."""
    routes_TLK = distinct_routes(np.random.default_rng(0), PROMPT + GENERATED - 1, 3, K, E).astype(np.int32)
    routes_TLK[0, 0] = 0  # token 0's row is "no route"; token 1's is the first real one
    with pytest.raises(DenseLayerRouteError, match=r"token 1, layer 0: moe_layers=\[1, 2\] drops payload layer 0.*"
                       r"holds expert ids.*Check moe_layers \(CLI: --moe-layers\)"):  # fmt: skip
        decoders()[wire](routes_TLK)  # type: ignore[operator]


@pytest.mark.parametrize("row", [[0, 5], [5, 5], [0, -1]], ids=["zero and an id", "one id twice", "zero and -1"])
def test_a_dense_row_that_is_not_all_zero_or_all_minus_one_is_refused(row: list[int]) -> None:
    routes_TLK = all_layer_routes(0)
    routes_TLK[3, 0] = row
    with pytest.raises(DenseLayerRouteError, match=rf"token 3, layer 0: .* holds expert ids \[{row[0]}, {row[1]}\]"):
        decode_vllm(routes_TLK, num_experts=E, moe_layers=MOE_LAYERS)
