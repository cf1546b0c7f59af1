"""verl 0.9.1's real agent-loop padding, batch and replay rules vs routereplay's rollout routes.

verl's side runs verl's own code: `AgentLoopWorker._agent_loop_postprocess` / `_postprocess` (the
zero-filled `routed_experts`), `DataProto.to_tensordict`, `left_right_2_no_padding`, and for replay its
Megatron R3 rules (`align_r3_router_replay_data`, `build_r3_replay_mask`, `RouterReplay.get_replay_topk`)
driving the tiny model's routers. A probe on each `mlp.experts` records the expert ids dispatched per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import routereplay
from routereplay.integrations.verl import ROUTES_KEY, RolloutRoutes, routes_for_batch
from routereplay.wire import decode_vllm
from tests.integrations.verl import rollout_case as case
from tests.runtime.models import experts_inputs

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def rollout() -> tuple[nn.Module, RolloutRoutes, list[case.Trajectory]]:
    model = case.tiny_model()
    routes = RolloutRoutes(case.geometry(model))
    trajectories = case.rollouts(model, case.updated(model), routes)
    return model, routes, trajectories


def unpadded(batch: Any) -> Any:
    """verl's trainer input: the DataProto as a TensorDict, through verl's own `left_right_2_no_padding`."""
    from verl.workers.utils.padding import left_right_2_no_padding

    return left_right_2_no_padding(batch.to_tensordict())


@contextmanager
def megatron_r3(model: nn.Module) -> Iterator[dict[int, Any]]:
    """verl's Megatron `RouterReplay` (one per MoE layer, REPLAY_FORWARD) choosing each HF router's experts.

    `get_replay_topk` is verl's own: replayed rows where the replay mask is set, native ones elsewhere; the
    hook only feeds it the router's probabilities and renormalises the top-k weights as Qwen3-MoE does."""
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    saved = list(RouterReplay.router_instances)
    replays: dict[int, Any] = {}
    handles = []

    def native(scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None) -> Any:
        return torch.topk(scores, topk, dim=-1)

    for name, module in model.named_modules():
        if not name.endswith("mlp.gate"):
            continue
        layer = int(name.split(".")[2])
        replay = replays[layer] = RouterReplay()
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        def hook(module: nn.Module, args: Any, output: Any, replay: Any = replay) -> Any:
            logits = output[0]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights, indices = replay.get_replay_topk(probs, module.top_k, default_compute_topk=native)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        handles.append(module.register_forward_hook(hook))
    try:
        yield replays
    finally:
        for handle in handles:
            handle.remove()
        RouterReplay.router_instances[:] = saved


def dispatched(model: nn.Module, ids_N: torch.Tensor) -> dict[int, torch.Tensor]:
    """Expert ids each MoE layer's experts received for each token (N, K), from one forward of one sequence."""
    with torch.no_grad(), experts_inputs(model) as seen:
        model(ids_N[None])
    return {layer: calls[0] for layer, calls in seen.items()}


def test_verl_zero_rows_replay_expert_0_where_routereplay_routes_live(rollout) -> None:
    """verl's zero padding, through its own R3 mask, forces expert 0 on the tool tokens after the last call;
    routereplay's compact routes give -1 there: the live router routes them, and they are counted."""
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask

    model, routes, trajectories = rollout
    verl_td = unpadded(case.verl_batch(trajectories))
    ours_td = unpadded(case.verl_batch(trajectories, routes))
    assert "routed_experts" not in ours_td.keys()
    ids = verl_td["input_ids"]
    assert all(torch.equal(a, b) for a, b in zip(ids.unbind(), ours_td["input_ids"].unbind(), strict=True))

    targets = align_r3_router_replay_data(verl_td["routed_experts"], ids)  # verl: (B, j, all 3 layers, K)
    masks = build_r3_replay_mask(ids, verl_td["response_mask"])
    ours = routes_for_batch(ours_td)  # (B, j, 2 MoE layers, K), -1 = no route
    replayer = routereplay.attach(model)
    forced_zero, fallback_expected = {}, 0
    try:
        for b, trajectory in enumerate(trajectories):
            ids_N, target_NAK, mask_N = ids.unbind()[b], targets.unbind()[b].long(), masks.unbind()[b]
            live = dispatched(model, ids_N)
            with megatron_r3(model) as replays:
                for layer, replay in replays.items():
                    replay.set_target_indices(target_NAK[:, layer], mask_N)
                verl_seen = dispatched(model, ids_N)
            routes_NLK = ours.unbind()[b].long()
            replayer.stats.reset()
            with replayer.replay(routes_NLK[None]):  # token ids were checked by routes_for_batch
                ours_seen = dispatched(model, ids_N)
            unrouted_N = routes_NLK[:, 0, 0] < 0
            fallback_expected += int(unrouted_N.sum()) * len(replayer.layers)
            assert replayer.stats.fallback_rows == int(unrouted_N.sum()) * len(replayer.layers)
            for column, layer in enumerate(replayer.layers):
                zero_N = (verl_seen[layer] == 0).all(dim=1)  # both top-k slots dispatched to expert 0
                forced_zero[(trajectory.name, layer)] = torch.nonzero(zero_N & mask_N).flatten().tolist()
                # routereplay: routed rows replayed as routed, -1 rows exactly what the live router picks
                routed = ~unrouted_N
                assert torch.equal(ours_seen[layer][routed].sort(1).values, routes_NLK[routed, column].sort(1).values)
                # the first MoE layer's input does not depend on routes; later ones match where every replayed
                # row is the live model's own (not the resumed sample's rows routed by the updated weights)
                if column == 0 or trajectory.name != "resumed":
                    assert torch.equal(ours_seen[layer][unrouted_N], live[layer][unrouted_N])
                assert not ((ours_seen[layer] == 0).all(dim=1) & ~(live[layer] == 0).all(dim=1)).any()
    finally:
        replayer.detach()

    tool = next(t for t in trajectories if t.name == "tool")
    n = len(tool.tokens)
    tail = [n - 3, n - 2]  # the two tool tokens after the last call (row n - 1, the last token, is masked)
    assert forced_zero[("tool", 1)] == tail and forced_zero[("tool", 2)] == tail
    assert all(not rows for (name, _), rows in forced_zero.items() if name != "tool")
    assert routes.trace("tool").experts[tail].max() == -1
    assert fallback_expected == (1 + 3 + 1) * 2  # each last token, and the tool tail, in both MoE layers


def test_dense_layer_zero_column_of_verl_payload_is_not_a_route(rollout) -> None:
    """verl keeps every hidden layer in `routed_experts`: the dense layer 0's column and the padding are zeros.
    verl's Megatron path indexes columns by layer number and unpads, and its VeOmni engine refuses a column
    count that differs from the routers fired; any consumer that pairs columns with routers in order, or
    forces padded rows, replays them as expert 0. routereplay keeps the MoE layers by global number, and its
    all-layer drop-in makes the dense column and the padding -1."""
    _, routes, trajectories = rollout
    verl = case.verl_batch(trajectories)
    ours = case.verl_batch(trajectories, routes)
    attended = verl.batch["attention_mask"].bool()
    assert (verl.batch["routed_experts"][..., 0, :][attended] == 0).all()
    dense = routes_for_batch(ours, num_hidden_layers=3)
    assert dense.shape == verl.batch["routed_experts"].shape and dense.dtype == torch.int16
    assert (dense[..., 0, :] == -1).all()
    assert (dense[~attended] == -1).all()  # padding: -1, where verl has expert 0
    assert (verl.batch["routed_experts"][~attended] == 0).all()
    routed = dense[..., 1:, 0] >= 0
    assert torch.equal(dense[..., 1:, :][routed], verl.batch["routed_experts"][..., 1:, :][routed].sort(-1).values)


def test_partial_resume_across_weight_update_merges_with_provenance(rollout) -> None:
    """The resumed call re-prefills under v2: rows sampled under v1 keep v1's routes, the new ones are v2's,
    provenance says so, and no prompt row is held twice; the #6029 concatenation is refused."""
    from routereplay.store import DuplicatedPrefixError

    model, routes, trajectories = rollout
    resumed = next(t for t in trajectories if t.name == "resumed")
    trace = routes.trace("resumed")
    assert trace.num_tokens == len(resumed.tokens) - 1
    assert [(s.begin, s.end, s.policy_version) for s in trace.segments] == [(0, 7, 1), (7, 10, 2)]
    verl_rows = resumed.verl_routes[:, list(trace.layers)].astype(np.int16)
    assert np.array_equal(np.sort(verl_rows, axis=-1), trace.experts)  # same rows; verl has no provenance
    assert routes.store.stale_fraction("resumed", current_version=2) == pytest.approx(7 / 10)

    second = case.engine_routes(case.updated(model), resumed.tokens)
    doubled = np.concatenate([resumed.verl_routes[:7], second])  # the re-sent prefix's routes appended whole
    g = routes.geometry
    doubled_trace = decode_vllm(doubled, num_experts=g.num_experts, moe_layers=g.moe_layers, num_layers=g.num_layers)
    fresh = RolloutRoutes(g)
    fresh.add_call("resumed", resumed.tokens[:8], resumed.verl_routes[:7], policy_version=1)
    with pytest.raises(DuplicatedPrefixError, match="6029"):
        fresh.store.add_turn("resumed", resumed.tokens, doubled_trace)
    assert fresh.trace("resumed").num_tokens == 7  # nothing stored by the refused call


def test_compact_blobs_follow_verl_micro_batching(rollout) -> None:
    """Blobs ride verl's own splitting: `prepare_dynamic_batch` (DataProto, reordered by length) and
    `rearrange_micro_batches` after `left_right_2_no_padding`; each micro-batch's routes equal the full
    batch's for the same samples, token ids checked against the micro-batch."""
    from verl.utils.seqlen_balancing import prepare_dynamic_batch, rearrange_micro_batches

    _, routes, trajectories = rollout
    batch = case.verl_batch(trajectories, routes)
    whole = routes_for_batch(batch)
    micro, index = prepare_dynamic_batch(batch, max_token_len=20)  # >= the padded width
    assert len(micro) > 1 and sorted(i for rows in index for i in rows) == [0, 1, 2]
    for part, rows in zip(micro, index, strict=True):
        assert torch.equal(routes_for_batch(part), whole[rows])

    td = unpadded(batch)
    jagged = routes_for_batch(td)
    parts, index = rearrange_micro_batches(td, max_token_len=16)
    for part, rows in zip(parts, index, strict=True):
        got = routes_for_batch(part).unbind()
        assert all(torch.equal(got[i], jagged.unbind()[r]) for i, r in enumerate(rows))


def test_routes_in_another_sample_order_are_refused(rollout) -> None:
    from routereplay.errors import TokenMismatchError

    _, routes, trajectories = rollout
    batch = case.verl_batch(trajectories, routes)
    batch.non_tensor_batch[ROUTES_KEY] = batch.non_tensor_batch[ROUTES_KEY][[1, 0, 2]]
    with pytest.raises(TokenMismatchError, match="sample 0: the routes were captured for token id"):
        routes_for_batch(batch)


def test_verls_token_output_decodes_like_the_engine_array(rollout) -> None:
    """verl's vLLM server hands the agent loop a `TokenOutput` holding vLLM's in-process ndarray."""
    from verl.workers.rollout.replica import TokenOutput

    _, routes, trajectories = rollout
    single = trajectories[0]
    output = TokenOutput(token_ids=single.response, routed_experts=single.verl_routes)
    assert routes.decode(output, single.tokens) == routes.decode(single.verl_routes, single.tokens)
