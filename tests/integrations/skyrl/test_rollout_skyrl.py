"""The rollout side against real SkyRL 0.4.0 code (marker `skyrl`, `make test-skyrl`): SkyRL's own envelope
writer, its multi-turn `RoutedExpertTrace`, its batch collate into a `PackedTensor`, and the packed reader's
refusals of bad input from SkyRL's side, each before the output is allocated.

Legend: B trajectories, S padded positions, T rows of one call, A = all hidden layers, M = MoE layers, K = top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    DtypeError,
    ExpertIdRangeError,
    RowCountError,
    TokenMismatchError,
)
from routereplay.integrations.skyrl import (
    RolloutRoutes,
    RouteGeometry,
    decode_skyrl,
    route_digests,
    routes_of_packed,
)

pytestmark = pytest.mark.skyrl

GEOMETRY = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))


def routes(rows: int, seed: int, *, num_experts: int = 16, low: int = 0, dtype: Any = np.int32) -> np.ndarray:
    """(T, A=3, K=2) all-layer routes as vLLM reports them: dense layer 0 zero, sorted distinct ids per row."""
    rng = np.random.default_rng(seed)
    out_TAK = np.zeros((rows, 3, 2), dtype=dtype)
    for layer in (1, 2):
        out_TAK[:, layer] = np.sort(low + np.argsort(rng.random((rows, num_experts - low)), axis=1)[:, :2], axis=1)
    return out_TAK


@pytest.fixture(scope="module")
def skyrl() -> Any:
    """SkyRL's modules this file drives (imported here, after tests/conftest.py gated the marker)."""
    from types import SimpleNamespace

    from skyrl.backends.skyrl_train.inference_servers import generate_wire
    from skyrl.backends.skyrl_train.utils import packed_tensor, routed_experts
    from skyrl.train.dataset import preprocess

    return SimpleNamespace(wire=generate_wire, packed=packed_tensor, routed=routed_experts, preprocess=preprocess)


def test_skyrls_own_envelope_decodes_to_the_engine_routes(skyrl: Any) -> None:
    """`pack_routed_experts` (what /skyrl/v1/generate sends) of vLLM's uint16 array and of a torch tensor."""
    kwargs: dict[str, Any] = {"num_experts": 300, "moe_layers": (1, 2), "num_layers": 3, "top_k": 2, "num_tokens": 9}
    for routes_TAK in (routes(8, 1, num_experts=300, dtype=np.uint16), routes(8, 2, num_experts=200)):
        for given in (routes_TAK, torch.from_numpy(routes_TAK.astype(np.int32))):
            envelope = skyrl.wire.pack_routed_experts(given)
            trace = decode_skyrl({"choices": [{"token_ids": [1], "routed_experts": envelope}]}, **kwargs)
            np.testing.assert_array_equal(trace.experts, routes_TAK[:, 1:])


def test_skyrls_client_body_parse_decodes(skyrl: Any) -> None:
    """The body as SkyRL's client parses it (`load_packed_body`: the base64 spliced in as a memoryview)."""
    import orjson

    routes_TAK = routes(6, 3)
    envelope = skyrl.wire.pack_routed_experts(routes_TAK)
    choice = {"token_ids": [5, 6], "finish_reason": "stop", "routed_experts": envelope}
    body = skyrl.wire.load_packed_body(orjson.dumps({"choices": [choice]}))
    assert isinstance(body["choices"][0]["routed_experts"]["data"], memoryview)
    trace = decode_skyrl(body, num_experts=16, moe_layers=(1, 2), num_layers=3, top_k=2, num_tokens=7)
    np.testing.assert_array_equal(trace.experts, routes_TAK[:, 1:])


def test_multi_turn_matches_skyrls_routed_expert_trace_past_255(skyrl: Any) -> None:
    """The same three calls through SkyRL 0.4.0's `RoutedExpertTrace` (its generator's bookkeeping) and through
    `RolloutRoutes`: one prefix, ids >= 256 in the last turns kept by both (SkyRL #1912), rows equal as sets."""
    geometry = RouteGeometry(num_experts=300, num_layers=3, top_k=2, moe_layers=(1, 2))
    ours, theirs = RolloutRoutes(geometry), skyrl.routed.RoutedExpertTrace()
    tokens: list[int] = [1, 2, 3, 4]
    for turn, (out, obs, low, high) in enumerate(
        [([5, 6], [7], 0, 250), ([8], [9, 10], 256, 300), ([11, 12], [], 0, 300)]
    ):
        start = theirs.prompt_start
        assert ours.prompt_start("s") == start
        rows = len(tokens) + len(out) - 1 - start
        envelope = skyrl.wire.pack_routed_experts(routes(rows, 10 + turn, num_experts=high, low=low))
        theirs.record_generation(
            prompt_token_count=len(tokens),
            generated_token_count=len(out),
            routed_experts=skyrl.wire.decode_packed_routed_experts(envelope),
        )
        ours.add_generation("s", tokens, out, envelope, prompt_start=start)
        tokens = tokens + out + obs
    loss_mask = [0] * 4 + [1] * (len(tokens) - 4)
    finalized_CAK = theirs.finalize(token_count=len(tokens), loss_mask=loss_mask[: len(tokens)])
    (mine_CAK,) = ours.generator_routes(["s"])
    assert mine_CAK.dtype == np.int16 and mine_CAK.shape == finalized_CAK.shape and int(mine_CAK.max()) >= 256
    np.testing.assert_array_equal(np.sort(mine_CAK, axis=-1), np.sort(finalized_CAK.astype(np.int16), axis=-1))


def batch(skyrl: Any, rollout: RolloutRoutes, samples: dict[str, tuple[list[int], list[int]]]) -> dict[str, Any]:
    """SkyRL's own collate (`convert_prompts_responses_to_batch_tensors`, `make_router_padding_mask`) of the
    trajectories' prompts, responses and `generator_routes`."""
    ids = list(samples)
    arrays = rollout.generator_routes(ids)
    prompts = [samples[i][0] for i in ids]
    responses = [samples[i][1] for i in ids]
    out = skyrl.preprocess.convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses],
        rollout_expert_indices=arrays,
    )  # fmt: skip
    sequences, attention_mask, packed = out[0], out[1], out[6]
    padding = skyrl.preprocess.make_router_padding_mask(attention_mask, [len(a) for a in arrays])
    return {"packed": packed, "attention_mask": attention_mask, "router_padding_mask": padding, "sequences": sequences,
            "digests": route_digests(rollout.traces(ids), GEOMETRY), "traces": rollout.traces(ids)}  # fmt: skip


def two_trajectories(skyrl: Any) -> dict[str, Any]:
    rollout = RolloutRoutes(GEOMETRY)
    rollout.add_generation("a", [1, 2, 3], [4, 5, 6], routes(5, 20), prompt_start=0)
    rollout.add_generation("b", [7, 8], [9], routes(2, 21), prompt_start=0)
    rollout.add_generation("b", [7, 8, 9, 30, 31], [10, 11], routes(4, 22), prompt_start=2)
    return batch(skyrl, rollout, {"a": ([1, 2, 3], [4, 5, 6]), "b": ([7, 8], [9, 30, 31, 10, 11])})


def test_skyrls_packed_batch_reads_back_as_the_merged_routes(skyrl: Any) -> None:
    """Through SkyRL's collate and back: each trajectory's captured rows at its real (left-padded) positions, -1 on
    the padding and on SkyRL's dummy tail (never its experts 0..K-1); the digests hold."""
    b = two_trajectories(skyrl)
    assert isinstance(b["packed"], skyrl.packed.PackedTensor) and b["packed"].dtype == torch.uint8
    routes_BSMK = routes_of_packed(
        b["packed"], b["attention_mask"], geometry=GEOMETRY, router_padding_mask=b["router_padding_mask"],
        sequences=b["sequences"], digests=b["digests"],
    )  # fmt: skip
    assert routes_BSMK.shape == (2, 7, 2, 2) and routes_BSMK.dtype == torch.int16
    for row, trace in enumerate(b["traces"]):
        keep_S = b["attention_mask"][row].bool()
        real_NMK = routes_BSMK[row][keep_S]
        captured = trace.num_tokens  # every row of these traces is routed: the prefix is the whole trace
        np.testing.assert_array_equal(real_NMK[:captured].numpy(), trace.experts)
        assert (real_NMK[captured:] == -1).all() and (routes_BSMK[row][~keep_S] == -1).all()


def packed_with(skyrl: Any, b: dict[str, Any], values: torch.Tensor, lengths: list[int] | None = None) -> Any:
    cu = b["packed"].cu_seqlens if lengths is None else skyrl.packed.cu_seqlens_from_lengths(lengths)
    return skyrl.packed.PackedTensor(values, cu)


def test_bad_input_from_skyrls_side_is_refused_before_allocating(skyrl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    b = two_trajectories(skyrl)
    values = b["packed"].values
    read: dict[str, Any] = {"geometry": GEOMETRY, "router_padding_mask": b["router_padding_mask"]}
    allocations: list[tuple[Any, ...]] = []
    full = torch.full

    def counted_full(*args: Any, **kwargs: Any) -> torch.Tensor:
        allocations.append(args)
        return full(*args, **kwargs)

    monkeypatch.setattr(torch, "full", counted_full)
    with pytest.raises(BatchGeometryError, match=r"expected \[rows, 3, 2\]"):  # a wrong PackedTensor shape
        routes_of_packed(packed_with(skyrl, b, values[:, :2]), b["attention_mask"], **read)
    with pytest.raises(
        RowCountError, match="trajectory 0: cu_seqlens gives it 7 route rows but attention_mask 6 tokens"
    ):
        routes_of_packed(packed_with(skyrl, b, values, [7, 6]), b["attention_mask"], **read)
    shifted = values.clone()
    shifted[:6] = values[:6].roll(1, dims=0)  # trajectory 0's rows one token late
    with pytest.raises(TokenMismatchError, match="trajectory 0: .*shifted"):
        routes_of_packed(packed_with(skyrl, b, shifted), b["attention_mask"], sequences=b["sequences"],
                         digests=b["digests"], **read)  # fmt: skip
    wide = values.to(torch.int16)
    wide[8, 2, 1] = 16
    with pytest.raises(ExpertIdRangeError, match=r"trajectory 1, token 2 .*layer 2: expert ids \[.*16\]"):
        routes_of_packed(packed_with(skyrl, b, wide), b["attention_mask"], **read)
    with pytest.raises(BatchFieldError, match="router_padding_mask is None: .*dummy experts 0..K-1"):
        routes_of_packed(b["packed"], b["attention_mask"], geometry=GEOMETRY, router_padding_mask=None)
    big = RouteGeometry(num_experts=300, num_layers=3, top_k=2, moe_layers=(1, 2))
    with pytest.raises(DtypeError, match="torch.uint8, too narrow for 300 experts .*#1912"):
        routes_of_packed(b["packed"], b["attention_mask"], **{**read, "geometry": big})
    assert allocations == []  # every refusal came before the (B, S, M, K) output
