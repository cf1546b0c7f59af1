"""The Megatron adapter against Megatron's own `RouterReplay`, and what changed from megatron-core 0.16 to 0.19.

Differential: one real `TopKRouter` built with `moe_enable_routing_replay=True`, fed the same logits
and the same forced ids once through Megatron's `RouterReplay` (REPLAY_FORWARD / RECORD) and once
through `attach_megatron(...).replay()` / `.record()`: probs, routing map and the logits' gradients
must be identical (`torch.equal`), for every score function Megatron offers. These run on whichever
megatron-core is installed (the project venv has 0.19; `make test-megatron016` runs them on 0.16).

Legend: S = sequence, B = batch, N = S * B tokens, E = experts, K = top-k, L = layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from routereplay.errors import (
    KernelBypassError,
    LayerRenumberedError,
    NativeReplayConflictError,
    UnsupportedRouterError,
)
from tests.runtime.megatron_models import (
    MOE_LAYERS,
    B,
    N,
    S,
    build_block,
    graph_modules_field,
    make_config,
    mtp_inner_layer,
    one_rank_world,
    routers_of,
    standalone_router,
)

pytestmark = pytest.mark.megatron

E, K = 16, 4  # wide enough that an unsorted top-k comes out in another order than a sorted one

ROUTERS: dict[str, dict[str, Any]] = {
    "softmax": {},
    "pre-softmax-scaled": {"moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5},
    "sigmoid-expert-bias": {"moe_router_score_function": "sigmoid"},
    "sigmoid-expert-bias-grouped": {
        "moe_router_score_function": "sigmoid",
        "moe_router_num_groups": 4,
        "moe_router_group_topk": 2,
    },
    "softmax-grouped": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
    "top-1": {"moe_router_topk": 1, "moe_router_pre_softmax": True},  # Megatron requires pre-softmax for top-1
    "top-1-sigmoid": {"moe_router_topk": 1, "moe_router_score_function": "sigmoid"},
    "sqrtsoftplus": {"moe_router_score_function": "sqrtsoftplus"},  # 0.19 only
}


@pytest.fixture(scope="module", autouse=True)
def megatron_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield from one_rank_world(tmp_path_factory)


def native_router(kind: str) -> nn.Module:
    """A layer-1 TopKRouter holding Megatron's own RouterReplay in `router.router_replay`."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    overrides = dict(num_moe_experts=E, moe_router_topk=K, moe_enable_routing_replay=True) | ROUTERS[kind]
    score_function = overrides.get("moe_router_score_function", "softmax")
    try:  # feature-detected: 0.16 has no sqrtsoftplus
        topk_routing_with_score_function(torch.zeros(1, E), 1, score_function=score_function)
    except ValueError as exc:
        pytest.skip(f"this megatron-core has no {kind} router: {exc}")
    config = make_config(**overrides)
    router = standalone_router(config, 1)
    if "expert-bias" in kind:  # building the bias buffer needs CUDA; the routing math does not
        router.expert_bias = torch.linspace(-0.5, 0.5, E)
    return router


def logits_of(seed: int) -> torch.Tensor:
    return torch.randn(S, B, E, generator=torch.Generator().manual_seed(seed))


def forced_ids(k: int, seed: int) -> torch.Tensor:
    """(N, k) distinct expert ids per row, in no particular order."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])


def route(router: nn.Module, logits_SBE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """probs (N, E), routing map (N, E) and d(loss)/d(logits) (N, E) of one routing call."""
    leaf = logits_SBE.clone().requires_grad_(True)
    probs_NE, map_NE = router.routing(leaf)
    weights_NE = torch.randn(N, E, generator=torch.Generator().manual_seed(123))
    (probs_NE * weights_NE).sum().backward()
    assert leaf.grad is not None
    return probs_NE.detach(), map_NE, leaf.grad.view(N, E)


def assert_identical(ours: tuple[torch.Tensor, ...], native: tuple[torch.Tensor, ...]) -> None:
    for name, a, b in zip(("probs", "routing map", "logits grad"), ours, native, strict=True):
        assert torch.equal(a, b), f"{name} differ from Megatron's own RouterReplay"


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_replay_and_record_are_identical_to_megatrons_router_replay(kind: str) -> None:
    """Silent misroute (issue 11 item 34): the same logits and forced ids through Megatron's own
    RouterReplay (REPLAY_FORWARD, RECORD) and through the adapter give identical probs, routing map
    and gradients, for softmax, pre-softmax, sigmoid with expert bias, group-limited and top-1."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from routereplay.runtime.megatron import attach_megatron

    router = native_router(kind)
    native = router.router_replay
    k = int(router.topk)
    ids_NK = forced_ids(k, seed=1)
    native.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    native.set_target_indices(ids_NK)
    native_replayed = route(router, logits_of(0))
    native.set_router_replay_action(RouterReplayAction.RECORD)
    native_recorded = route(router, logits_of(2))
    native_ids_NK = native.get_recorded_indices()
    native.clear_router_replay_action()
    native.clear_indices()

    mr = attach_megatron(nn.ModuleList([router]))
    with mr.replay(ids_NK[:, None]) as used:
        ours_replayed = route(router, logits_of(0))
    assert_identical(ours_replayed, native_replayed)
    assert torch.equal(used.routes[:, 0], ids_NK)
    assert [set(r) for r in ours_replayed[1].nonzero()[:, 1].view(N, k).tolist()] == [set(r) for r in ids_NK.tolist()]
    with mr.record() as rec:
        ours_recorded = route(router, logits_of(2))
    assert_identical(ours_recorded, native_recorded)
    assert torch.equal(rec.routes[:, 0], native_ids_NK)
    with mr.replay(rec.routes):  # and the recorded routes replay Megatron's RECORD pass bit for bit
        assert_identical(route(router, logits_of(2)), native_recorded)
    mr.detach()
    assert router.router_replay is native


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_record_keeps_megatrons_top_k_order(grad: bool) -> None:
    """Silent misroute (issue 11 item 34): megatron-core 0.19 sorts the live top-k only when grad is
    enabled (`sorted=torch.is_grad_enabled()`); the adapter ran it under no_grad, so a record in a
    training forward came out in another order than Megatron's own RECORD (and its sigmoid and
    softmax weights could differ in the last bit). Both grad modes must match RECORD exactly."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from routereplay.runtime.megatron import attach_megatron

    router = native_router("sigmoid-expert-bias")
    native = router.router_replay
    logits_SBE = logits_of(5)
    with torch.set_grad_enabled(grad):
        native.set_router_replay_action(RouterReplayAction.RECORD)
        native_probs_NE = router.routing(logits_SBE)[0]
        native_ids_NK = native.get_recorded_indices()
        native.clear_router_replay_action()
        mr = attach_megatron(nn.ModuleList([router]))
        with mr.record() as rec:
            probs_NE = router.routing(logits_SBE)[0]
    assert torch.equal(rec.routes[:, 0], native_ids_NK)
    assert torch.equal(probs_NE, native_probs_NE)


def test_megatrons_own_router_replay_still_serves_calls_outside_a_context() -> None:
    """Data loss (issue 11 item 34): with `moe_enable_routing_replay=True` attaching set Megatron's
    RouterReplay aside, so its RECORD (0.19's inference routing metadata, CUDA-graph static buffers)
    recorded nothing while attached. Outside a context it now serves every call; inside one, an
    action left set is refused instead of silently ignored."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from routereplay.runtime.megatron import attach_megatron

    router = native_router("softmax")
    native = router.router_replay
    mr = attach_megatron(nn.ModuleList([router]))
    logits_SBE = logits_of(7)
    natural_NK = logits_SBE.view(N, E).topk(K).indices
    native.set_router_replay_action(RouterReplayAction.RECORD)
    buffer_MK = torch.full((N + 3, K), -1, dtype=torch.long)
    if hasattr(native, "set_static_buffer"):  # 0.19: inference records into a static buffer
        native.set_static_buffer(buffer_MK)
    router.routing(logits_SBE)
    assert torch.equal(native.get_recorded_indices(), natural_NK)
    if hasattr(native, "set_static_buffer"):
        assert torch.equal(buffer_MK[:N], natural_NK) and (buffer_MK[N:] == -1).all()
        native.clear_static_buffer()
    with pytest.raises(NativeReplayConflictError, match=r"RouterReplay action is RECORD.*clear_global_router_replay"):
        with mr.replay(forced_ids(K, seed=8)[:, None]):
            router.routing(logits_SBE)
    native.clear_router_replay_action()
    with mr.replay(forced_ids(K, seed=8)[:, None]) as used:
        router.routing(logits_SBE)
    assert torch.equal(used.routes[:, 0], forced_ids(K, seed=8))


def test_router_renumbered_after_attach_is_refused_inside_a_context() -> None:
    """Error that is not a RouteReplayError, then silent misroute (issue 11 item 34): 0.19's
    `Router.set_layer_number` writes `router_replay.layer_number`, which raised AttributeError on the
    adapter's slotted object; on 0.16 a renumbered router silently replayed its old layer's routes."""
    from routereplay.runtime.megatron import attach_megatron

    router = native_router("softmax")
    native = router.router_replay
    mr = attach_megatron(nn.ModuleList([router]))
    assert mr.layers == (1,)
    router.set_layer_number(4)
    if hasattr(native, "layer_number"):  # 0.19: the native instance it stands in for gets the number
        assert native.layer_number == 4
    with pytest.raises(LayerRenumberedError, match=r"bound as 0-based layer 1 but its layer_number is now 4"):
        with mr.replay(forced_ids(K, seed=9)[:, None]):
            router.routing(logits_of(0))
    router.set_layer_number(2)
    with mr.replay(forced_ids(K, seed=9)[:, None]) as used:
        router.routing(logits_of(0))
    assert torch.equal(used.routes[:, 0], forced_ids(K, seed=9))


def test_mtp_router_without_its_mtp_ancestor_is_left_natural() -> None:
    """Silent misroute (issue 11 item 34): 0.19 numbers an MTP layer's inner layer 1, 2, ... (0.16:
    past the decoder) and flags its router `is_mtp_layer`; given as a chunk of its own, without the
    `MultiTokenPredictionLayer` around it, it was bound as decoder layer 0."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from routereplay.runtime.megatron import attach_megatron

    config = make_config(mtp_num_layers=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    mtp = MultiTokenPredictionBlock(config, get_gpt_mtp_block_spec(config, spec.layer_specs[-1], False))
    inner = mtp_inner_layer(mtp)
    mr = attach_megatron([build_block(config), inner])
    assert mr.layers == MOE_LAYERS
    assert [(r.name, r.natural_ok) for r in mr.refused] == [("chunk 1: mlp.router", True)]
    assert "MTP layer" in mr.describe()


class _OwnForwardRouter:
    """Made a TopKRouter subclass at run time (megatron is optional): routes in its own forward."""

    @staticmethod
    def make() -> type:
        from megatron.core.transformer.moe.router import TopKRouter

        class OwnForwardRouter(TopKRouter):
            def forward(self, input: torch.Tensor, padding_mask: Any = None) -> Any:
                return self.gating(input).topk(self.topk)

        return OwnForwardRouter


@pytest.mark.parametrize("family", ["own-forward", "InferenceTopKRouter"])
def test_router_with_its_own_forward_is_refused(family: str) -> None:
    """Silent misroute (issue 11 item 34): 0.19's `InferenceTopKRouter` routes CUDA-graphed inference
    in its own torch.compile'd forward, never through `routing()`; only a `routing()` override was
    refused, so a router with its own forward was bound and its replay silently ignored."""
    from megatron.core.transformer.moe import router as router_module

    from routereplay.runtime.megatron import attach_megatron

    cls = _OwnForwardRouter.make() if family == "own-forward" else getattr(router_module, family, None)
    if cls is None:
        pytest.skip(f"this megatron-core has no {family}")
    config = make_config()
    model = nn.ModuleList([standalone_router(config, 1), standalone_router(config, 2, router_class=cls)])
    with pytest.raises(UnsupportedRouterError, match=r"overrides TopKRouter\.forward\(\)"):
        attach_megatron(model)
    mr = attach_megatron(model, strict=False)
    assert mr.layers == (1,) and [r.name for r in mr.refused] == ["chunk 0: 1"]
    assert model[1].router_replay is None


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"moe_router_load_balancing_type": "quantile_balancing"}, UnsupportedRouterError, "'quantile_balancing'"),
        ({"moe_router_force_biased": 1.0}, UnsupportedRouterError, "random bias"),
        ({"cuda_graph_impl": "full_iteration"}, KernelBypassError, "whole forward-backward"),
        ({"cuda_graph_impl": "local", "modules": ["moe_router", "attn"]}, KernelBypassError, "moe_router"),
        ({"cuda_graph_impl": "transformer_engine", "modules": "full"}, KernelBypassError, "CUDA graphs"),
    ],
)
def test_refuses_the_0_19_config_paths_that_bypass_replay(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Silent misroute (issue 11 item 34): 0.19 selects experts outside `router_replay` for quantile
    balancing (`precomputed_indices`), biases the logits with `moe_router_force_biased`, and names
    CUDA-graph capture `cuda_graph_modules` (its `cuda_graph_scope` is migrated there and reset to
    None, which the adapter read as "no graphs") or `cuda_graph_impl="full_iteration"`."""
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    for field, value in settings.items():  # set after construction: some need CUDA or TE to build
        setattr(block.config, graph_modules_field() if field == "modules" else field, value)
    with pytest.raises(error, match=match):
        attach_megatron(block)
    assert all(r.router_replay is None for r in routers_of(block).values())


@pytest.mark.gpu
def test_cuda_graph_capture_inside_a_context_is_refused() -> None:
    """Silent misroute (issue 11 item 34): 0.19's inference CUDA graphs (`cuda_graph_impl="local"`)
    capture the router; captured inside a context, every graph replay would reuse that call's routes."""
    from routereplay.runtime.megatron import attach_megatron

    router = standalone_router(make_config(num_moe_experts=E, moe_router_topk=K, moe_router_dtype="fp32"), 1).cuda()
    mr = attach_megatron(nn.ModuleList([router]))
    logits_SBE = logits_of(0).cuda()
    router.routing(logits_SBE)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(KernelBypassError, match="captured into a CUDA graph"):
        with mr.replay(forced_ids(K, seed=1)[:, None].cuda()), torch.cuda.graph(graph):
            router.routing(logits_SBE)
