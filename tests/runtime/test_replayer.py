"""Replayer on a tiny Qwen3-MoE: contexts, traces, fallback, recompute, detach, and every misuse error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay import RouteTrace
from routereplay.errors import (
    AlreadyAttachedError,
    BatchShapeError,
    ConfigError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    NoRoutersError,
    ReplayStateError,
    TopKMismatchError,
)
from tests.runtime.models import experts_inputs, random_routes, tiny_qwen3

pytestmark = pytest.mark.hf


@pytest.fixture
def model() -> torch.nn.Module:
    return tiny_qwen3()


def _batch(batch: int = 2, positions: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (batch, positions), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, positions, dtype=torch.long)
    return ids, mask


def test_attach_reports_bindings_and_detach_restores(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    ids, mask = _batch()
    before = model(input_ids=ids, attention_mask=mask).logits
    replayer = attach(model)
    assert replayer.layers == (0, 1, 2)
    assert [b.name for b in replayer.bindings] == [f"model.layers.{i}.mlp.gate" for i in range(3)]
    assert {(b.family, b.top_k, b.num_experts) for b in replayer.bindings} == {("Qwen3MoeTopKRouter", 2, 8)}
    with pytest.raises(AlreadyAttachedError, match="already has a Replayer attached"):
        attach(model)
    replayer.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not model._forward_pre_hooks
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    attach(model).detach()  # attachable again


def test_record_replay_bit_exact_and_forced_routes_reach_experts(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _batch()
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    with replayer.replay(rec.routes):
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(natural, again)
    forced = random_routes(2, 10, 3, 2, 8, seed=5)
    with replayer.replay(forced), experts_inputs(model) as seen:
        model(input_ids=ids, attention_mask=mask)
    for layer in range(3):
        got = seen[layer][0].reshape(2, 10, 2).sort(dim=-1).values
        assert torch.equal(got, forced[:, :, layer].sort(dim=-1).values)
    assert replayer.stats.replayed_rows == 2 * 60 and replayer.stats.fallback_rows == 0


def test_fallback_rows_route_live_and_are_counted(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _batch()
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    routes = rec.routes.clone()
    routes[0, 3:6] = -1  # three tokens unrouted in every layer: the live router decides
    with replayer.replay(routes) as used:
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(natural, again)
    assert used.stats.fallback_rows == 9 and used.stats.fallback_rows_by_layer == {0: 3, 1: 3, 2: 3}


def test_traces_with_left_and_right_padding(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, _ = _batch()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    traces = rec.traces(mask)
    assert [t.num_tokens for t in traces] == [6, 7]
    assert torch.equal(torch.from_numpy(traces[0].experts.astype(np.int64)), rec.routes[0, 4:].long())
    with replayer.replay(traces, attention_mask=mask) as used:
        again = model(input_ids=ids, attention_mask=mask).logits
    attended = mask.bool()
    assert torch.equal(natural[attended], again[attended])
    assert used.stats.fallback_rows == 0  # padding positions route live but are not counted as fallbacks


def test_gradients_reach_the_gate_and_match_natural(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    ids, mask = _batch()
    model.train()
    natural = model(input_ids=ids, attention_mask=mask).logits
    natural.float().pow(2).mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    replayer = attach(model)
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    with replayer.replay(rec.routes):
        model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    for (name, param), expected in zip(model.named_parameters(), reference, strict=True):
        assert torch.equal(param.grad, expected), name
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_equals_plain_under_replay(reentrant: bool) -> None:
    from routereplay.runtime import attach

    ids, mask = _batch()
    forced = random_routes(2, 10, 3, 2, 8, seed=3)
    grads = []
    for checkpointing in (False, True):
        model = tiny_qwen3().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        replayer = attach(model)
        with replayer.replay(forced) as used:
            model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        if checkpointing:
            assert used.stats.recompute_calls == 3, "every layer's router recomputes once"
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        assert torch.allclose(plain, checkpointed, atol=0, rtol=0)


def test_record_recompute_reuses_the_recorded_choice() -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    replayer = attach(model)
    ids, mask = _batch()
    with replayer.record() as rec:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert replayer.stats.recompute_calls == 3
    assert replayer.stats.recorded_rows == 60, "recompute calls must not record twice"
    assert rec.routes.shape == (2, 10, 3, 2)


def test_backward_after_replay_context_closed_raises() -> None:
    from routereplay.runtime import attach

    for reentrant in (False, True):
        model = tiny_qwen3().train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        replayer = attach(model)
        ids, mask = _batch()
        with replayer.replay(random_routes(2, 10, 3, 2, 8)):
            loss = model(input_ids=ids, attention_mask=mask).logits.sum()
        with pytest.raises(ReplayStateError, match="after its replay context closed"):
            loss.backward()


def test_incremental_decoding_with_kv_cache(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _batch(2, 6)
    with replayer.record() as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 10)
    routes = rec.routes  # prefill 6 + 3 fed-back tokens (the last sampled token is never fed)
    assert routes.shape == (2, 9, 3, 2) and len(rec.steps) == 4
    full_mask = torch.ones_like(out)
    with replayer.record() as whole:
        model(input_ids=out[:, :9], attention_mask=full_mask[:, :9])
    assert torch.equal(routes.sort(-1).values, whole.routes.sort(-1).values)
    traces = rec.traces(full_mask)
    assert [t.num_tokens for t in traces] == [9, 9]


def test_shape_and_value_errors(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _batch()
    with pytest.raises(LayerCountError, match="routes have 2 layers, the model has 3 bound routers"):
        replayer.replay(random_routes(2, 10, 2, 2, 8)).__enter__()
    with pytest.raises(TopKMismatchError, match="routes have top-k 3, the model's routers use top-k 2"):
        replayer.replay(random_routes(2, 10, 3, 3, 8)).__enter__()
    with pytest.raises(
        BatchShapeError, match=r"routes are for a batch of \(B, S\) = \(2, 9\) but the model is called with \(2, 10\)"
    ):
        with replayer.replay(random_routes(2, 9, 3, 2, 8)):
            model(input_ids=ids, attention_mask=mask)
    with pytest.raises(BatchShapeError, match=r"\(B, S\) = \(3, 10\) but the model is called with \(2, 10\)"):
        with replayer.replay(random_routes(3, 10, 3, 2, 8)):
            model(input_ids=ids, attention_mask=mask)
    bad = random_routes(2, 10, 3, 2, 8)
    bad[1, 2, 0, 1] = 8
    with pytest.raises(ExpertIdRangeError, match="expert id 8 is outside"):
        replayer.replay(bad).__enter__()
    bad[1, 2, 0] = torch.tensor([4, 4])
    with pytest.raises(DuplicateExpertError, match="names an expert twice"):
        replayer.replay(bad).__enter__()
    with pytest.raises(ConfigError, match="needs the batch's attention_mask"):
        replayer.replay([RouteTrace(np.zeros((1, 3, 2), dtype=np.int16) - 1, 8)]).__enter__()
    with pytest.raises(LayerCountError, match=r"missing \[2\]"):
        traces = [RouteTrace(random_routes(1, 5, 2, 2, 8)[0].numpy(), 8, layers=(0, 1))] * 2
        replayer.replay(traces, attention_mask=mask).__enter__()
    assert replayer.mode == "off"


def test_contexts_do_not_nest(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    replayer = attach(model)
    with replayer.record(), pytest.raises(ReplayStateError, match="contexts do not nest"):
        with replayer.replay(random_routes(2, 10, 3, 2, 8)):
            pass
    with pytest.raises(ReplayStateError, match="nothing was recorded"):
        with replayer.record() as rec:
            pass
        rec.routes  # noqa: B018


def test_model_without_routers_is_refused() -> None:
    import transformers

    from routereplay.runtime import attach

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(NoRoutersError, match="has no top-k router module"):
        attach(transformers.AutoModelForCausalLM.from_config(config))


def test_aux_loss_policy_is_explicit(model: torch.nn.Module) -> None:
    from routereplay.runtime import attach

    with pytest.raises(ConfigError, match="only 'natural' is supported"):
        attach(model, aux_loss_routing="replayed")
    assert attach(model).aux_loss_routing == "natural"


def test_deepcopy_of_an_attached_model_is_independent() -> None:
    """A reference model or an engine copy made after attach must run its OWN weights, unattached."""
    import copy

    from routereplay.runtime import attach

    model = tiny_qwen3()
    replayer = attach(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.mul_(0.5)  # the copy's weights now differ
    ids, mask = _batch()
    plain = tiny_qwen3()
    with torch.no_grad():
        for parameter in plain.parameters():
            parameter.mul_(0.5)
    assert torch.equal(
        clone(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
    )
    with replayer.replay(random_routes(2, 10, 3, 2, 8)):  # the original's context does not touch the copy
        assert torch.equal(
            clone(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
        )
    attach(clone).detach()  # the copy can be attached on its own


def test_meta_device_inputs_are_refused_by_name(model: torch.nn.Module) -> None:
    """Error that is not a RouteReplayError (issue 11 item 15): routes on the `meta` device raised a raw
    NotImplementedError ("Cannot copy out of meta tensor") from inside the checks."""
    from routereplay.runtime import attach

    replayer = attach(model)
    routes = random_routes(2, 10, 3, 2, 8)
    with pytest.raises(ConfigError, match=r"routes is on the 'meta' device .* holds no values"):
        replayer.replay(routes.to("meta")).__enter__()
    ids, mask = _batch()
    with pytest.raises(ConfigError, match=r"attention_mask is on the 'meta' device"):
        replayer.replay(routes, attention_mask=mask.to("meta")).__enter__()
    traces = [RouteTrace(routes[b].numpy(), 8, token_ids=ids[b]) for b in range(2)]
    with pytest.raises(ConfigError, match=r"input_ids is on the 'meta' device"):
        replayer.replay(traces, attention_mask=mask, input_ids=ids.to("meta")).__enter__()
    assert replayer.mode == "off"
