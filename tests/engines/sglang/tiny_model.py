"""The SGLang tests' tiny Qwen3-MoE, as a config only (no weights, nothing downloaded): 3 MoE layers, 8 experts,
top-2, hidden 16, vocabulary 64. `conftest.model_config` saves it and builds SGLang's own `ModelConfig` from it;
tests that only read its fields (the plugin's served geometry) take the `Qwen3MoeConfig` itself."""

from __future__ import annotations

from typing import Any

NUM_LAYERS, NUM_EXPERTS, TOP_K, HIDDEN = 3, 8, 2, 16


def tiny_qwen3_moe_config() -> Any:
    """transformers' `Qwen3MoeConfig` of the tiny model."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        num_hidden_layers=NUM_LAYERS,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=64,
        architectures=["Qwen3MoeForCausalLM"],
    )
