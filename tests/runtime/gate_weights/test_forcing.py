"""Weights replay and capture, with the truth from the model: a probe on each experts module reads the ids
and the gate weights the experts compute with (`tests/runtime/models.gate_weights_probe`)."""

from __future__ import annotations

import pytest
import torch

import routereplay
from routereplay.errors import WeightsUnsupportedError
from routereplay.testing.hf.models import tiny_model
from tests.runtime.models import gate_weights_probe, perturbed_routers, tiny_qwen3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def batch(seed: int = 0, rows: int = 2, positions: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (rows, positions), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on one row
    return ids, mask


def engine_side(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes and combine weights of another policy (the "engine"): its own record."""
    replayer = routereplay.attach(model)
    with torch.no_grad(), replayer.record(weights=True) as rec:
        model(input_ids=ids, attention_mask=mask)
    routes, weights = rec.routes, rec.weights
    replayer.detach()
    return routes, weights


def per_id(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for i, w in zip(ids_TK, weights_TK, strict=True)]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("order", ["set", "engine"])
def test_the_experts_receive_exactly_the_given_weights(family: str, order: str) -> None:
    trainer = tiny_qwen3() if family == "qwen3_moe" else tiny_model(family)
    engine = perturbed_routers(trainer, noise=0.5, seed=1)
    ids, mask = batch()
    routes, weights = engine_side(engine, ids, mask)
    replayer = routereplay.attach(trainer)
    with replayer.replay(routes, mask, weights=weights, order=order), gate_weights_probe(trainer) as seen:
        trainer(input_ids=ids, attention_mask=mask)
    for column, layer in enumerate(replayer.layers):
        got_ids, got_weights = seen[layer][0]
        given_ids = routes[:, :, column].reshape(-1, routes.shape[-1]).long()
        given = weights[:, :, column].reshape(-1, weights.shape[-1]).to(got_weights.dtype)
        if order == "engine":  # the given order itself, weights bit for bit
            assert torch.equal(got_ids, given_ids) and torch.equal(got_weights, given)
        else:  # the live order of the set: each id carries its own given weight
            assert per_id(got_ids, got_weights) == per_id(given_ids, given)


def test_own_weights_replay_is_bit_exact_and_off_is_todays_replay() -> None:
    model = tiny_qwen3()
    ids, mask = batch()
    replayer = routereplay.attach(model)
    with torch.no_grad(), replayer.record(weights=True) as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad(), replayer.replay(rec.routes, mask, weights=rec.weights):
        weighted = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad(), replayer.replay(rec.routes, mask, weights=None, threshold=None):
        off = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad(), replayer.replay(rec.routes, mask):
        plain = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(weighted, natural) and torch.equal(off, plain) and torch.equal(plain, natural)


def test_recorded_weights_are_what_the_experts_received_and_travel_in_traces() -> None:
    model = tiny_model("deepseek_v3")
    ids, mask = batch()
    replayer = routereplay.attach(model)
    with torch.no_grad(), replayer.record(weights=True) as rec, gate_weights_probe(model) as seen:
        natural = model(input_ids=ids, attention_mask=mask).logits
    for column, layer in enumerate(replayer.layers):
        got_ids, got_weights = seen[layer][0]
        assert torch.equal(rec.routes[:, :, column].reshape(got_ids.shape).long(), got_ids)
        assert torch.equal(rec.weights[:, :, column].reshape(got_weights.shape), got_weights.float())
    traces = rec.traces(mask, input_ids=ids)
    assert traces[1].weights is not None and traces[1].weights.shape == (5, len(replayer.layers), 2)
    with torch.no_grad(), replayer.replay(traces, mask, input_ids=ids, weights=True):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, natural)


def test_minus_one_rows_keep_the_live_weights() -> None:
    trainer = tiny_qwen3()
    ids, mask = batch()
    routes, weights = engine_side(perturbed_routers(trainer, noise=0.5, seed=1), ids, mask)
    routes, weights = routes.clone(), weights.clone()
    routes[0, 3], weights[0, 3] = -1, 0.0  # token 3 of row 0 routes live in every layer
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), replayer.record(weights=True) as rec:
        trainer(input_ids=ids, attention_mask=mask)
    live_routes, live_weights = rec.routes, rec.weights
    with replayer.replay(routes, mask, weights=weights, check_alignment=False), gate_weights_probe(trainer) as seen:
        trainer(input_ids=ids, attention_mask=mask)
    got_ids, got_weights = seen[replayer.layers[0]][0]
    row = 3  # (b=0, s=3) in the flattened batch; layer 0 sees the same hidden state as the live run
    assert per_id(got_ids[row : row + 1], got_weights[row : row + 1]) == per_id(
        live_routes[0, 3, 0][None].long(), live_weights[0, 3, 0][None]
    )


def router_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if n.endswith("gate.weight")])


def replayed_loss_grads(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **replay: object
) -> torch.Tensor:
    model.zero_grad(set_to_none=False)
    replayer = routereplay.attach(model)
    try:
        with replayer.replay(attention_mask=mask, check_alignment=False, **replay):  # type: ignore[arg-type]
            model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
    finally:
        replayer.detach()
    return router_grads(model)


def test_frozen_weights_send_no_gradient_to_the_router_and_live_ones_the_plain_replays() -> None:
    model = tiny_qwen3()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids, mask = batch()
    routes, weights = engine_side(model, ids, mask)  # the model's own routes and weights: same forward
    plain = replayed_loss_grads(model, ids, mask, routes=routes)
    live = replayed_loss_grads(model, ids, mask, routes=routes, weights=weights, weights_grad="live")
    frozen = replayed_loss_grads(model, ids, mask, routes=routes, weights=weights, weights_grad="frozen")
    assert plain.abs().sum() > 0
    assert torch.equal(live, plain)
    assert torch.count_nonzero(frozen) == 0
    partial = routes.clone()
    partial[0, 4], weights[0, 4] = -1, 0.0  # one token live: only its rows reach the router
    some = replayed_loss_grads(model, ids, mask, routes=partial, weights=weights, weights_grad="frozen")
    assert torch.count_nonzero(some) > 0


@pytest.mark.parametrize("family", ["phimoe", "jetmoe", "llama4_text"])
def test_families_whose_experts_take_no_weights_are_refused_by_name(family: str) -> None:
    model = tiny_model(family)
    replayer = routereplay.attach(model, strict=False)
    routes = torch.zeros((1, 3, len(replayer.layers), replayer.top_k), dtype=torch.long)
    routes[..., 1] = 1
    with pytest.raises(WeightsUnsupportedError, match="experts"):
        with replayer.replay(routes, weights=torch.full(routes.shape, 0.5)):
            pass
    with pytest.raises(WeightsUnsupportedError, match="recording weights"):
        with replayer.record(weights=True):
            pass


def test_recording_without_weights_says_how_to_get_them() -> None:
    model = tiny_qwen3()
    replayer = routereplay.attach(model)
    with torch.no_grad(), replayer.record() as rec:
        model(input_ids=torch.zeros((1, 3), dtype=torch.long))
    with pytest.raises(routereplay.errors.ReplayStateError, match=r"record\(weights=True\)"):
        _ = rec.weights
