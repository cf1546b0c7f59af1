"""Threshold replay: which rows keep the engine's ids, checked against an independent computation from the
router's own logits (a forward hook on each router) and against the ids the experts receive."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import routereplay
from routereplay.errors import ConfigError
from routereplay.testing.hf.models import tiny_model
from tests.runtime.models import gate_weights_probe, perturbed_routers, tiny_qwen3


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
    engine_replayer = routereplay.attach(engine)
    with torch.no_grad(), engine_replayer.record() as rec:
        engine(input_ids=ids, attention_mask=mask)
    routes = rec.routes.clone()
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
    engine_replayer = routereplay.attach(engine)
    with torch.no_grad(), engine_replayer.record() as rec:
        engine(input_ids=ids)
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
    engine_replayer = routereplay.attach(engine)
    with torch.no_grad(), engine_replayer.record() as rec:
        engine(input_ids=ids)
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
