"""Tiny Hugging Face MoE models built from config: fixtures for tests, benchmarks and the support table.

Nothing here downloads anything: every model is its family's own config class with its defaults,
shrunk, then built with random weights (`torch.manual_seed(seed)`) by the auto class for that type.
`MOE_MODEL_TYPES` lists every `model_type` of transformers 5.23 whose decoder routes tokens through
a learned router; `EXCLUDED` lists the MoE (or MoE-looking) types that are left out, with the reason.
Each tiny model runs `model(input_ids=ids, attention_mask=ones)` on CPU in milliseconds and returns
logits of shape (batch, seq, text vocab); all of them together build + forward + backward in seconds.

How `MOE_MODEL_TYPES` was found (once, then hard-coded so the list is stable): scan every
`transformers/models/*/modeling_*.py` for classes named `*Experts`, `*SparseMoeBlock`, `*MoE*`,
`*Router`, `*TopkRouter`, `*Gate`; keep the model types of those packages (and composite types whose
default `text_config` is one of them, e.g. kimi_k25 -> deepseek_v3) that have a causal-LM,
image-text-to-text or multimodal-LM head and run a text-only forward.

Generic shrink (every type; a field is touched only where the config has it):
- hidden 64, dense intermediate 64, expert / shared-expert intermediate 32, vocab 128,
  max_position_embeddings 128, 4 heads of head_dim 16 (kv heads: 4 if MHA, 1 if MQA, else 2),
  MLA ranks q 32 / kv 16 with qk_rope 8 + qk_nope 8 and v 16 (head_dim = qk_rope where the family
  ties them), sliding windows 8 (shorter than the 12-token test sequence), zero dropout,
  no multi-token-prediction layers, eager attention.
- 8 routed experts, top-k 2; group-limited routing keeps its shape with n_group 4 / topk_group 2
  (2 experts per group); zero-compute experts (longcat_flash) 4.
- layers: layer 0, then one layer of each distinct (dense?, per-layer list values...) kind, then
  sparse layers until there are >= 2: so a dense prefix stays (first_k_dense_replace 1 with 3 layers),
  hybrid models keep one layer of each attention / mixer kind. Per-layer lists (layer_types,
  mlp_layer_types, layers_block_type, no_rope_layers, ...) are cut consistently; index lists
  (moe_layers, mlp_only_layers, kv_source_layers) and dense-prefix counts are renumbered;
  heterogeneous `per_layer_config` entries are kept for kept layers, sizes scaled like the globals.
- rope: mrope sections rescaled to the new head_dim, yarn-like factor 4 over 32 original positions.
- vision / audio / other encoder sub-configs: hidden 32, 1 layer, 2 heads, projector widths tied to
  the text hidden size (these towers are built but never run by a text-only forward).
- special multimodal token ids keep their defaults (>= vocab), so random input ids never hit them.

Per-family overrides (`_TEXT_OVERRIDES` by text-config model_type, `_OVERRIDES` by model_type):
- dbrx: attn_config.rope_theta / clip_qkv (needed by the attention), ffn_config experts 8 / top-k 2.
- deepseek_ocr2_text: mlp_layer_types [dense, sparse, sparse] (default None breaks the model).
- doge: is_moe=True, 16 experts (product-key routing needs a square count).
- dots1: one shared expert (default None breaks the model).
- dots3_note_text: per_layer_config of the sliding-window MLA layer (own head layout).
- gemma4_text: enable_moe_block=True (the default Gemma 4 config is dense).
- glm5_next_text: index_kpool 2 (index_topk must be a multiple).
- glm4v_moe_text / ernie4_5_vl_moe_text: explicit mrope_section for head_dim 16.
- granitemoehybrid: [mamba, attention, mamba] (the default is all-mamba).
- hunyuan_v1_moe: per-layer moe_topk list [2, 2].
- jamba: 4 layers, attention at 2, experts at 1 and 3.
- jetmoe: 2 kv heads (it has no num_attention_heads).
- lfm2_moe: layer_types [conv, full_attention, conv] (the default None breaks the model).
- nemotron_h (also inside nemotron_h_omni, nemo_speechlm): [mamba, moe, attention, moe].
- nemotron_h_omni: vision video_temporal_patch_size 2 (validated against the top level).
- qwen3_omni_moe_thinker: vision_start_token_id (read by the 3-D position ids, missing otherwise).
- qwen4_exp_text: indexer sizes (None by default), hyper-connection / PLE widths.
- step3p5 (step3p7 text): sliding_window 8 (None by default, needed).
- zaya: top-1 (the only top-k it supports).

Linear attention, Mamba and short-conv layers use transformers' PyTorch fallbacks on CPU
(no mamba_ssm, causal_conv1d or flash-linear-attention needed).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from routereplay.errors import ConfigError

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
    "inkling2",
    "inkling2_text",
    "inkling_text",
    "jamba",
    "jetmoe",
    "kimi_k25",
    "kimi_linear",
    "kolibri1",
    "laguna",
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

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_top_k")
_SPARSE_KINDS = frozenset(("sparse", "moe", "hash_moe"))
_DENSE_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_INDEX_LIST_KEYS = ("moe_layers", "mlp_only_layers", "kv_source_layers")
_LAYER_LIST_NAMES = ("layers", "blocks", "h")
# PretrainedConfig arguments that are not part of a model's architecture
_BASE_ARGS = frozenset(
    (
        "transformers_version",
        "architectures",
        "output_hidden_states",
        "return_dict",
        "dtype",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
    )
)

_NUM_EXPERTS = 8
_TOP_K = 2
_HEADS = 4
_HEAD_DIM = 16
_TEXT_SIZES: Mapping[str, int] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "dense_intermediate_size": 64,
    "prefix_dense_intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "share_expert_dim": 32,
    "moe_hidden_size": 32,
    "num_attention_heads": _HEADS,
    "n_heads": _HEADS,
    "max_position_embeddings": 128,
    "max_seq_len": 128,
    "model_max_length": 128,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "o_groups": 2,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "sliding_window_size": 8,
    "swa_num_attention_heads": _HEADS,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": _HEAD_DIM,
    "rel_extent": 16,
    "kv_channels": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_n_heads": 8,  # granitemoehybrid: n_heads * d_head == expand (2) * hidden
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_dt_rank": 8,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "chunk_size": 16,
    "mamba_chunk_size": 16,
    "router_hidden_size": 16,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "zero_expert_num": 4,
    "num_nextn_predict_layers": 0,
    "num_mtp_layers": 0,
}
_ENCODER_SIZES: Mapping[str, int] = {
    "hidden_size": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "encoder_ffn_dim": 64,
    "mlp_dim": 64,
    "num_hidden_layers": 1,
    "depth": 1,
    "encoder_layers": 1,
    "num_attention_heads": 2,
    "num_heads": 2,
    "encoder_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "projection_intermediate_size": 32,
    "projection_hidden_dim": 64,
    "output_channels": 32,
    "downsample_hidden_size": 16,
    "max_img_size": 64,
}
_ENCODER_TO_TEXT_KEYS = (
    "out_hidden_size",
    "adapter_out_dim",
    "text_hidden_size",
    "output_dim",
    "vision_output_dim",
    "projector_input_dim",
    "projector_output_dim",
)
_ENCODER_SELF_KEYS = ("adapter_in_dim", "adapter_input_size", "audio_hidden_size")
_TOP_TO_TEXT_KEYS = ("projector_hidden_size", "projection_hidden_size", "merged_hidden_size", "out_hidden_size")

# applied to a text config (top level or `text_config`) of that text model_type, after the generic shrink
_TEXT_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "deepseek_ocr2_text": {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
    "doge": {"is_moe": True, "num_experts": 16},
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {
        "per_layer_config": {
            "2": {  # the sliding-window MLA layer
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "q_lora_rank": 32,
                "kv_lora_rank": 32,
                "head_dim": 16,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
            }
        }
    },
    "ernie4_5_vl_moe_text": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}
    },
    "gemma4_text": {"enable_moe_block": True, "moe_intermediate_size": 32},
    "glm4v_moe_text": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 2, 1],
        }
    },
    "glm5_next_text": {"index_kpool": 2},
    "granitemoehybrid": {
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    },
    "hunyuan_v1_moe": {"moe_topk": [_TOP_K, _TOP_K]},
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "jetmoe": {"num_key_value_heads": 2},
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 16,
        "ple_embed_dim": 16,
    },
    "step3p5": {"sliding_window": 8},
    "zaya": {"num_experts_per_tok": 1},
}
# applied to the whole (composite) config of that model_type, dotted paths reach into sub-configs
_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "dbrx": {
        "attn_config.rope_theta": 10000.0,
        "attn_config.clip_qkv": 8.0,
        "ffn_config.moe_num_experts": _NUM_EXPERTS,
        "ffn_config.moe_top_k": _TOP_K,
        "ffn_config.ffn_hidden_size": 32,
    },
    "nemotron_h_omni": {"vision_config.video_temporal_patch_size": 2},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
}


def tiny_config(model_type: str, *, seed: int = 0) -> PretrainedConfig:
    """The config class of `model_type` with its defaults, shrunk (see the module docstring).

    `seed` goes into configs that carry their own seed (qwen4_exp n-gram hashing), so one integer
    fixes the whole fixture. Raises `ValueError` for a type transformers does not know.
    """
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    d = _kwargs(base)
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = _shrink_text(d["text_config"], seed)
        hidden = d["text_config"].get("hidden_size", _TEXT_SIZES["hidden_size"])
        for k, v in d.items():
            if k.endswith("_config") and k != "text_config" and isinstance(v, dict):
                d[k] = _shrink_encoder(v, hidden)
        for k in _TOP_TO_TEXT_KEYS:
            if k in d:
                d[k] = hidden
        if "vision_hidden_size" in d:
            d["vision_hidden_size"] = _ENCODER_SIZES["hidden_size"]
    else:
        d = _shrink_text({**d, "model_type": base.model_type}, seed)
        del d["model_type"]
    for path, value in _OVERRIDES.get(model_type, {}).items():
        *parents, leaf = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        node[leaf] = value
    cfg = type(base)(**d)
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
        f"({EXCLUDED.get(model_type, 'not an MoE decoder')}); pick one of routereplay.hf_tiny.MOE_MODEL_TYPES"
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


# --- config surgery ---------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_MISSING = object()


def _global_attr(cfg: PretrainedConfig, name: str) -> Any:
    """`getattr` that also reads the global value of a per-layer attribute of a heterogeneous config."""
    getter = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    try:
        return getter(name) if getter is not None else getattr(cfg, name)
    except AttributeError:
        return _MISSING


def _kwargs(cfg: PretrainedConfig) -> dict[str, Any]:
    """Constructor arguments that rebuild `cfg`; sub-configs become dicts (with their model_type).

    Scalar fields whose declared default is None are passed as None, so `__post_init__` derives
    them again from the shrunk sizes (qk_head_dim, head_dim of MLA, ...).
    """
    from transformers import PretrainedConfig

    out: dict[str, Any] = {}
    for name, p in inspect.signature(type(cfg).__init__).parameters.items():
        if name == "self" or name in _BASE_ARGS or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        v = _global_attr(cfg, name)
        if v is _MISSING:
            continue
        if isinstance(v, PretrainedConfig):
            v = {**_kwargs(v), "model_type": v.model_type}
        elif isinstance(v, tuple):
            v = list(v)
        elif p.default is None and not isinstance(v, (list, dict)):
            v = None
        out[name] = v
    if getattr(cfg, "is_heterogeneous", False):  # passed through **kwargs as {"NN": {...}}
        out["per_layer_config"] = cfg.to_dict()["per_layer_config"]
    return out


def _shrink_text(d: dict[str, Any], seed: int) -> dict[str, Any]:
    """Generic shrink of a decoder config (as constructor kwargs, with its model_type)."""
    out, kept = _select_layers(d)
    heads = d.get("num_attention_heads")
    old_head_dim: int | None = d.get("head_dim") or (
        d["hidden_size"] // heads if _is_int(d.get("hidden_size")) and _is_int(heads) and heads else None
    )
    for k, v in _TEXT_SIZES.items():
        if _is_int(out.get(k)) and out[k] > 0:
            out[k] = v
    if isinstance(out.get("moe_intermediate_size"), list):  # ernie4_5_vl_moe: (text, vision) experts
        out["moe_intermediate_size"] = [_TEXT_SIZES["moe_intermediate_size"]] * len(out["moe_intermediate_size"])
    if "head_dim" in out and out["head_dim"] != 0:  # 0: glm5_next derives it
        tied_to_rope = _is_int(d.get("qk_rope_head_dim")) and d.get("head_dim") == d["qk_rope_head_dim"]
        out["head_dim"] = out["qk_rope_head_dim"] if tied_to_rope else _HEAD_DIM
    kv = d.get("num_key_value_heads")
    if _is_int(kv) and _is_int(heads):
        out["num_key_value_heads"] = _HEADS if kv == heads else (1 if kv == 1 else 2)
    for k in _EXPERT_KEYS:
        if k in out and (out[k] is None or _is_int(out[k])):
            out[k] = _NUM_EXPERTS
    for k in _TOP_K_KEYS:
        if k in out and (out[k] is None or _is_int(out[k])):
            out[k] = _TOP_K
    for k in ("n_group", "num_expert_group"):
        if _is_int(out.get(k)) and out[k] > 1:
            out[k], out["topk_group"] = 4, 2
    for k, v in d.items():
        if ("dropout" in k or "pdrop" in k or k.endswith("layerdrop")) and isinstance(v, float):
            out[k] = 0.0
    vocab = out.get("vocab_size", _TEXT_SIZES["vocab_size"])
    for k, fallback in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        token = out.get(k)
        if _is_int(token) and token >= vocab:
            out[k] = fallback
        elif isinstance(token, list):
            out[k] = [x if x < vocab else fallback for x in token]
    if isinstance(out.get("rope_parameters"), dict) and old_head_dim:
        out["rope_parameters"] = _shrink_rope(out["rope_parameters"], (out.get("head_dim") or _HEAD_DIM) / old_head_dim)
    if isinstance(d.get("per_layer_config"), dict):
        out["per_layer_config"] = _shrink_per_layer(d, out, kept)
    if _is_int(out.get("seed")):
        out["seed"] = seed
    out.update(_TEXT_OVERRIDES.get(d.get("model_type", ""), {}))
    return out


def _select_layers(d: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Keep layer 0, one layer per distinct kind, and sparse layers until there are >= 2.

    A layer's kind is (dense?, its value in every per-layer list); returns the new kwargs and the
    kept (old) layer indices, in order.
    """
    n_key = next((k for k in ("num_hidden_layers", "n_layers", "num_layers") if _is_int(d.get(k))), None)
    if n_key is not None:
        n = d[n_key]
    elif isinstance(d.get("layers_block_type"), list):  # nemotron_h: the block list is the layer count
        n = len(d["layers_block_type"])
    else:
        return dict(d), []
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 2 and k not in _INDEX_LIST_KEYS]
    mlp_keys = [k for k in per_layer if "mlp" in k or k == "layers_block_type"]

    def dense(i: int) -> bool:
        if any(isinstance(d.get(k), int) and i < d[k] for k in _DENSE_PREFIX_KEYS):
            return True
        if i in (d.get("mlp_only_layers") or ()):
            return True
        if isinstance(d.get("moe_layers"), list) and i not in d["moe_layers"]:
            return True
        step = d.get("decoder_sparse_step")
        if isinstance(step, int) and step > 1 and (i + 1) % step:
            return True
        return bool(mlp_keys) and not any(d[k][i] in _SPARSE_KINDS for k in mlp_keys)

    def kind(i: int) -> tuple[str, ...]:
        return (str(dense(i)), *(str(d[k][i]) for k in per_layer))

    kept = [0]
    for i in range(1, n):
        if kind(i) not in {kind(j) for j in kept}:
            kept.append(i)
    for i in range(n):
        if sum(not dense(j) for j in kept) >= 2:
            break
        if i not in kept and not dense(i):
            kept.append(i)
    kept.sort()
    new = {old: pos for pos, old in enumerate(kept)}
    out = dict(d)
    if n_key is not None:
        out[n_key] = len(kept)
    for k in per_layer:
        out[k] = [d[k][i] for i in kept]
        if "heads" in k and _is_int(d.get("num_attention_heads")):  # laguna num_attention_heads_per_layer
            out[k] = [max(1, round(_HEADS * v / d["num_attention_heads"])) for v in out[k]]
    if isinstance(d.get("moe_layers"), list):
        out["moe_layers"] = [new[i] for i in kept if not dense(i)]
    if isinstance(d.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [new[i] for i in kept if i in d["mlp_only_layers"]]
    if isinstance(d.get("kv_source_layers"), list):
        out["kv_source_layers"] = [new.get(d["kv_source_layers"][i], new[i]) for i in kept]
    for k in _DENSE_PREFIX_KEYS:
        if _is_int(d.get(k)) and d[k] > 0:
            out[k] = sum(1 for i in kept if i < d[k])
    if _is_int(d.get("moe_layer_end_index")):
        out["moe_layer_end_index"] = len(kept) - 1
    return out, kept


def _shrink_per_layer(old: dict[str, Any], new: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    """Per-layer overrides of kept layers, each size scaled by the same factor as its global value."""
    index = {layer: pos for pos, layer in enumerate(kept)}
    out: dict[str, Any] = {}
    for key, entry in old["per_layer_config"].items():
        if int(key) not in index:
            continue
        scaled = {}
        for k, v in entry.items():
            before, after = old.get(k), new.get(k)
            ok = _is_int(v) and _is_int(before) and _is_int(after) and before
            scaled[k] = max(1, round(after * v / before)) if ok else v
        out[str(index[int(key)])] = scaled
    return out


def _shrink_rope(rope: dict[str, Any], head_dim_ratio: float) -> dict[str, Any]:
    """Nested per-layer-type dicts too; mrope sections follow head_dim, yarn-like scaling gets factor 4."""
    rope = {k: (_shrink_rope(v, head_dim_ratio) if isinstance(v, dict) else v) for k, v in rope.items()}
    sections = rope.get("mrope_section")
    if isinstance(sections, list) and sections:
        total = max(len(sections), round(sum(sections) * head_dim_ratio))
        raw = [s * total / sum(sections) for s in sections]
        scaled = [int(r) for r in raw]
        for i in sorted(range(len(raw)), key=lambda i: scaled[i] - raw[i])[: total - sum(scaled)]:
            scaled[i] += 1  # largest remainders first
        rope["mrope_section"] = scaled
    if _is_int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = 32
        if isinstance(rope.get("factor"), (int, float)):
            rope["factor"] = 4.0
    if _is_int(rope.get("max_position_embeddings")):
        rope["max_position_embeddings"] = _TEXT_SIZES["max_position_embeddings"]
    return rope


def _shrink_encoder(d: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Vision / audio / other encoder sub-config: one small layer, outputs sized for the text model."""
    out = dict(d)
    n = d.get("num_hidden_layers", d.get("depth", -1))
    for k, v in _ENCODER_SIZES.items():
        if _is_int(out.get(k)) and out[k] > 0:
            out[k] = v
    for k in _ENCODER_TO_TEXT_KEYS:
        if k in out:
            out[k] = text_hidden
    for k in _ENCODER_SELF_KEYS:
        if k in out:
            out[k] = out["hidden_size"]
    if "deepstack_visual_indexes" in out:
        out["deepstack_visual_indexes"] = []
    if isinstance(out.get("downsample_channels"), list):  # SAM neck (deepseek_ocr2, unlimited_ocr)
        out["downsample_channels"] = [16, 32]
    if isinstance(out.get("hidden_sizes"), list):  # pyramid audio encoders (muse_spark)
        out["hidden_sizes"] = [32] * len(out["hidden_sizes"])
    for k, v in d.items():
        if isinstance(v, dict) and k.endswith("_config"):
            out[k] = _shrink_encoder(v, text_hidden)
        elif isinstance(v, list) and len(v) == n:
            out[k] = out[k][:1]
    if "per_layer_config" in out:
        out["per_layer_config"] = {}
    if _is_int(out.get("vocab_size")):  # nemo_speechlm word-timestamp head
        out["vocab_size"] = 32
        if _is_int(out.get("blank_token_id")):
            out["blank_token_id"] = 31
    return out
