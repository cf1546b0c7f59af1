"""Tiny HF MoE fixtures: every type of the installed release in MOE_MODEL_TYPES builds from its config (no
download), runs a text-only forward to finite (2, 12, vocab) logits and has at least two MoE decoder layers;
every MoE model type of the installed release is listed (in MOE_MODEL_TYPES or EXCLUDED)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from routereplay.errors import ConfigError
from routereplay.testing.hf import models as hf_tiny

INSTALLED = hf_tiny.installed_moe_model_types()
# the modeling-module scan of `routereplay.testing.hf.models`: a class of one of these names marks an MoE module
MOE_CLASS = re.compile(
    r"^class \w*(?:Experts|SparseMoeBlock|MoE\w*|Moe\w*|Router|TopkRouter|TopKRouter|Gate|Gating)\(", re.M
)
CLASS = re.compile(r"^class (\w+)\(", re.M)


@pytest.mark.hf
def test_type_lists_are_sorted_disjoint_and_known() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert list(hf_tiny.MOE_MODEL_TYPES) == sorted(set(hf_tiny.MOE_MODEL_TYPES))
    assert not set(hf_tiny.MOE_MODEL_TYPES) & set(hf_tiny.EXCLUDED)
    assert set(hf_tiny.ADDED_IN) <= set(hf_tiny.MOE_MODEL_TYPES) | set(hf_tiny.EXCLUDED)
    assert set(hf_tiny.BROKEN_IN) <= set(hf_tiny.MOE_MODEL_TYPES)
    unknown = set(INSTALLED) - set(CONFIG_MAPPING_NAMES)
    assert not unknown, f"not model types of this transformers release: {sorted(unknown)}"


def _moe_lm_types() -> dict[str, str]:
    """Model types of the installed release whose causal-LM, image-text-to-text or multimodal-LM class is
    defined in a modeling module with an MoE class (`MOE_CLASS`): type -> that module's package."""
    import transformers
    from transformers.models.auto import modeling_auto

    module_of: dict[str, Path] = {}
    moe_modules: set[Path] = set()
    for path in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        text = path.read_text(encoding="utf-8")
        for name in CLASS.findall(text):
            module_of.setdefault(name, path)
        if MOE_CLASS.search(text):
            moe_modules.add(path)
    found: dict[str, str] = {}
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    ):
        for model_type, names in mapping.items():
            for name in names if isinstance(names, (list, tuple)) else (names,):
                module = module_of.get(name)
                if module is not None and module in moe_modules:
                    found.setdefault(model_type, module.parent.name)
    return found


@pytest.mark.hf
def test_every_moe_model_type_of_the_release_is_listed() -> None:
    found = _moe_lm_types()
    assert {"qwen3_moe", "deepseek_v3", "mixtral"} <= set(found), "the scan finds the MoE families it must"
    listed = set(hf_tiny.MOE_MODEL_TYPES) | set(hf_tiny.EXCLUDED)
    missing = {t: package for t, package in found.items() if t not in listed}
    assert not missing, (
        f"MoE model types of transformers with an LM head that routereplay.testing.hf.models does not list: {missing} "
        "(model type: package of its classes); add each to MOE_MODEL_TYPES (with ADDED_IN) or EXCLUDED with the reason"
    )


def test_release_lists_follow_the_version() -> None:
    older, newer = set(hf_tiny.installed_moe_model_types("5.23.0")), set(hf_tiny.installed_moe_model_types("5.24.0"))
    assert {"sarvam_moe", "sarvam_mla", "lara_mini", "hy_v4_vl", "inkling2_loop"} <= newer - older
    assert "llama4" in older and "llama4" not in newer, "llama4's forward fails in 5.24.0 (BROKEN_IN)"
    assert "llama4" in hf_tiny.installed_exclusions("5.24.0") and "llama4" not in hf_tiny.installed_exclusions("5.23.0")
    assert "hy_v4_vl_text" not in hf_tiny.installed_exclusions("5.23.0")
    assert set(hf_tiny.installed_moe_model_types("5.24.0.dev0")) == newer


@pytest.mark.hf
def test_llama4_is_left_out_only_where_its_forward_fails() -> None:
    """llama4 (BROKEN_IN 5.24.0): its forward still fails on that release (else the exemption goes); on other
    releases it is tested like every other type."""
    if "llama4" not in hf_tiny.installed_exclusions():
        assert "llama4" in INSTALLED
        return
    assert "llama4" not in INSTALLED
    model = hf_tiny.tiny_model("llama4")
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(AttributeError, match="image_outputs"), torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.mark.hf
@pytest.mark.parametrize("model_type", INSTALLED)
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
