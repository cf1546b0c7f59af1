"""The graph-safe forcing op (`force_topk` reading `ForcingBuffers`), without vLLM: eagerly on CPU, under
`torch.compile` (new buffer contents, no recompile), and replayed from one CUDA graph (`gpu`, lent device).

The router here is DeepSeek-V3's routing in plain torch (sigmoid scores, a correction bias steering the
choice, renormalised weights times a scale), the method `GroupedTopKRouter` and `FusedTopKBiasRouter` apply;
vLLM's own router classes are wrapped in tests/engines/test_vllm_forcing_router.py (`vllm032`).
The truth of every check is computed independently, row by row: a forced row dispatches exactly its forced
ids with the method's weights for them; every other row is bit-identical to the router without forcing.

Legend: T = token rows (the captured size), N = rows of one step, E = experts, K = top-k, L = MoE layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay.engines.vllm.forcing import ForcingBuffers, RoutingMethod, RoutingRule, force_topk

EXPERTS, TOP_K, LAYERS, COLUMN = 16, 4, (3, 5), 1  # the router below is MoE layer 5, column 1 of the buffers
RULE = RoutingRule(RoutingMethod.SCORED_TOPK, renormalize=True, scoring="sigmoid", routed_scaling_factor=2.5)


def live_routing(logits_NE: torch.Tensor, bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: sigmoid scores, the biased scores choose, the unbiased ones weigh."""
    scores_NE = logits_NE.sigmoid()
    ids_NK = torch.topk(scores_NE + bias_E, k=TOP_K, dim=-1).indices.to(torch.int32)
    weights_NK = scores_NE.gather(1, ids_NK.long())
    weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True) * RULE.routed_scaling_factor
    return weights_NK, ids_NK


def wrapped_routing(
    logits_NE: torch.Tensor, bias_E: torch.Tensor, buffers: ForcingBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a wrapped router runs: the live routing, then the buffers' rows for its column forced."""
    weights_NK, ids_NK = live_routing(logits_NE, bias_E)
    rows = ids_NK.shape[0]
    forced_NK, mask_N = buffers.ids_TLK[:rows, COLUMN], buffers.mask_TL[:rows, COLUMN]
    return force_topk(weights_NK, ids_NK, logits_NE, forced_NK, mask_N, RULE)


def random_step(rng: np.random.Generator, tokens: int, forced: int) -> tuple[np.ndarray, np.ndarray]:
    """`forced` random rows of a `tokens`-row step, forced to random expert sets in both layers; a third of the
    rows live in layer 5 (-1)."""
    rows_N = rng.choice(tokens, size=forced, replace=False)
    experts_NLK = np.argsort(rng.random((forced, len(LAYERS), EXPERTS)), axis=-1)[:, :, :TOP_K]
    experts_NLK[: forced // 3, COLUMN] = -1
    return rows_N, experts_NLK


def check_step(
    weights_NK: torch.Tensor,
    ids_NK: torch.Tensor,
    logits_NE: torch.Tensor,
    bias_E: torch.Tensor,
    rows_N: np.ndarray,
    experts_NLK: np.ndarray,
) -> None:
    """Row by row: forced rows carry their forced ids and the method's weights for them, the rest the live result."""
    live_weights_NK, live_ids_NK = live_routing(logits_NE, bias_E)
    forced = {int(row): experts_LK[COLUMN] for row, experts_LK in zip(rows_N, experts_NLK, strict=True)}
    scores_NE = logits_NE.float().sigmoid()
    for row in range(ids_NK.shape[0]):
        experts_K = forced.get(row)
        if experts_K is None or experts_K[0] < 0:
            assert torch.equal(ids_NK[row], live_ids_NK[row]), f"unforced row {row} changed its experts"
            assert torch.equal(weights_NK[row], live_weights_NK[row]), f"unforced row {row} changed its weights"
            continue
        assert ids_NK[row].tolist() == experts_K.tolist(), f"forced row {row} dispatched other experts"
        chosen_K = scores_NE[row, torch.as_tensor(experts_K, device=logits_NE.device).long()]
        expected_K = chosen_K / chosen_K.sum() * RULE.routed_scaling_factor
        torch.testing.assert_close(weights_NK[row], expected_K, rtol=1e-6, atol=1e-6)


def test_forced_rows_follow_the_buffers_and_the_rest_stay_live_on_cpu() -> None:
    """The CPU twin of the CUDA-graph test below: the same function, eagerly, three steps of other sizes."""
    rng = np.random.default_rng(0)
    buffers = ForcingBuffers(max_tokens=64, moe_layers=LAYERS, top_k=TOP_K, device="cpu")
    bias_E = torch.from_numpy(rng.normal(0, 0.5, EXPERTS).astype(np.float32))
    for tokens, forced in ((64, 20), (17, 9), (5, 0)):
        logits_NE = torch.from_numpy(rng.normal(0, 2, (tokens, EXPERTS)).astype(np.float32))
        rows_N, experts_NLK = random_step(rng, tokens, forced)
        buffers.load(rows_N, experts_NLK)
        weights_NK, ids_NK = wrapped_routing(logits_NE, bias_E, buffers)
        check_step(weights_NK, ids_NK, logits_NE, bias_E, rows_N, experts_NLK)


def test_padding_rows_with_minus_one_ids_are_left_alone() -> None:
    """vLLM's padding rows (`VLLM_MOE_SKIP_PADDING`) carry id -1 and weight 0: never gathered out of range,
    never changed."""
    logits_NE = torch.randn(4, EXPERTS)
    weights_NK, ids_NK = live_routing(logits_NE, torch.zeros(EXPERTS))
    ids_NK[2:] = -1
    weights_NK[2:] = 0
    mask_N = torch.tensor([True, False, False, False])
    forced_NK = torch.arange(TOP_K, dtype=torch.int32).repeat(4, 1)
    new_weights_NK, new_ids_NK = force_topk(weights_NK, ids_NK, logits_NE, forced_NK, mask_N, RULE)
    assert new_ids_NK[0].tolist() == [0, 1, 2, 3] and torch.equal(new_ids_NK[1:], ids_NK[1:])
    assert torch.equal(new_weights_NK[1:], weights_NK[1:])


def test_one_compiled_router_follows_new_buffer_contents_without_recompiling() -> None:
    """`torch.compile(fullgraph=True)` traces the op once; two steps with other buffer contents (same shapes)
    reuse the compiled graph (a recompile would raise) and force each step's own rows."""
    rng = np.random.default_rng(1)
    buffers = ForcingBuffers(max_tokens=32, moe_layers=LAYERS, top_k=TOP_K, device="cpu")
    bias_E = torch.from_numpy(rng.normal(0, 0.5, EXPERTS).astype(np.float32))
    compiled = torch.compile(wrapped_routing, fullgraph=True, dynamic=False)
    logits_NE = torch.from_numpy(rng.normal(0, 2, (32, EXPERTS)).astype(np.float32))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for forced in (12, 7):
            rows_N, experts_NLK = random_step(rng, 32, forced)
            buffers.load(rows_N, experts_NLK)
            weights_NK, ids_NK = compiled(logits_NE, bias_E, buffers)
            check_step(weights_NK, ids_NK, logits_NE, bias_E, rows_N, experts_NLK)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_one_cuda_graph_replays_three_steps_of_forced_rows_without_a_host_sync() -> None:
    """Capture the wrapped routing once at 64 token rows (vLLM pads a step to its captured size), then replay
    three steps of 64, 17 and 5 real tokens with other forced rows each: the dispatched ids follow the buffers
    each time. The capture and the replays run under `set_sync_debug_mode("error")`: a host sync raises."""
    device = torch.device("cuda")
    rng = np.random.default_rng(2)
    buffers = ForcingBuffers(max_tokens=64, moe_layers=LAYERS, top_k=TOP_K, device=device)
    bias_E = torch.from_numpy(rng.normal(0, 0.5, EXPERTS).astype(np.float32)).to(device)
    static_logits_TE = torch.zeros(64, EXPERTS, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graphs asks
        for _ in range(3):
            wrapped_routing(static_logits_TE, bias_E, buffers)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its entry synchronises the device; the captured region starts inside
        torch.cuda.set_sync_debug_mode("error")
        try:
            static_weights_TK, static_ids_TK = wrapped_routing(static_logits_TE, bias_E, buffers)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    addresses = (buffers.ids_TLK.data_ptr(), buffers.mask_TL.data_ptr())
    for tokens, forced in ((64, 20), (17, 9), (5, 3)):
        logits_NE = torch.from_numpy(rng.normal(0, 2, (tokens, EXPERTS)).astype(np.float32)).to(device)
        rows_N, experts_NLK = random_step(rng, tokens, forced)
        buffers.load(rows_N, experts_NLK)  # pinned staging, non_blocking copies into the same addresses
        torch.cuda.set_sync_debug_mode("error")
        try:
            static_logits_TE.zero_()  # the padding rows of a short step
            static_logits_TE[:tokens].copy_(logits_NE)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert (buffers.ids_TLK.data_ptr(), buffers.mask_TL.data_ptr()) == addresses
        # every captured row, padding included, against the eager routing at the captured size
        check_step(
            static_weights_TK.clone(), static_ids_TK.clone(), static_logits_TE.clone(), bias_E, rows_N, experts_NLK
        )
