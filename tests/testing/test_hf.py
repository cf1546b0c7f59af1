"""Tiny HF MoE fixtures: every type in MOE_MODEL_TYPES builds from its config (no download), runs a
text-only forward to finite (2, 12, vocab) logits and has at least two MoE decoder layers."""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import ConfigError
from routereplay.testing.hf import models as hf_tiny


@pytest.mark.hf
def test_type_lists_are_sorted_disjoint_and_known() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert list(hf_tiny.MOE_MODEL_TYPES) == sorted(set(hf_tiny.MOE_MODEL_TYPES))
    assert not set(hf_tiny.MOE_MODEL_TYPES) & set(hf_tiny.EXCLUDED)
    unknown = set(hf_tiny.MOE_MODEL_TYPES) - set(CONFIG_MAPPING_NAMES)
    assert not unknown, f"not model types of this transformers release: {sorted(unknown)}"


@pytest.mark.hf
@pytest.mark.parametrize("model_type", hf_tiny.MOE_MODEL_TYPES)
def test_tiny_model_forward(model_type: str) -> None:
    model = hf_tiny.tiny_model(model_type)
    vocab = hf_tiny.text_vocab_size(model)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (2, 12, vocab)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all(), f"{model_type}: non-finite logits from a random-init tiny model"
    moe_layers = hf_tiny.moe_layer_indices(model)
    assert len(moe_layers) >= 2, f"{model_type}: decoder layers with routed experts {moe_layers}, need >= 2"


@pytest.mark.hf
def test_same_seed_same_weights_and_dense_prefix_kept() -> None:
    first, again = hf_tiny.tiny_model("deepseek_v3", seed=3), hf_tiny.tiny_model("deepseek_v3", seed=3)
    other = hf_tiny.tiny_model("deepseek_v3", seed=4)
    pairs = list(
        zip(first.state_dict().values(), again.state_dict().values(), other.state_dict().values(), strict=True)
    )
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)
    assert hf_tiny.moe_layer_indices(first) == [1, 2], "deepseek_v3 keeps one dense layer before its MoE layers"
    cfg = hf_tiny.tiny_config("deepseek_v3")
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 4, 2)


@pytest.mark.hf
def test_type_without_lm_head_is_refused() -> None:
    with pytest.raises(ConfigError, match="openai_privacy_filter.*MOE_MODEL_TYPES"):
        hf_tiny.tiny_model("openai_privacy_filter")  # an MoE token classifier: no causal or conditional LM
