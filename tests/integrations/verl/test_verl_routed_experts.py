"""verl's own dense `routed_experts` read back by `routed_experts_for_batch`, on batches verl 0.9.1's code builds.

verl's side runs verl's own code: `AgentLoopWorker._agent_loop_postprocess` / `_postprocess` (the zero-filled
`routed_experts`), `DataProto.to_tensordict`, `left_right_2_no_padding`, `rearrange_micro_batches`, and for
comparison its Megatron R3 rules (`align_r3_router_replay_data`, `build_r3_replay_mask`). The routes are
synthetic (no model): a top-1 model's, where verl's zero padding is indistinguishable from expert 0.

Legend: N tokens of a sample, T = N - 1 rows of the last engine call, L MoE layers, K top-k.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import TokenMismatchError
from routereplay.integrations.verl import RouteGeometry, put_routes, routed_experts_for_batch
from routereplay.trace.route_trace import RouteTrace
from tests.integrations.verl import rollout_case as case

pytestmark = pytest.mark.verl

L, E = 2, 8


def _verl_batch(samples: list[dict[str, Any]]) -> Any:
    """verl's DataProto from its own agent-loop postprocessing of each sample's AgentLoopOutput."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    worker = case.verl_worker()
    padded = []
    for sample in samples:
        output = AgentLoopOutput(
            prompt_ids=sample["prompt"],
            response_ids=sample["response"],
            response_mask=sample["response_mask"],
            routed_experts=sample.get("routes"),
            num_turns=4,
            metrics=AgentLoopMetrics(),
            extra_fields={},
        )
        padded.append(asyncio.run(worker._agent_loop_postprocess(output, validate=False, raw_prompt=[])))
    return worker._postprocess(padded, validate=False)


def _tool_sample(seed: int) -> dict[str, Any]:
    """Prompt 3, generated 2, tool 2, generated 2, then 2 tool tokens after the last call (max turns). verl keeps
    the last call's rows: its 9 tokens but the last (T = 8), top-1; rows 1 and 4 (a prompt token and a tool token
    the last call prefilled) genuinely route to expert 0."""
    rng = np.random.default_rng(seed)
    routes_TLK = rng.integers(1, E, size=(8, L, 1)).astype(np.uint8)
    routes_TLK[[1, 4]] = 0
    return {
        "prompt": rng.integers(5, 900, 3).tolist(),
        "response": rng.integers(5, 900, 8).tolist(),
        "response_mask": [1, 1, 0, 0, 1, 1, 0, 0],
        "routes": routes_TLK,
    }


def test_verl_zero_rows_for_a_top1_model_become_no_route_on_verls_own_batch() -> None:
    """verl's own R3 mask replays the last generated token and the first tool token after the last call as
    expert 0 (top-1: nothing flags the zeros); read back here every row from the last generated token on is -1
    (route live), and the genuine expert-0 rows stay 0."""
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    samples = [_tool_sample(0), _tool_sample(1)]
    td = left_right_2_no_padding(_verl_batch(samples).to_tensordict())
    geometry = RouteGeometry(num_experts=E, num_layers=L, top_k=1, moe_layers=tuple(range(L)))
    ours = routed_experts_for_batch(td, geometry=geometry, unchecked=True)
    verl_targets = align_r3_router_replay_data(td["routed_experts"], td["input_ids"])
    verl_mask = build_r3_replay_mask(td["input_ids"], td["response_mask"])
    for b, sample in enumerate(samples):
        got_NLK = ours.unbind()[b]
        assert got_NLK.shape == (11, L, 1)
        assert torch.equal(got_NLK[:8], torch.from_numpy(sample["routes"]).to(torch.int16))
        assert (got_NLK[[1, 4]] == 0).all()  # genuine expert 0: kept
        assert (got_NLK[8:] == -1).all()  # the last generated token and the 2 trailing tool tokens
        forced_zero = verl_mask.unbind()[b] & (verl_targets.unbind()[b] == 0).all(-1).all(-1)
        assert torch.nonzero(forced_zero).flatten().tolist() == [
            1,
            4,
            8,
            9,
        ]  # verl: zero-filled rows 8, 9 forced to expert 0


def _traces(batch: Any) -> list[RouteTrace]:
    """A top-2 trace per sample over its attended tokens but the last, with the batch's token ids."""
    traces = []
    for b in range(len(batch)):
        ids = batch.batch["input_ids"][b][batch.batch["attention_mask"][b].bool()].numpy()
        rng = np.random.default_rng(b)
        experts_TLK = np.argsort(rng.random((len(ids) - 1, L, E)), -1)[..., :2].astype(np.int16)
        traces.append(RouteTrace(experts_TLK, E, layers=tuple(range(L)), token_ids=ids[:-1]))
    return traces


def test_dense_form_rides_verls_splitting_and_refuses_swapped_samples() -> None:
    """put_routes(form='dense') with its digest, through to_tensordict, left_right_2_no_padding and
    rearrange_micro_batches: every micro-batch reads back; equal-length samples swapped in routed_experts
    (what an R2 union onto a reordered batch does) are refused."""
    from verl.utils.seqlen_balancing import rearrange_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    samples = [_tool_sample(0), _tool_sample(1), {**_tool_sample(2), "response": [7, 8, 9]}]
    for sample in samples:
        sample.pop("routes")
        sample["response_mask"] = sample["response_mask"][: len(sample["response"])]
    batch = _verl_batch(samples)
    put_routes(batch, _traces(batch), form="dense")
    whole = left_right_2_no_padding(batch.to_tensordict())
    want = routed_experts_for_batch(whole).unbind()
    parts, index = rearrange_micro_batches(whole, max_token_len=16)
    assert len(parts) > 1
    for part, rows in zip(parts, index, strict=True):
        got = routed_experts_for_batch(part).unbind()
        assert all(torch.equal(got[i], want[r]) for i, r in enumerate(rows))

    swapped = batch.batch["routed_experts"][[1, 0, 2]]  # samples 0 and 1 are both 3 + 8 tokens
    batch.batch["routed_experts"] = swapped
    with pytest.raises(TokenMismatchError, match="sample 0: its routed_experts rows and input_ids"):
        routed_experts_for_batch(left_right_2_no_padding(batch.to_tensordict()))
