"""Threshold replay: which rows keep the engine's ids, checked against an independent computation from the
router's own logits (a forward hook on each router) and against the ids the experts receive."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import routereplay
from routereplay.errors import ConfigError
from routereplay.testing.hf.models import tiny_model
from tests.runtime.models import engine_record, gate_weights_probe, perturbed_routers, tiny_qwen3


def router_logits(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[object]]:
    """Each router's logits (its first output) by module path, read by forward hooks."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            handles.append(module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out[0])))
    return seen, handles


@pytest.mark.parametrize("margin", [0.0, 0.05, 0.2])
@pytest.mark.parametrize("order", ["set", "engine"])
def test_replaced_rows_are_exactly_those_out_of_margin(margin: float, order: str) -> None:
    trainer = tiny_qwen3()
    engine = perturbed_routers(trainer, noise=0.4, seed=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    routes = engine_record(engine, ids, mask).routes.clone()
    routes[1, 4] = -1  # a fallback row: live, never counted as replaced
    replayer = routereplay.attach(trainer)
    logits, handles = router_logits(trainer)
    with torch.no_grad(), replayer.replay(routes, mask, threshold=margin, order=order, check_alignment=False):
        with gate_weights_probe(trainer) as seen:
            trainer(input_ids=ids, attention_mask=mask)
    for handle in handles:
        handle.remove()  # type: ignore[attr-defined]
    attended_T = mask.reshape(-1).bool()
    expected_by_layer = {}
    for column, site in enumerate(replayer.sites):
        scores_TE = torch.softmax(logits[site.name].float(), dim=-1)  # what Qwen3-MoE's selection top-k sees
        live_TK = scores_TE.topk(2, dim=-1).indices
        forced_TK = routes[:, :, column].reshape(-1, 2).long()
        kth_T = scores_TE.topk(2, dim=-1).values[:, -1]
        out_T = (scores_TE.gather(1, forced_TK.clamp(min=0)) < kth_T[:, None] - margin).any(-1) & (forced_TK[:, 0] >= 0)
        expected_TK = torch.where(out_T[:, None] | (forced_TK[:, :1] < 0), live_TK, forced_TK)
        got_TK = seen[site.layer][0][0]
        assert torch.equal(got_TK.sort(-1).values, expected_TK.sort(-1).values), f"layer {site.layer}"
        expected_by_layer[site.layer] = int((out_T & attended_T).sum())
    assert replayer.stats.replaced_rows_by_layer == expected_by_layer  # every thresholded layer, 0 included
    assert replayer.stats.replaced_rows == sum(expected_by_layer.values())
    replayed = replayer.stats.replayed_rows
    assert replayer.stats.replace_rate == pytest.approx(replayer.stats.replaced_rows / replayed)
    if margin == 0.0:
        assert replayer.stats.replaced_rows > 0  # the perturbed engine disagrees somewhere


def test_a_huge_margin_is_plain_replay_bit_for_bit() -> None:
    trainer = tiny_model("mixtral")
    engine = perturbed_routers(trainer, noise=0.5, seed=1)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    rec = engine_record(engine, ids)
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), replayer.replay(rec.routes):
        plain = trainer(input_ids=ids).logits
    replayer.stats.reset()
    with torch.no_grad(), replayer.replay(rec.routes, threshold=1e9):
        kept = trainer(input_ids=ids).logits
    assert torch.equal(plain, kept) and replayer.stats.replaced_rows == 0 and replayer.stats.replayed_rows > 0


def test_experts_outside_the_live_groups_are_out_of_any_margin() -> None:
    """DeepSeek-V3's group limit masks the selection score of experts outside the live groups to -inf:
    a forced row naming one of them goes live whatever the margin."""
    trainer = tiny_model("deepseek_v3")
    engine = perturbed_routers(trainer, noise=0.5, seed=1)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    rec = engine_record(engine, ids)
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), replayer.replay(rec.routes, threshold=1e9) as used:
        trainer(input_ids=ids)
        routes_used = used.routes
    with torch.no_grad(), replayer.replay(routes_used):  # the same routes, now all within the live groups
        pass
    replaced = (routes_used.sort(-1).values != rec.routes.sort(-1).values).any(-1)
    assert int(replaced.sum()) == replayer.stats.replaced_rows > 0


@pytest.mark.parametrize("margin", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_bad_margins_are_refused(margin: object) -> None:
    replayer = routereplay.attach(tiny_qwen3())
    routes = torch.zeros((1, 2, 3, 2), dtype=torch.long)
    routes[..., 1] = 1
    with pytest.raises(ConfigError, match="finite margin >= 0"):
        with replayer.replay(routes, threshold=margin):  # type: ignore[arg-type]
            pass


def test_sparsemixer_routers_refuse_threshold_by_name() -> None:
    replayer = routereplay.attach(tiny_model("phimoe"))
    routes = torch.zeros((1, 2, len(replayer.layers), 2), dtype=torch.long)
    routes[..., 1] = 1
    with pytest.raises(ConfigError, match="PhimoeTopKRouter"):
        with replayer.replay(routes, threshold=0.1):
            pass


def test_rows_a_threshold_gives_back_keep_the_live_weights() -> None:
    trainer = tiny_qwen3()
    engine = perturbed_routers(trainer, noise=0.4, seed=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    rec = engine_record(engine, ids, weights=True)
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), replayer.replay(rec.routes, weights=rec.weights, threshold=0.0) as used:
        with gate_weights_probe(trainer) as seen:
            trainer(input_ids=ids)
        routes_used = used.routes
    with torch.no_grad(), replayer.record(weights=True) as live:  # the trainer's own routing and weights
        trainer(input_ids=ids)
    layer = replayer.layers[0]  # the first layer sees the same hidden states in both runs
    got_ids, got_weights = seen[layer][0]
    replaced_T = (routes_used[:, :, 0].sort(-1).values != rec.routes[:, :, 0].sort(-1).values).any(-1).reshape(-1)
    kept_T = ~replaced_T
    assert replaced_T.any() and kept_T.any()
    live_weights = live.weights[:, :, 0].reshape(got_weights.shape)
    given_weights = rec.weights[:, :, 0].reshape(got_weights.shape)
    assert torch.equal(got_weights[replaced_T], live_weights[replaced_T])  # live ids, live weights
    assert torch.equal(got_ids[replaced_T], live.routes[:, :, 0].reshape(got_ids.shape)[replaced_T].long())
    assert torch.equal(got_weights[kept_T].sum(-1), given_weights[kept_T].sum(-1))  # kept rows: given weights
