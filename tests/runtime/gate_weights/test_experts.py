"""Weights replay family by family: every HF MoE model type, tiny from its config, either replays its own
recorded combine weights bit for bit (the experts receive exactly them: a probe on the experts module), or
is refused by name for a stated reason."""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import WeightsUnsupportedError
from tests.runtime.models import gate_weights_probe
from tests.runtime.test_families import MODEL_TYPES, _attach, _inputs

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip("routereplay.testing.hf.models", reason="needs transformers")

# model types whose experts do not take the router's weights as an argument, and why (docs/replay.md)
REFUSED = {
    "doge": "product_keys selection combines inside its block",
    "ernie4_5_vl_moe": "a modality router",
    "jetmoe": "a layer with several routers",
    "llama4": "no experts module takes its weights",
    "llama4_text": "no experts module takes its weights",
    "phimoe": "sparsemixer selection combines inside its block",
}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_own_weights_replay_bit_for_bit_or_a_named_refusal(model_type: str) -> None:
    model, replayer = _attach(model_type)  # looped models: the layers outside the loop
    inputs = _inputs(model)
    if model_type in REFUSED:
        with pytest.raises(WeightsUnsupportedError, match=REFUSED[model_type]):
            with replayer.record(weights=True):
                pass
        return
    with torch.no_grad(), replayer.record(weights=True) as rec:
        natural = model(**inputs).logits
    routes, weights = rec.routes, rec.weights
    with torch.no_grad(), replayer.replay(routes, weights=weights), gate_weights_probe(model) as seen:
        replayed = model(**inputs).logits
    assert torch.equal(replayed, natural)
    for column, layer in enumerate(replayer.layers):
        got_ids, got_weights = seen[layer][0]
        assert torch.equal(got_weights.float(), weights[:, :, column].reshape(got_weights.shape))
        assert torch.equal(got_ids, routes[:, :, column].reshape(got_ids.shape).long())
