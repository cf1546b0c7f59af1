"""Tiny Hugging Face MoE models built from config: fixtures for tests, benchmarks and the support table.

Nothing here downloads anything: every model is its family's own config class with its defaults,
shrunk, then built with random weights (`torch.manual_seed(seed)`) by the auto class for that type.
`MOE_MODEL_TYPES` lists every `model_type` of transformers 5.24 whose decoder routes tokens through
a learned router; `EXCLUDED` lists the MoE (or MoE-looking) types that are left out, with the reason.
Each tiny model runs `model(input_ids=ids, attention_mask=ones)` on CPU in milliseconds and returns
logits of shape (batch, seq, text vocab); all of them together build + forward + backward in seconds.

Releases. The lists are those of the newest release tested (5.24.0); the fixtures are tested on 5.23.0
too. `ADDED_IN` names the types a release after 5.23.0 brought, and `BROKEN_IN` the types whose own
forward fails in a given release (an upstream bug, with the type that covers their routers meanwhile).
`installed_moe_model_types()` is `MOE_MODEL_TYPES` as the installed release has them: the tests run
those, and `installed_exclusions()` says why the others are left out there.

How `MOE_MODEL_TYPES` was found (once per release, then hard-coded so the list is stable): scan every
`transformers/models/*/modeling_*.py` for classes named `*Experts`, `*SparseMoeBlock`, `*MoE*`,
`*Router`, `*TopkRouter`, `*Gate`; keep the model types whose causal-LM, image-text-to-text or
multimodal-LM class is defined in such a module (also config-only types that reuse another family's
classes, e.g. sarvam_moe -> Glm4MoeForCausalLM), and composite types whose default `text_config` is
one of them (e.g. kimi_k25 -> deepseek_v3), that run a text-only forward. `tests/testing/test_hf.py`
repeats the scan on the installed release, so a new MoE type fails the tests until it is listed.

The shrink itself is `routereplay.testing.hf.surgery` (what it does to every config is described there)
with the sizes and per-family overrides of `routereplay.testing.hf.sizes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from routereplay.errors import ConfigError
from routereplay.testing.hf.sizes import ENCODER_SIZES, OVERRIDES, TEXT_SIZES, TOP_TO_TEXT_KEYS
from routereplay.testing.hf.surgery import config_kwargs, shrink_encoder, shrink_text

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MOE_MODEL_TYPES: tuple[str, ...] = (
    "afmoe",
    "aria",
    "aria_text",
    "axk1",
    "axk2",
    "bailing_hybrid",
    "beam",
    "cohere2_moe",
    "dbrx",
    "deepseek_ocr2",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "doge",
    "dots1",
    "dots3_note",
    "dots3_note_text",
    "ernie4_5_moe",
    "ernie4_5_vl_moe",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "gemma4",
    "gemma4_text",
    "glm4_moe",
    "glm4_moe_lite",
    "glm4v_moe",
    "glm5_next",
    "glm_moe_dsa",
    "gpt_oss",
    "granitemoe",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "hy_v3",
    "hy_v4",
    "hy_v4_vl",
    "inkling2",
    "inkling2_loop",
    "inkling2_loop_text",
    "inkling2_text",
    "inkling_text",
    "jamba",
    "jetmoe",
    "kimi_k25",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "lara_mini",
    "lfm2_moe",
    "llama4",
    "llama4_text",
    "longcat_flash",
    "mellum",
    "mimo_v2_flash",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl",
    "minimax_m3_vl_text",
    "mistral4",
    "mistral_large4",
    "mixtral",
    "muse_spark",
    "nemo_speechlm",
    "nemotron_h",
    "nemotron_h_omni",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_omni_moe_thinker",
    "qwen3_vl_moe",
    "qwen4_exp",
    "qwen4_exp_text",
    "sarvam_mla",
    "sarvam_moe",
    "solar_open",
    "step3p7",
    "unlimited_ocr",
    "zaya",
)

_NO_HEAD = "text sub-config: only a base model (no LM head) is registered for it; its decoder is covered by "
_NO_CLASS = "text sub-config: no model class is registered for it; its decoder is covered by "

EXCLUDED: dict[str, str] = {
    # MoE decoders that cannot honour `model(input_ids, attention_mask) -> logits (B, S, V)`
    "diffusion_gemma": (
        "block-diffusion encoder-decoder: the MoE decoder denoises a fixed canvas (decoder_input_ids, "
        "canvas_length) and its logits cover the canvas, not the input tokens; no causal forward"
    ),
    "inkling_mm_model": "its vision tower imports scipy (not a dependency); the MoE decoder is covered by inkling_text",
    "nllb-moe": (
        "encoder-decoder (top-2 routers with expert capacity): forward needs decoder_input_ids, "
        "no causal or text-only conditional LM"
    ),
    "openai_privacy_filter": "bidirectional encoder for token classification: no decoder, no LM head",
    "qwen3_omni_moe": (
        "thinker + talker + code2wav wrapper with generate() only (no forward); the thinker's MoE decoder "
        "is covered by qwen3_omni_moe_thinker"
    ),
    "qwen3_omni_moe_talker_text": (
        "speech-token decoder of qwen3_omni_moe, fed thinker hidden states (not input_ids); "
        "no model class is registered for it"
    ),
    "switch_transformers": (
        "encoder-decoder (T5, top-1 argmax routers with expert capacity): forward needs decoder_input_ids, "
        "no causal or text-only conditional LM"
    ),
    # text sub-configs of composite models
    "deepseek_ocr2_text": _NO_CLASS + "deepseek_ocr2",
    "diffusion_gemma_text": _NO_CLASS + "nothing (diffusion_gemma is excluded)",
    "ernie4_5_vl_moe_text": _NO_CLASS + "ernie4_5_vl_moe",
    "glm4v_moe_text": _NO_HEAD + "glm4v_moe",
    "glm5_next_text": _NO_HEAD + "glm5_next",
    "hy_v4_vl_text": _NO_HEAD + "hy_v4_vl",
    "mistral_large4_text": _NO_HEAD + "mistral_large4",
    "muse_spark_text": _NO_HEAD + "muse_spark",
    "qwen3_omni_moe_text": _NO_CLASS + "qwen3_omni_moe_thinker",
    "qwen3_vl_moe_text": _NO_HEAD + "qwen3_vl_moe",
    "step3p5": _NO_CLASS + "step3p7",
    "unlimited_ocr_text": _NO_CLASS + "unlimited_ocr",
    # matched by the class-name scan, but not a decoder MoE with a learned router
    "d_fine": "DFineGate is a sigmoid gate fusing residuals in a detection decoder, not an expert router",
    "deimv2": "Deimv2Gate is a sigmoid gate fusing residuals in a detection decoder, not an expert router",
    "granite_docling": "GraniteDoclingDensityRouter picks an image-connector path per sample, not experts per token",
    "vitpose_backbone": "vision backbone whose MoE MLP picks experts by dataset index, not by a learned router",
}

# types (of MOE_MODEL_TYPES or EXCLUDED) that a release after 5.23.0 added: they exist from that release on
ADDED_IN: Mapping[str, str] = {
    "hy_v4_vl": "5.24.0",
    "hy_v4_vl_text": "5.24.0",
    "inkling2_loop": "5.24.0",
    "inkling2_loop_text": "5.24.0",
    "lara_mini": "5.24.0",
    "sarvam_mla": "5.24.0",  # SarvamMLAConfig on DeepSeek-V3's classes
    "sarvam_moe": "5.24.0",  # SarvamMoEConfig on GLM-4-MoE's classes
}
# types whose own forward fails in a release (an upstream bug): {type: {release: why}}; their routers stay
# covered by the type the reason names, and the tests check that the failure is still there
BROKEN_IN: Mapping[str, Mapping[str, str]] = {
    "llama4": {
        "5.24.0": (
            "transformers 5.24.0: Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` from its "
            "text model's MoeCausalLMOutputWithPast (AttributeError on every forward, text-only or with images); "
            "its decoder and Llama4Router are covered by llama4_text"
        )
    },
}

_LAYER_LIST_NAMES = ("layers", "blocks", "h")


def _release(version: str | None) -> str:
    """`version`, or the installed transformers' version without a local or dev suffix ("5.24.0")."""
    if version is None:
        import transformers

        version = transformers.__version__
    from packaging.version import Version

    return Version(version).base_version


def installed_moe_model_types(version: str | None = None) -> tuple[str, ...]:
    """`MOE_MODEL_TYPES` that transformers `version` (default: the installed one) has and can run.

    Left out: types `ADDED_IN` a later release, and types `BROKEN_IN` this one (`installed_exclusions`)."""
    from packaging.version import Version

    release = _release(version)
    return tuple(
        t
        for t in MOE_MODEL_TYPES
        if Version(ADDED_IN.get(t, "0")) <= Version(release) and release not in BROKEN_IN.get(t, {})
    )


def installed_exclusions(version: str | None = None) -> dict[str, str]:
    """Why each MoE-looking type of transformers `version` (default: installed) is left out: `EXCLUDED`, and the
    types `BROKEN_IN` that release; types it does not have yet are not listed."""
    from packaging.version import Version

    release = _release(version)
    out = {t: why for t, why in EXCLUDED.items() if Version(ADDED_IN.get(t, "0")) <= Version(release)}
    for model_type, releases in BROKEN_IN.items():
        if release in releases:
            out[model_type] = releases[release]
    return dict(sorted(out.items()))


def tiny_config(model_type: str, *, seed: int = 0, **fields: Any) -> PretrainedConfig:
    """The config class of `model_type` with its defaults, shrunk (see `routereplay.testing.hf.surgery`).

    `seed` goes into configs that carry their own seed (qwen4_exp n-gram hashing), so one integer
    fixes the whole fixture. `fields` replace top-level config fields after shrinking, before the config
    is built (so that fields derived from them follow), e.g. `num_hidden_layers=2`. Raises `ValueError`
    for a type transformers does not know.
    """
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    d = config_kwargs(base)
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = shrink_text(d["text_config"], seed)
        hidden = d["text_config"].get("hidden_size", TEXT_SIZES["hidden_size"])
        for k, v in d.items():
            if k.endswith("_config") and k != "text_config" and isinstance(v, dict):
                d[k] = shrink_encoder(v, hidden)
        for k in TOP_TO_TEXT_KEYS:
            if k in d:
                d[k] = hidden
        if "vision_hidden_size" in d:
            d["vision_hidden_size"] = ENCODER_SIZES["hidden_size"]
    else:
        d = shrink_text({**d, "model_type": base.model_type}, seed)
        del d["model_type"]
    for path, value in OVERRIDES.get(model_type, {}).items():
        *parents, leaf = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        node[leaf] = value
    cfg = type(base)(**{**d, **fields})
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialised tiny model of `model_type`, in eval mode.

    Composite (vision / audio + text) types are built as their conditional-generation model, the
    others as causal LMs; `model(input_ids=ids, attention_mask=mask).logits` is (B, S, text vocab).
    """
    import transformers
    from transformers.models.auto import modeling_auto

    cfg = tiny_config(model_type, seed=seed)
    causal = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM)
    conditional = [
        (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, transformers.AutoModelForImageTextToText),
        (modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, transformers.AutoModelForMultimodalLM),
    ]
    order = [*conditional, causal] if "text_config" in cfg.sub_configs else [causal, *conditional]
    for mapping, auto_class in order:
        if model_type in mapping:
            torch.manual_seed(seed)
            model: nn.Module = auto_class.from_config(cfg, dtype=dtype)
            return model.eval()
    raise ConfigError(
        f"model_type {model_type!r} has no causal-LM, image-text-to-text or multimodal-LM class "
        f"({EXCLUDED.get(model_type, 'not an MoE decoder')}); pick one of routereplay.testing.hf.models.MOE_MODEL_TYPES"
    )


def text_vocab_size(model: nn.Module) -> int:
    """Vocabulary of the text decoder (the last logits dimension); composite models included."""
    config: PretrainedConfig = cast(Any, model).config
    return int(config.get_text_config().vocab_size)


def moe_layer_indices(model: nn.Module) -> list[int]:
    """Indices of the decoder layers that hold at least one routed-experts block.

    A block is a module with an `experts` child (fused experts, jetmoe attention experts) or a class
    named `*MoE` / `*Moe` (doge's product-key experts); vision / audio towers are not searched.
    """
    decoder: nn.Module = cast(Any, model).get_decoder() if hasattr(model, "get_decoder") else model
    for name, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES:
            return [i for i, layer in enumerate(module) if any(_is_moe_block(m) for m in layer.modules())]
    return []


def _is_moe_block(module: nn.Module) -> bool:
    cls = type(module).__name__
    return cls.endswith(("MoE", "Moe")) or any(name == "experts" for name, _ in module.named_children())
