"""Every supported HF MoE model type, tiny from its config: the replay guarantees, family by family.

For each type: (a) replaying recorded routes reproduces logits bit for bit; (b) random forced routes
are exactly the ids the experts module computes with; (c) router gradients are non-zero and equal
the gradients of natural routing with the same choice (an independent reference: plain torch.topk);
(d) -1 rows route live, so recorded routes with holes still reproduce logits; (e) one batch and two
micro-batches give the same routes and logits (packed == padded: test_policies.py); (f) activation
checkpointing gives the same gradients as a plain step under replay. Types the runtime refuses must
be refused with their reason (see EXPECTED_REFUSALS).
"""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import UnsupportedRouterError
from tests.runtime.models import experts_inputs

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip("routereplay.hf_tiny", reason="needs transformers (pip install 'routereplay[hf]')")
MODEL_TYPES = hf_tiny.MOE_MODEL_TYPES

# model type -> substring of the refusal reason
EXPECTED_REFUSALS = {
    "jetmoe": "holds 2 routers",  # attention experts and MLP experts route in the same layer
    "ernie4_5_vl_moe": "holds 2 routers",  # text and vision routers split tokens by modality
}
DENSE_EXPERTS = {"llama4", "llama4_text"}  # experts run densely on score-scaled input: no id tensor to check
# Zaya's router has a skip class (index E): it reaches the experts module as expert 0 with weight 0
SKIP_CLASS_TO_ZERO = {"zaya"}
# model types whose own forward couples the tokens of a batch, so 1 batch != N micro-batches without any replayer
BATCH_COUPLED = {
    # DogeCDMoE views its (B*S, 2 * keys) gate logits as (2, B*S, keys): a token's key halves come from other
    # tokens of the batch (HF keeps it for checkpoint compatibility), so its weights depend on the split
    "doge": "router logits viewed across tokens",
}


def _inputs(model: torch.nn.Module, batch: int = 2, positions: int = 12) -> dict[str, torch.Tensor]:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, positions), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _attach(model_type: str, **kwargs: object):  # type: ignore[no-untyped-def]
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type)
    if model_type in EXPECTED_REFUSALS:
        with pytest.raises(UnsupportedRouterError, match=EXPECTED_REFUSALS[model_type]):
            attach(model)
        return model, None  # refused by design, with its reason: nothing to replay
    return model, attach(model, **kwargs)


def _random_routes(replayer, batch: int, positions: int, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    choices = min(b.num_experts for b in replayer.bindings)
    keys = torch.rand(batch * positions * len(replayer.layers), choices, generator=generator)
    return keys.argsort(dim=1)[:, : replayer.top_k].reshape(batch, positions, len(replayer.layers), replayer.top_k)


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).logits


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_replay_reproduces_logits_and_reaches_experts(model_type: str) -> None:
    model, replayer = _attach(model_type)
    if replayer is None:
        return
    inputs = _inputs(model)
    with replayer.record() as rec:
        natural = _logits(model, inputs)
    assert len(replayer.layers) >= 2
    with replayer.replay(rec.routes):
        assert torch.equal(_logits(model, inputs), natural), "(a) replaying recorded routes must be bit-exact"
    holes = rec.routes.clone()
    holes[:, 2:5] = -1
    with replayer.replay(holes) as used:
        assert torch.equal(_logits(model, inputs), natural), "(d) -1 rows must route exactly like the live router"
    assert used.stats.fallback_rows == 2 * 3 * len(replayer.layers)
    forced = _random_routes(replayer, 2, 12, seed=11)
    with replayer.replay(forced), experts_inputs(model) as seen:
        _logits(model, inputs)
    if model_type in DENSE_EXPERTS:
        return
    checked = 0
    for index, layer in enumerate(replayer.layers):
        if layer not in seen:
            continue
        expected = forced[:, :, index]
        if model_type in SKIP_CLASS_TO_ZERO:
            expected = expected.masked_fill(expected == replayer.bindings[index].num_experts - 1, 0)
        got = seen[layer][0].reshape(2, 12, -1).sort(dim=-1).values
        assert torch.equal(got, expected.sort(dim=-1).values), f"(b) layer {layer}"
        checked += 1
    assert checked >= 1, "(b) no experts module received ids"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_router_gradients_match_natural_routing(model_type: str) -> None:
    model, replayer = _attach(model_type)
    if replayer is None:
        return
    inputs = _inputs(model)
    with replayer.record() as rec, torch.no_grad():
        _logits(model, inputs)
    replayer.detach()  # the reference runs the untouched model: plain torch.topk selection
    _logits(model, inputs).float().pow(2).mean().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    from routereplay.runtime import attach

    replayer = attach(model)
    with replayer.replay(rec.routes):
        _logits(model, inputs).float().pow(2).mean().backward()
    for name, param in model.named_parameters():
        if name in reference:
            assert torch.equal(param.grad, reference[name]), f"(c) {name}"
    gate_grads = [b.name for b in replayer.bindings]
    routers = dict(model.named_modules())
    for name in gate_grads:
        grads = [p.grad for p in routers[name].parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads), f"(c) no gradient reached {name}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpointed_equals_plain_under_replay(model_type: str) -> None:
    model, replayer = _attach(model_type, jitter="off")
    if replayer is None:
        return
    assert getattr(model, "supports_gradient_checkpointing", False), f"{model_type}: no checkpointing in transformers"
    inputs = _inputs(model)
    forced = _random_routes(replayer, 2, 12, seed=3)
    grads = []
    for checkpointing in (False, True):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same draws in both steps: PhiMoE's training sparsemixer samples its Heun mask
        with replayer.replay(forced):
            _logits(model, inputs).float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-5, atol=1e-7), f"(f) {name}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_batch_equals_micro_batches(model_type: str) -> None:
    model, replayer = _attach(model_type)
    if replayer is None:
        return
    inputs = _inputs(model, batch=4, positions=8)
    halves = [{k: v[part] for k, v in inputs.items()} for part in (slice(0, 2), slice(2, 4))]
    if model_type in BATCH_COUPLED:
        _check_batch_coupled(model, replayer, inputs, halves)
        return
    with replayer.record() as whole:
        _logits(model, inputs)
    pieces = []
    for half in halves:
        with replayer.record() as rec:
            _logits(model, half)
        pieces.append(rec.routes)
    assert torch.equal(torch.cat(pieces), whole.routes), "(e) routes of 1 batch == routes of 2 micro-batches"
    forced = _random_routes(replayer, 4, 8, seed=5)
    with replayer.replay(forced):
        reference = _logits(model, inputs)
    for part, half in zip((slice(0, 2), slice(2, 4)), halves, strict=True):
        with replayer.replay(forced[part]):
            assert torch.allclose(_logits(model, half), reference[part], atol=1e-5, rtol=1e-4), "(e) logits"


def _check_batch_coupled(model, replayer, inputs, halves) -> None:  # type: ignore[no-untyped-def]
    """(e) for a model whose own forward mixes the tokens of a batch (BATCH_COUPLED).

    Guards two things: that the exemption is still needed (the untouched routers give other logits for
    1 batch than for 2 micro-batches; once transformers fixes the model, this fails and (e) applies in
    full), and that replay still forces exactly the given routes on each micro-batch."""
    with torch.no_grad():  # no context: the routers run untouched
        whole = _logits(model, inputs)
        parts = torch.cat([_logits(model, half) for half in halves])
    assert not torch.allclose(whole, parts, atol=1e-5, rtol=1e-4), "(e) the model no longer couples a batch's tokens"
    forced = _random_routes(replayer, 4, 8, seed=5)
    for part, half in zip((slice(0, 2), slice(2, 4)), halves, strict=True):
        with replayer.replay(forced[part]) as used:
            _logits(model, half)
        assert torch.equal(used.routes, forced[part].to(used.routes.dtype)), "(e) micro-batch routes are the forced"
