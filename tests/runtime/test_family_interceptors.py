"""PhiMoE (sparsemixer) and Doge (product keys): forced experts get the weights of the model's own rule.

test_families.py checks the battery every family passes (bit-exact replay, ids reach the experts,
gradients equal natural routing's, -1 rows, micro-batches, checkpointing). Here: what replay computes
for experts the model would NOT have chosen, against references written from the model's code, and
the discovery and jitter handling these two families need.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from routereplay.runtime.discovery import Selection, discover

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)


def _ids(model: nn.Module, batch: int = 2, positions: int = 6) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (batch, positions), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _non_argmax_routes(batch: int, positions: int, layers: int, experts: int) -> torch.Tensor:
    """Two distinct experts per row, spread over all experts (most rows are not the model's choice)."""
    first = torch.arange(batch * positions * layers) % experts
    second = (first + 3) % experts
    return torch.stack([first, second], dim=-1).reshape(batch, positions, layers, 2)


@contextmanager
def _outputs(module: nn.Module) -> Iterator[list[object]]:
    seen: list[object] = []
    handle = module.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


def _sparsemixer_eval_reference(logits_TC: torch.Tensor, forced_TK: torch.Tensor, eps: float) -> torch.Tensor:
    """sparsemixer's eval weights when its two maxes pick `forced_TK`: each threshold is the picked logit."""
    weights = []
    scores = logits_TC
    for column in range(2):
        picked = forced_TK[:, column : column + 1]
        threshold = scores.gather(-1, picked)
        factor = logits_TC.abs().clamp(min=threshold)
        masked = scores.masked_fill((threshold - logits_TC) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(masked, dim=-1).gather(-1, picked))
        scores = torch.scatter(logits_TC, -1, picked, float("-inf"))
    return torch.cat(weights, dim=-1)


def test_sparsemixer_eval_weights_forced_experts_by_its_threshold_rule() -> None:
    """Guards against replay forcing PhiMoE's ids but leaving the weights of the natural pick (or none):
    in eval each max is also the threshold, so a forced expert's weight is the masked softmax around it."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("phimoe")
    replayer = attach(model)
    router = model.model.layers[0].mlp.router
    forced = _non_argmax_routes(2, 6, len(replayer.layers), router.num_experts)
    with replayer.replay(forced, order="engine"), _outputs(router) as seen:
        model(**_ids(model)).logits.float().pow(2).mean().backward()
    logits_TC, weights_TK, experts_TK = seen[0]  # type: ignore[misc]
    forced_TK = forced[:, :, 0].reshape(-1, 2)
    assert torch.equal(experts_TK, forced_TK)
    expected = _sparsemixer_eval_reference(logits_TC.detach(), forced_TK, router.router_jitter_noise)
    assert torch.equal(weights_TK.detach(), expected)
    assert (weights_TK > 0).all(), "a forced expert always passes its own threshold"
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_sparsemixer_training_replays_its_gumbel_picks_bit_exact() -> None:
    """Guards against training-mode replay of PhiMoE differing from the run it recorded: with the same
    seed (Gumbel noise and Heun mask drawn alike), replaying the sampled picks gives the same logits and
    the same gradients (sparsemixer's own estimator) as the recorded training step."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("phimoe").train()
    replayer = attach(model)
    inputs = _ids(model)
    runs = []
    for mode in ("record", "replay"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        context = replayer.record() if mode == "record" else replayer.replay(runs[0][0])
        with context as rec:
            logits = model(**inputs).logits
            logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((rec.routes, logits.detach(), grads))
    (routes, logits, grads), (used, replayed, replayed_grads) = runs
    assert torch.equal(used, routes) and torch.equal(replayed, logits)
    assert grads.keys() == replayed_grads.keys()
    assert all(torch.equal(grads[name], replayed_grads[name]) for name in grads)


def test_sparsemixer_training_forces_the_gumbel_picks() -> None:
    """Guards against the Gumbel sampling of PhiMoE's training mode overriding the forced experts, and
    against replay moving the training threshold off the max logit (the model's training rule)."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("phimoe").train()
    replayer = attach(model)
    router = model.model.layers[0].mlp.router
    inputs = _ids(model)
    with replayer.record() as rec, torch.no_grad():
        model(**inputs)
    forced = rec.routes.flip(-1)  # the same two experts in the other order: the first pick is not the max
    for seed in range(3):
        torch.manual_seed(seed)
        with replayer.replay(forced, order="engine") as used, _outputs(router) as seen, torch.no_grad():
            model(**inputs)
        assert torch.equal(used.routes, forced.to(used.routes.dtype))
        logits_TC, weights_TK, experts_TK = seen[0]  # type: ignore[misc]
        assert torch.equal(experts_TK, forced[:, :, 0].reshape(-1, 2))
        # the training threshold is the max logit: weight 0 exactly where the forced first expert is beyond it
        threshold = logits_TC.max(dim=-1, keepdim=True).values
        first = logits_TC.gather(-1, experts_TK[:, :1])
        beyond = (threshold - first) / first.abs().clamp(min=threshold) > 2 * router.router_jitter_noise
        assert torch.equal(weights_TK[:, :1] == 0, beyond)


def test_jitter_off_keeps_the_sparsemixer_threshold() -> None:
    """Guards against jitter="off" zeroing PhiMoE's `router_jitter_noise`, which is sparsemixer's threshold
    width (not noise), while its real noise, `input_jitter_noise`, is switched off and restored."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("phimoe").train()
    block = model.model.layers[0].mlp
    block.input_jitter_noise = block.router.input_jitter_noise = 0.1
    replayer = attach(model, jitter="off")
    with replayer.record():
        assert block.router.router_jitter_noise == 0.01
        assert block.input_jitter_noise == 0.0 and block.router.input_jitter_noise == 0.0
    assert block.input_jitter_noise == 0.1 and block.router.input_jitter_noise == 0.1


def _doge_reference(block: nn.Module, hidden_BSH: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    """DogeCDMoE's output with given experts: softmax of their summed key logits x[e // N] + y[e % N]."""
    batch, positions, _ = hidden_BSH.shape
    keys = block.num_keys
    logits_2TN = block.router_gate(hidden_BSH).view(2, batch * positions, -1)
    scores_TK = logits_2TN[0].gather(-1, experts_TK // keys) + logits_2TN[1].gather(-1, experts_TK % keys)
    weights_TK = torch.softmax(scores_TK, dim=-1)
    flat = hidden_BSH.view(batch * positions, -1, 1)
    mixed_TK = block.act_fn(torch.matmul(block.down_embed(experts_TK), flat).view(batch * positions, -1)) * weights_TK
    routed = torch.matmul(mixed_TK.unsqueeze(1), block.up_embed(experts_TK)).view(batch, positions, -1)
    shared = block.down_proj(block.act_fn(block.gate_proj(hidden_BSH)) * block.up_proj(hidden_BSH))
    return shared + routed


def test_product_keys_force_expert_ids_with_their_summed_key_logits() -> None:
    """Guards against forcing Doge's grid positions as if they were expert ids (the grid is sorted per
    call), and against weights that are not the softmax of the forced experts' own key logits."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("doge")
    replayer = attach(model)
    block = model.model.layers[0].mlp
    forced = _non_argmax_routes(2, 6, len(replayer.layers), block.num_keys**2)
    inputs: list[torch.Tensor] = []
    handle = block.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach()))
    try:
        with replayer.replay(forced), _outputs(block) as seen:
            model(**_ids(model)).logits.float().pow(2).mean().backward()
    finally:
        handle.remove()
    output_BSH = seen[0][0]  # type: ignore[index]
    expected = _doge_reference(block, inputs[0], forced[:, :, 0].reshape(-1, 2))
    assert torch.allclose(output_BSH, expected, atol=1e-6, rtol=1e-5)
    assert block.router_gate.weight.grad is not None and block.router_gate.weight.grad.abs().sum() > 0


def test_discovery_binds_both_families_by_their_rule() -> None:
    """Guards against Doge being bound as a plain top-k (positions taken for ids) or losing its gate, and
    against PhiMoE binding with a top_k its sparsemixer ignores (it always picks two)."""
    doge = hf_tiny.tiny_model("doge")
    sites, refused = discover(doge)
    assert not refused and {s.selection for s in sites} == {Selection.PRODUCT_KEYS}
    first = sites[0]
    assert first.name.endswith("mlp.router_gate") and first.scope is doge.model.layers[first.layer].mlp
    assert first.num_choices == doge.config.num_experts and first.top_k == doge.config.num_experts_per_tok
    phimoe = hf_tiny.tiny_model("phimoe")
    assert {s.selection for s in discover(phimoe)[0]} == {Selection.SPARSEMIXER}
    for layer in phimoe.model.layers:
        layer.mlp.router.top_k = 3
    sites, refused = discover(phimoe)
    assert not sites and refused and all("sparsemixer always picks 2 experts" in r.reason for r in refused)
