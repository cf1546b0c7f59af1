"""Megatron-core adapter on real megatron-core modules (0.16 or 0.19, whichever is installed), on CPU.

The models and the `router.routing(logits)` driver are in `megatron_models.py`; the GPU tests at
the end run `router(x)` itself. Differential tests against Megatron's own `RouterReplay` and the
0.16/0.19 differences are in `test_megatron_native.py`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from routereplay.errors import (
    AlreadyAttachedError,
    BatchShapeError,
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    KernelBypassError,
    LayerCountError,
    MicroBatchCountError,
    MissingLayerError,
    NoRoutersError,
    PartialRowError,
    RecomputeError,
    ReplayStateError,
    TopKMismatchError,
    UnsupportedRouterError,
)
from tests.runtime.megatron_models import (
    MIX,
    MOE_LAYERS,
    B,
    E,
    H,
    K,
    N,
    S,
    build_block,
    chosen_sets,
    graph_modules_field,
    hidden,
    make_config,
    mtp_inner_layer,
    one_rank_world,
    random_routes,
    routers_of,
    run,
    standalone_router,
)

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def megatron_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield from one_rank_world(tmp_path_factory)


# --- binding ------------------------------------------------------------------------------------


def test_binds_real_block_by_0_based_global_layer_and_detach_restores() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    megatron_numbers = sorted(r.layer_number for r in routers_of(block).values())
    assert megatron_numbers == [2, 3, 4]  # Megatron numbers from 1; layer 0 (1 there) is dense
    mr = attach_megatron(block)
    assert mr.layers == MOE_LAYERS
    assert [b.name for b in mr.bindings] == [f"chunk 0: layers.{i}.mlp.router" for i in MOE_LAYERS]
    assert "0-based global layers [1, 2, 3] of 4" in mr.describe()
    with pytest.raises(AlreadyAttachedError, match="already bound"):
        attach_megatron(block)
    mr.detach()
    assert all(r.router_replay is None for r in routers_of(block).values())
    attach_megatron(block).detach()  # attachable again


def test_binding_is_by_identity_not_construction_order_or_global_registry() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from routereplay.runtime.megatron import attach_megatron

    config = make_config(moe_enable_routing_replay=True)
    order = [3, 1, 2]
    random.Random(0).shuffle(order)
    built = {layer: standalone_router(config, layer) for layer in [3, 1, 2]}  # registry order 3, 1, 2
    orphan = standalone_router(config, 2)  # a stale copy of layer 2 (verl #7340): registered, not in the model
    natives = {layer: r.router_replay for layer, r in built.items()}
    model = nn.ModuleList([built[layer] for layer in order])
    assert natives[2] in RouterReplay.global_router_replay_instances
    mr = attach_megatron(model)
    assert mr.layers == MOE_LAYERS
    assert orphan.router_replay in RouterReplay.global_router_replay_instances  # untouched, not bound
    routes_NLK = random_routes(3, seed=1)
    with mr.replay(routes_NLK):
        _, out = run(built, hidden(0))
    for j, layer in enumerate(MOE_LAYERS):
        assert chosen_sets(out[layer][1]) == [set(r) for r in routes_NLK[:, j].tolist()]
    logits_SBE = hidden(0) @ orphan.weight.t()
    natural_NE = orphan.routing(logits_SBE)[1]  # the orphan still routes naturally
    assert chosen_sets(natural_NE) == [set(r) for r in logits_SBE.view(N, E).topk(K).indices.tolist()]
    mr.detach()
    assert all(built[layer].router_replay is natives[layer] for layer in MOE_LAYERS)  # native instances back


def test_mtp_router_left_natural_and_reported() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from routereplay.runtime.megatron import attach_megatron

    config = make_config(mtp_num_layers=1)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    mtp = MultiTokenPredictionBlock(config, get_gpt_mtp_block_spec(config, spec.layer_specs[-1], False))
    model = nn.ModuleDict({"decoder": build_block(config), "mtp": mtp})
    mtp_router = next(r for r in routers_of(mtp).values())
    # 0.16: num_layers + 1, past the decoder; 0.19: numbered 1 again, flagged is_mtp_layer
    assert mtp_router.layer_number == 5 or mtp_router.is_mtp_layer
    mr = attach_megatron(model)
    assert mr.layers == MOE_LAYERS
    inner = next(name for name, m in model.named_modules() if m is mtp_inner_layer(mtp))
    assert [(r.name, r.natural_ok) for r in mr.refused] == [(f"chunk 0: {inner}.mlp.router", True)]
    assert mtp_router.router_replay is None
    assert "left natural: chunk 0: mtp.layers.0" in mr.describe() and "MTP layer" in mr.describe()


def test_pipeline_stage_and_virtual_chunks_take_their_own_layers_of_one_payload() -> None:
    from routereplay.runtime.megatron import attach_megatron

    config = make_config()
    chunk_a = nn.ModuleList([standalone_router(config, 1)])  # virtual chunk 0 owns layer 1
    chunk_b = nn.ModuleList([standalone_router(config, 3)])  # virtual chunk 1 owns layer 3
    mr = attach_megatron([chunk_a, chunk_b])
    assert mr.layers == (1, 3)
    all_layers_NLK = random_routes(4, seed=2)
    routers = {1: chunk_a[0], 3: chunk_b[0]}
    with mr.replay(all_layers_NLK):
        _, out = run(routers, hidden(0))
    for layer in (1, 3):
        assert chosen_sets(out[layer][1]) == [set(r) for r in all_layers_NLK[:, layer].tolist()]
    with pytest.raises(MissingLayerError, match=r"routers of this stage route in layers \[3\]"):
        with mr.replay(all_layers_NLK[:, :3], payload_layers=(0, 1, 2)):
            pass


def test_refuses_unnumbered_router_unless_not_strict_and_dense_model() -> None:
    from routereplay.runtime.megatron import attach_megatron

    config = make_config()
    model = nn.ModuleList([standalone_router(config, 1), standalone_router(config, None)])
    with pytest.raises(UnsupportedRouterError, match=r"layer_number=None.*set_layer_number"):
        attach_megatron(model)
    assert attach_megatron(model, strict=False).layers == (1,)
    with pytest.raises(NoRoutersError, match="no TopKRouter"):
        attach_megatron(nn.Sequential(nn.Linear(4, 4)))


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("moe_router_fusion", True, KernelBypassError, "moe_router_fusion=True"),
        ("cuda_graph_impl", "transformer_engine", KernelBypassError, "CUDA graphs"),
        ("moe_router_load_balancing_type", "sinkhorn", UnsupportedRouterError, "sinkhorn"),
        ("moe_router_force_load_balancing", True, UnsupportedRouterError, "random numbers"),
        ("moe_expert_capacity_factor", 1.0, UnsupportedRouterError, "drops tokens"),
        ("num_microbatches_with_partial_activation_checkpoints", 2, UnsupportedRouterError, "partial"),
    ],
)
def test_refuses_configs_that_bypass_replay(field: str, value: Any, error: type[Exception], match: str) -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    setattr(block.config, field, value)  # set after construction: some need Transformer Engine to build
    with pytest.raises(error, match=match):
        attach_megatron(block)
    assert all(r.router_replay is None for r in routers_of(block).values())


def test_cuda_graphs_that_do_not_capture_the_router_are_accepted() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    block.config.cuda_graph_impl = "transformer_engine"
    setattr(block.config, graph_modules_field(), ["attn"])
    assert attach_megatron(block).layers == MOE_LAYERS


# --- record / replay ----------------------------------------------------------------------------

SCORE_FUNCTIONS = {
    "softmax-post": {},
    "softmax-pre-scaled": {"moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5},
    "sigmoid": {"moe_router_score_function": "sigmoid"},
    "softmax-grouped": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


def expected_probs(kind: str, logits_NE: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    """Megatron's weight math for forced ids, restated: the router's live scores over the forced set."""
    if kind == "softmax-pre-scaled":
        weights_NK = torch.softmax(logits_NE, dim=-1).gather(1, ids_NK) * 2.5
    elif kind == "sigmoid":
        scores_NK = torch.sigmoid(logits_NE).gather(1, ids_NK)
        weights_NK = scores_NK / (scores_NK.sum(-1, keepdim=True) + 1e-20)
    else:
        weights_NK = torch.softmax(logits_NE.gather(1, ids_NK), dim=-1)
    return torch.zeros_like(logits_NE).scatter(1, ids_NK, weights_NK)


@pytest.mark.parametrize("kind", list(SCORE_FUNCTIONS))
def test_record_replay_bit_exact_and_forced_routes_select_exactly_with_gradients(kind: str) -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block(make_config(**SCORE_FUNCTIONS[kind]))
    routers = routers_of(block)
    mr = attach_megatron(block)
    natural_out, natural = run(routers, hidden(0))
    with mr.record() as rec:
        _, recorded = run(routers, hidden(0))
    assert rec.routes.shape == (N, 3, K) and rec.layers == MOE_LAYERS
    with mr.replay(rec.routes):
        replayed_out, replayed = run(routers, hidden(0))
    assert torch.equal(replayed_out, natural_out)
    for layer in MOE_LAYERS:
        assert torch.equal(replayed[layer][0], natural[layer][0]) and torch.equal(replayed[layer][1], natural[layer][1])
        assert torch.equal(recorded[layer][1], natural[layer][1])

    forced_NLK = random_routes(3, seed=7)
    x_SBH = hidden(1)
    logits = {}
    with mr.replay(forced_NLK) as used:
        h_SBH = x_SBH
        for j, (layer, router) in enumerate(sorted(routers.items())):
            logits[layer] = (h_SBH @ router.weight.t()).detach().requires_grad_(True)
            probs_NE, map_NE = router.routing(logits[layer])
            ids_NK = forced_NLK[:, j]
            assert chosen_sets(map_NE) == [set(r) for r in ids_NK.tolist()]
            torch.testing.assert_close(probs_NE, expected_probs(kind, logits[layer].view(N, E).detach(), ids_NK))
            (probs_NE * torch.randn(N, E, generator=torch.Generator().manual_seed(j))).sum().backward()
            grad_NE = logits[layer].grad.view(N, E)
            assert grad_NE.abs().sum() > 0, f"no gradient reached layer {layer}'s logits"
            assert grad_NE.gather(1, ids_NK).abs().sum() > 0
    assert torch.equal(used.routes, forced_NLK)
    assert mr.stats.replayed_rows >= 3 * N


def test_sigmoid_expert_bias_picks_by_biased_scores_and_weights_by_unbiased() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block(make_config(moe_router_score_function="sigmoid"))
    routers = routers_of(block)
    for router in routers.values():  # building the bias buffer needs CUDA; the routing math does not
        router.expert_bias = torch.linspace(-3.0, 3.0, E)
    mr = attach_megatron(block)
    with mr.record() as rec:
        _, natural = run(routers, hidden(0))
    assert (rec.routes >= E // 2).float().mean() > 0.9  # the bias dominates the choice
    with mr.replay(rec.routes):
        _, replayed = run(routers, hidden(0))
    for layer in MOE_LAYERS:
        assert torch.equal(replayed[layer][0], natural[layer][0])


def test_minus_one_rows_fall_back_live_for_those_tokens_only_and_are_counted() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    _, natural = run(routers, hidden(0))
    forced_NLK = random_routes(3, seed=3)
    forced_NLK[[0, 4, 9], 0] = -1  # layer 1 (first MoE layer: same input as the natural pass): no route
    with mr.replay(forced_NLK) as used:
        _, out = run(routers, hidden(0))
    got = chosen_sets(out[1][1])
    live = chosen_sets(natural[1][1])
    assert all(got[t] == live[t] for t in (0, 4, 9))
    assert all(got[t] == set(forced_NLK[t, 0].tolist()) for t in range(N) if t not in (0, 4, 9))
    assert mr.stats.fallback_rows == 3 and mr.stats.fallback_rows_by_layer == {1: 3}
    assert mr.stats.replayed_rows == 3 * N - 3
    assert [set(r) for r in used.routes[[0, 4, 9], 0].tolist()] == [live[t] for t in (0, 4, 9)]


def test_all_layer_moe_only_and_sequence_first_payloads_replay_the_same() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    moe_NLK = random_routes(3, seed=4)
    all_NLK = torch.cat([torch.zeros(N, 1, K, dtype=torch.long), moe_NLK], dim=1)  # dense row: zeros, ignored
    results = []
    for routes, layers in [(moe_NLK, None), (all_NLK, None), (moe_NLK.view(S, B, 3, K), None), (all_NLK, (0, 1, 2, 3))]:
        with mr.replay(routes, payload_layers=layers):
            results.append(run(routers, hidden(0))[0])
    assert all(torch.equal(r, results[0]) for r in results[1:])
    shuffled = moe_NLK[:, [2, 0, 1]]
    with mr.replay(shuffled, payload_layers=(3, 1, 2)):
        assert torch.equal(run(routers, hidden(0))[0], results[0])


# --- micro-batches and activation recompute ------------------------------------------------------


def _checkpointed(kind: str) -> Callable[..., torch.Tensor]:
    def step(routers: dict[int, nn.Module], x_SBH: torch.Tensor) -> torch.Tensor:
        def body(x: torch.Tensor) -> torch.Tensor:
            return run(routers, x)[0]

        return checkpoint(body, x_SBH, use_reentrant=kind == "reentrant")

    return step


@pytest.mark.parametrize("kind", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("mode", ["record", "replay"])
def test_recompute_reuses_each_forwards_routes_across_two_microbatches(kind: str, mode: str) -> None:
    """1F1B order F0 F1 B0 B1; the router weights change before the backwards so a fresh top-k would differ."""
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    step = _checkpointed(kind)
    xs = [hidden(10), hidden(11)]
    routes = [random_routes(3, seed=20), random_routes(3, seed=21)]
    routes[0][:3, 0] = -1  # live fallback rows: their live choice must be reused, not re-decided
    context = mr.record() if mode == "record" else mr.replay(routes)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    with context as used:
        losses = [step(routers, leaf).sum() for leaf in leaves]
        with torch.no_grad():
            for router in routers.values():
                router.weight.add_(torch.randn(E, H, generator=torch.Generator().manual_seed(99)) * 3)
        for loss in losses:
            loss.backward()
    assert mr.stats.recompute_calls == 2 * 3
    with mr.record() as now:  # sanity: the changed weights route differently
        run(routers, xs[0])
    assert not torch.equal(now.routes, used.microbatches[0])
    for x, leaf, routes_NLK in zip(xs, leaves, used.microbatches, strict=True):
        reference = x.clone().requires_grad_(True)
        with mr.replay(routes_NLK):  # no checkpoint: the forward's routes on the changed weights
            run(routers, reference)[0].sum().backward()
        torch.testing.assert_close(leaf.grad, reference.grad, rtol=0, atol=0)


def test_forward_only_schedule_leaves_nothing_for_the_next_schedules_recompute() -> None:
    """Megatron's native REPLAY_BACKWARD list would still hold the forward-only pass's routes here."""
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    with torch.no_grad(), mr.replay([random_routes(3, seed=30), random_routes(3, seed=31)]):
        for seed in (0, 1):
            run(routers, hidden(seed))
    routes_NLK = random_routes(3, seed=32)
    leaf = hidden(2, requires_grad=True)
    with mr.replay(routes_NLK) as used:
        _checkpointed("reentrant")(routers, leaf).sum().backward()
    assert torch.equal(used.routes, routes_NLK)
    reference = hidden(2, requires_grad=True)
    with mr.replay(routes_NLK):
        run(routers, reference)[0].sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=0, atol=0)


def test_schedule_must_be_consumed_exactly_once_per_microbatch() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    two = [random_routes(3, seed=40), random_routes(3, seed=41)]
    with pytest.raises(MicroBatchCountError, match=r"different number of micro-batches than the schedule's 2"):
        with mr.replay(two):
            run(routers, hidden(0))
    with pytest.raises(MicroBatchCountError, match="routes a micro-batch 3 but the schedule holds 2"):
        with mr.replay(two):
            for seed in range(3):
                run(routers, hidden(seed))
    with mr.replay(two):  # a failed schedule leaves no state behind
        run(routers, hidden(0))
        run(routers, hidden(1))


def test_recompute_errors_partial_and_after_close() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    step = _checkpointed("reentrant")
    with pytest.raises(RecomputeError, match="recomputed for only some of their 2 forwards"):
        with mr.replay([random_routes(3, seed=50), random_routes(3, seed=51)]):
            step(routers, hidden(0, requires_grad=True)).sum().backward()
            run(routers, hidden(1))  # not checkpointed: never recomputed
    with mr.replay(random_routes(3, seed=52)):
        loss = step(routers, hidden(0, requires_grad=True)).sum()
    with pytest.raises(ReplayStateError, match="after its record/replay context closed"):
        loss.backward()
    with mr.replay(random_routes(3, seed=54)):
        loss = step(routers, hidden(0, requires_grad=True)).sum()
    with pytest.raises(RecomputeError, match=r"backward recompute #1 but only 0 forward\(s\) routed in this context"):
        with mr.record():  # another context's routes are never reused
            loss.backward()
    with mr.record():
        with pytest.raises(ReplayStateError, match="contexts do not nest"):
            with mr.replay(random_routes(3, seed=53)):
                pass
        run(routers, hidden(0))


def test_deepcopy_of_attached_model_routes_naturally() -> None:
    from routereplay.runtime.megatron import attach_megatron

    config = make_config()
    block = nn.ModuleList([standalone_router(config, layer) for layer in MOE_LAYERS])  # real blocks hold groups
    mr = attach_megatron(block)
    twin = copy.deepcopy(block)
    assert all(r.router_replay is None for r in routers_of(twin).values())
    _, natural = run(routers_of(twin), hidden(0))
    with mr.replay(random_routes(3, seed=60)):
        _, twin_out = run(routers_of(twin), hidden(0))  # the copy is not bound: no micro-batch consumed
        run(routers_of(block), hidden(0))
    assert all(torch.equal(twin_out[layer][1], natural[layer][1]) for layer in MOE_LAYERS)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda r: r[:, :, :1], TopKMismatchError, "top-k 1, the routers use top-2"),
        (lambda r: r.index_fill(0, torch.tensor([3]), E), ExpertIdRangeError, r"token 3, layer 1: expert id 8"),
        (lambda r: torch.cat([r[:, :, :1], r[:, :, :1]], dim=2), DuplicateExpertError, "names an expert twice"),
        (
            lambda r: r.index_put((torch.tensor([2]), torch.tensor([1]), torch.tensor([0])), torch.tensor(-1)),
            PartialRowError,
            "token 2, layer 2",
        ),
        (lambda r: r.float(), DtypeError, "expert ids are integers"),
        (lambda r: r[:, 0], BatchShapeError, r"\(N, L, K\) in router order"),
        (lambda r: r[:, :2], LayerCountError, "pass payload_layers="),
        # hostile forms (issue 38 item 9): a uint64 row beyond int64 wrapped to -1, a silent live fallback
        (
            lambda r: _uint64_row_beyond_int64(r, tensor=True),
            ExpertIdRangeError,
            r"ids span \[0, 18446744073709551615\]",
        ),
        (lambda r: _uint64_row_beyond_int64(r, tensor=False), ExpertIdRangeError, r"uint64 id 18446744073709551615"),
        (lambda r: r.numpy().astype(object), DtypeError, r"micro-batch 0: routes array has dtype object"),
        (lambda r: r.to_sparse(), ConfigError, r"micro-batch 0 routes is a torch.sparse_coo tensor"),
        (lambda r: r.to("meta"), ConfigError, r"micro-batch 0 routes is on the 'meta' device"),
    ],
)
def test_bad_routes_raise_named_errors(
    edit: Callable[[torch.Tensor], torch.Tensor], error: type[Exception], match: str
) -> None:
    from routereplay.runtime.megatron import attach_megatron

    mr = attach_megatron(build_block())
    with pytest.raises(error, match=match):
        with mr.replay(edit(random_routes(3, seed=70))):
            pass


def _uint64_row_beyond_int64(routes_NLK: torch.Tensor, *, tensor: bool) -> torch.Tensor | np.ndarray:
    out = routes_NLK.numpy().astype(np.uint64)
    out[3, 1, :] = np.uint64(2**64 - 1)  # token 3, layer 2 (the second MoE layer)
    return torch.from_numpy(out) if tensor else out


@pytest.mark.parametrize(
    "form",
    [lambda r: r.numpy().astype(">i8"), lambda r: np.ascontiguousarray(r.numpy()[..., ::-1].astype(">i4"))[..., ::-1]],
    ids=["big-endian", "big-endian-negative-strides"],
)
def test_big_endian_and_strided_arrays_force_their_ids(form: Callable[[torch.Tensor], np.ndarray]) -> None:
    """Issue 38 item 9: such arrays raised torch's ValueError; they hold valid ids and replay as them."""
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    forced_NLK = random_routes(3, seed=12)
    with mr.replay(form(forced_NLK)) as used:
        _, out = run(routers, hidden(0))
    for j, layer in enumerate(MOE_LAYERS):
        assert chosen_sets(out[layer][1]) == [set(row) for row in forced_NLK[:, j].tolist()]
    assert torch.equal(used.routes, forced_NLK)


def test_rows_must_match_the_tokens_the_router_sees() -> None:
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    mr = attach_megatron(block)
    with pytest.raises(BatchShapeError, match=r"router sees 10 tokens .* routes have 9 rows"):
        with mr.replay(random_routes(3, seed=80, rows=N - 1)):
            run(routers_of(block), hidden(0))


# --- the real router forward ------------------------------------------------------------------------


@pytest.mark.gpu
def test_full_router_forward_on_cuda_records_replays_and_forces() -> None:
    from routereplay.runtime.megatron import attach_megatron

    config = make_config(moe_router_dtype="fp32")
    block = build_block(config).cuda()
    routers = routers_of(block)
    mr = attach_megatron(block)
    x_SBH = torch.randn(S, B, H, device="cuda")
    natural = {layer: router(x_SBH) for layer, router in routers.items()}
    with mr.record() as rec:
        for router in routers.values():
            router(x_SBH)
    forced_NLK = random_routes(3, seed=90).cuda()
    with mr.replay([rec.routes, forced_NLK]):
        for layer, router in sorted(routers.items()):
            probs_NE, map_NE = router(x_SBH)
            assert torch.equal(probs_NE, natural[layer][0]) and torch.equal(map_NE, natural[layer][1])
        for j, (_, router) in enumerate(sorted(routers.items())):
            router.weight.grad = None
            probs_NE, map_NE = router(x_SBH)
            assert chosen_sets(map_NE.cpu()) == [set(r) for r in forced_NLK[:, j].tolist()]
            (probs_NE * torch.randn_like(probs_NE)).sum().backward()
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.gpu
def test_megatron_checkpoint_recompute_on_cuda_reuses_each_microbatchs_routes() -> None:
    """Megatron's own CheckpointFunction (it forks the CUDA RNG, so it cannot run on CPU), 1F1B order."""
    from megatron.core import tensor_parallel

    from routereplay.runtime.megatron import attach_megatron

    tensor_parallel.model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    block = build_block(make_config(moe_router_dtype="fp32")).cuda()
    routers = routers_of(block)
    mr = attach_megatron(block)

    def body(x_SBH: torch.Tensor) -> torch.Tensor:
        h_SBH = x_SBH
        for layer, router in sorted(routers.items()):
            probs_NE, _ = router(h_SBH)
            h_SBH = h_SBH + (probs_NE @ MIX[layer].cuda()).view_as(h_SBH)
        return h_SBH

    xs = [torch.randn(S, B, H, device="cuda", requires_grad=True) for _ in range(2)]
    routes = [random_routes(3, seed=91).cuda(), random_routes(3, seed=92).cuda()]
    routes[1][:4, 2] = -1
    with mr.replay(routes) as used:
        losses = [tensor_parallel.checkpoint(body, False, x).sum() for x in xs]
        for loss in losses:
            loss.backward()
    assert mr.stats.recompute_calls == 2 * 3
    for x, routes_NLK in zip(xs, used.microbatches, strict=True):
        reference = x.detach().clone().requires_grad_(True)
        with mr.replay(routes_NLK):
            body(reference).sum().backward()
        torch.testing.assert_close(x.grad, reference.grad, rtol=0, atol=0)


# --- fed through the layout transforms ------------------------------------------------------------


def test_layout_transforms_feed_each_microbatch_and_sp_rank_its_own_routes() -> None:
    """A padded trainer batch, packed into THD micro-batches in the trainer's order and scattered over
    two TP-SP ranks by routereplay.layout, routes every real token exactly as the unsharded batch does."""
    from routereplay.layout import attention_mask_of, pack, sequence_parallel_scatter, unpad
    from routereplay.layout.plan import gather, token_index
    from routereplay.runtime.megatron import attach_megatron

    block = build_block()
    routers = routers_of(block)
    mr = attach_megatron(block)
    lengths, seq = [5, 3, 4, 2], 5
    mask_BS = attention_mask_of(lengths, seq, "right")
    routes_BSLK = random_routes(3, seed=11, rows=len(lengths) * seq).view(len(lengths), seq, 3, K).clone()
    routes_BSLK[~mask_BS] = -1
    x_BSH = torch.randn(len(lengths), seq, H, generator=torch.Generator().manual_seed(5))
    with mr.replay(routes_BSLK.reshape(-1, 3, K)):  # every token at once: routing is per token
        _, reference = run(routers, x_BSH.reshape(-1, 1, H))
    tp, checked = 2, 0
    for order in ([2, 0], [3, 1]):  # two micro-batches, each packed in the trainer's order
        index_P = pack(unpad(token_index(len(lengths), seq), attention_mask=mask_BS), order=order, multiple=tp).values
        for rank in range(tp):
            mine_P = sequence_parallel_scatter(index_P, tp, rank)
            with mr.replay(gather(routes_BSLK, mine_P, source_dims=2)):
                _, out = run(routers, gather(x_BSH, mine_P, source_dims=2)[:, None])
            real = mine_P >= 0
            for layer in MOE_LAYERS:
                assert torch.equal(out[layer][1][real], reference[layer][1][mine_P[real]])
                torch.testing.assert_close(out[layer][0][real], reference[layer][0][mine_P[real]])
            checked += int(real.sum())
    assert checked == sum(lengths)
    wrong_P = sequence_parallel_scatter(index_P, tp, 0)  # negative control: rank 1's routes on rank 0's tokens
    with mr.replay(gather(routes_BSLK, sequence_parallel_scatter(index_P, tp, 1), source_dims=2)):
        _, out = run(routers, gather(x_BSH, wrong_P, source_dims=2)[:, None])
    assert not torch.equal(out[1][1][wrong_P >= 0], reference[1][1][wrong_P[wrong_P >= 0]])
