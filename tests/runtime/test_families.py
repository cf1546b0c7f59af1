"""Every supported HF MoE model type, tiny from its config: the replay guarantees, family by family.

For each type: (a) replaying recorded routes reproduces logits bit for bit; (b) random forced routes
are exactly the ids the experts module computes with; (c) router gradients are non-zero and equal
the gradients of natural routing with the same choice (an independent reference: plain torch.topk);
(d) -1 rows route live, so recorded routes with holes still reproduce logits; (e) one batch and two
micro-batches give the same routes and logits (packed == padded: test_policies.py); (f) activation
checkpointing gives the same gradients as a plain step under replay. Layers with two routers (JetMoE's
attention and MLP experts, Ernie-4.5-VL's text and vision routers) have a column per router, and
Ernie-4.5-VL's batches hold vision tokens so both of its routers run. Looped layers (Inkling2-Loop runs
layers 1-2 of its tiny model twice per forward) are refused by name; the other layers are bound
(`strict=False`) and checked like any model's, the looped ones left natural.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from routereplay.errors import UnsupportedRouterError
from routereplay.runtime.discovery import LAYER_PATH
from tests.runtime.models import experts_inputs_by_name

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)
MODEL_TYPES = hf_tiny.installed_moe_model_types()  # MOE_MODEL_TYPES as the installed transformers has them

# model types whose MoE blocks split tokens between routers by modality: the argument naming each token's type
MODALITY_INPUTS = {"ernie4_5_vl_moe": "moe_mm_token_type_ids"}  # vision tokens at positions 3..6 of every row
# model types transformers flags as not checkpointable whose decoder layers are GradientCheckpointingLayers
MANUAL_CHECKPOINTING = {"jetmoe"}  # JetMoePreTrainedModel.supports_gradient_checkpointing = False
# model types whose experts take no id tensor: (b) reads the dispatch from the router's output instead
DISPATCH_FROM_ROUTER = {"jetmoe"}  # JetMoeTopKGating -> (sorted slots, token of each slot, gates, counts, logits)
DENSE_EXPERTS = {"llama4", "llama4_text"}  # experts run densely on score-scaled input: no id tensor to check
# Zaya's router has a skip class (index E): it reaches the experts module as expert 0 with weight 0
SKIP_CLASS_TO_ZERO = {"zaya"}
# model types whose tiny model runs decoder layers more than once per forward: those layers, and the passes
LOOPED = {"inkling2_loop": ((1, 2), 2), "inkling2_loop_text": ((1, 2), 2)}
# model types whose own forward couples the tokens of a batch, so 1 batch != N micro-batches without any replayer
BATCH_COUPLED = {
    # DogeCDMoE views its (B*S, 2 * keys) gate logits as (2, B*S, keys): a token's key halves come from other
    # tokens of the batch (HF keeps it for checkpoint compatibility), so its weights depend on the split
    "doge": "router logits viewed across tokens",
}


def _inputs(model: torch.nn.Module, batch: int = 2, positions: int = 12) -> dict[str, torch.Tensor]:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, positions), generator=torch.Generator().manual_seed(7))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if model.config.model_type in MODALITY_INPUTS:
        types = torch.zeros_like(ids)
        types[:, 3:7] = 1
        inputs[MODALITY_INPUTS[model.config.model_type]] = types
    return inputs


def _attach(model_type: str, **kwargs: object):  # type: ignore[no-untyped-def]
    """The tiny model and its Replayer; a looped model's other layers bound (its looped ones refused)."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type)
    if model_type in LOOPED:
        kwargs.setdefault("strict", False)
    return model, attach(model, **kwargs)


def _runs(replayer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(B, S, L) bool: the router of column l runs for token (b, s) (modality routers: its tokens only)."""
    batch, positions = inputs["input_ids"].shape
    runs = torch.ones(batch, positions, len(replayer.layers), dtype=torch.bool)
    types = next((inputs[name] for name in MODALITY_INPUTS.values() if name in inputs), None)
    vision = torch.zeros(batch, positions, dtype=torch.bool) if types is None else types.bool()
    for index, binding in enumerate(replayer.bindings):
        if binding.modality:
            runs[:, :, index] = vision if binding.modality == "vision" else ~vision
    return runs


def _random_routes(replayer, inputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch, positions = inputs["input_ids"].shape
    generator = torch.Generator().manual_seed(seed)
    choices = min(b.num_experts for b in replayer.bindings)
    keys = torch.rand(batch * positions * len(replayer.layers), choices, generator=generator)
    routes = keys.argsort(dim=1)[:, : replayer.top_k].reshape(batch, positions, len(replayer.layers), replayer.top_k)
    return routes.masked_fill(~_runs(replayer, inputs)[..., None], -1)  # -1 where a column's router does not run


def _dispatched(model: torch.nn.Module, replayer):  # type: ignore[no-untyped-def]
    """Context capturing, per column, the (tokens, K) expert ids each router dispatched (DISPATCH_FROM_ROUTER)."""
    seen: dict[int, torch.Tensor] = {}
    routers = dict(model.named_modules())
    handles = []
    for index, binding in enumerate(replayer.bindings):

        def hook(
            module: torch.nn.Module, args: tuple, output: tuple, index: int = index, k: int = binding.top_k
        ) -> None:
            slots_N, _, _, counts, _ = output
            experts_N = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
            ids = torch.empty_like(slots_N)
            ids[slots_N] = experts_N  # slot p of the sorted dispatch is (token p // K, its k-th expert)
            seen[index] = ids.reshape(-1, k)

        handles.append(routers[binding.name].register_forward_hook(hook))
    return seen, handles


def _layer_of(name: str) -> int:
    return int(LAYER_PATH.findall(name)[-1])


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).logits


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_replay_reproduces_logits_and_reaches_experts(model_type: str) -> None:
    model, replayer = _attach(model_type)
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
    assert used.stats.fallback_rows == int(_runs(replayer, inputs)[:, 2:5].sum())  # routers that run there
    forced = _random_routes(replayer, inputs, seed=11)
    runs = _runs(replayer, inputs)
    if model_type in DISPATCH_FROM_ROUTER:
        dispatched, handles = _dispatched(model, replayer)
        with replayer.replay(forced):
            _logits(model, inputs)
        for handle in handles:
            handle.remove()
        for index in range(len(replayer.layers)):
            got = dispatched[index].sort(dim=-1).values
            assert torch.equal(got, forced[:, :, index].reshape(got.shape).sort(dim=-1).values), f"(b) column {index}"
        return
    with replayer.replay(forced), experts_inputs_by_name(model) as seen:
        _logits(model, inputs)
    if model_type in DENSE_EXPERTS:
        return
    checked = 0
    for index, binding in enumerate(replayer.bindings):
        in_layer = [n for n in seen if _layer_of(n) == binding.layer]
        if not in_layer:
            continue  # this layer's experts take no id tensor
        block = binding.name.rsplit(".", 1)[0] + "."  # the experts of this router sit beside it in its block
        names = [n for n in in_layer if n.startswith(block)] if binding.slot else in_layer
        assert len(names) == 1, f"(b) experts of {binding.name}: {names or in_layer}"
        expected = forced[:, :, index][runs[:, :, index]]  # (tokens the router runs for, K)
        if model_type in SKIP_CLASS_TO_ZERO:
            expected = expected.masked_fill(expected == binding.num_experts - 1, 0)
        got = seen[names[0]][0].reshape(expected.shape).sort(dim=-1).values
        assert torch.equal(got, expected.sort(dim=-1).values), f"(b) column {index} ({binding.name})"
        checked += 1
    assert checked >= 1, "(b) no experts module received ids"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_router_gradients_match_natural_routing(model_type: str) -> None:
    model, replayer = _attach(model_type)
    inputs = _inputs(model)
    with replayer.record() as rec, torch.no_grad():
        _logits(model, inputs)
    replayer.detach()  # the reference runs the untouched model: plain torch.topk selection
    _logits(model, inputs).float().pow(2).mean().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    from routereplay.runtime import attach

    replayer = attach(model, strict=model_type not in LOOPED)
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
    supported = getattr(model, "supports_gradient_checkpointing", False)
    assert supported or model_type in MANUAL_CHECKPOINTING, f"{model_type}: no checkpointing in transformers"
    inputs = _inputs(model)
    forced = _random_routes(replayer, inputs, seed=3)
    grads = []
    for checkpointing in (False, True):
        model.train()
        if checkpointing and model_type in MANUAL_CHECKPOINTING:  # its layers checkpoint; the model flag says no
            model._set_gradient_checkpointing(True, functools.partial(checkpoint, use_reentrant=False))
            assert sum(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules()) >= 2
        elif checkpointing:
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
    forced = _random_routes(replayer, inputs, seed=5)
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
    forced = _random_routes(replayer, inputs, seed=5)
    for part, half in zip((slice(0, 2), slice(2, 4)), halves, strict=True):
        with replayer.replay(forced[part]) as used:
            _logits(model, half)
        used_sets, forced_sets = used.routes.sort(dim=-1).values, forced[part].to(used.routes.dtype).sort(dim=-1).values
        assert torch.equal(used_sets, forced_sets), "(e) micro-batch routes are the forced sets"


@pytest.mark.parametrize("model_type", sorted(LOOPED))
def test_looped_layers_are_refused_by_name_and_stay_natural(model_type: str) -> None:
    """A looped layer's router runs once per pass (a probe on the router module), so it is refused by name;
    with strict=False the other layers replay and the looped routers are left to the model."""
    from routereplay.runtime import attach

    if model_type not in MODEL_TYPES:
        pytest.skip(f"{model_type} is a model type of transformers >= {hf_tiny.ADDED_IN[model_type]}")
    (first, last), passes = LOOPED[model_type]
    model = hf_tiny.tiny_model(model_type)
    with pytest.raises(UnsupportedRouterError, match=f"looped layer: layers {first}-{last} run {passes} times"):
        attach(model)
    replayer = attach(model, strict=False)
    looped = {r.name for r in replayer.refused}
    assert {_layer_of(name) for name in looped} == set(range(first, last + 1))
    assert not set(replayer.layers) & set(range(first, last + 1))
    assert not [r for r in replayer.refused if "MessageGate" in r.family], "a loop's message gate is not a router"
    calls: dict[str, int] = {}
    routers = dict(model.named_modules())
    handles = [
        routers[name].register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        for name in looped
    ]
    inputs = _inputs(model)
    with torch.no_grad():
        natural = _logits(model, inputs)
    assert calls == dict.fromkeys(looped, passes), "each looped router runs once per pass"
    with replayer.record() as rec, torch.no_grad():
        assert torch.equal(_logits(model, inputs), natural), "recording leaves the looped routers untouched"
    with replayer.replay(rec.routes), torch.no_grad():
        assert torch.equal(_logits(model, inputs), natural)
    for handle in handles:
        handle.remove()
