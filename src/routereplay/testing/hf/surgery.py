"""Config surgery for the tiny HF models: a config as constructor arguments, shrunk to a tiny model.

The sizes and key lists live in `routereplay.testing.hf.sizes`; `routereplay.testing.hf.models.tiny_config` calls
`config_kwargs`, then `shrink_text` on the decoder config and `shrink_encoder` on every other sub-config.

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

Linear attention, Mamba and short-conv layers use transformers' PyTorch fallbacks on CPU
(no mamba_ssm, causal_conv1d or flash-linear-attention needed).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from routereplay.testing.hf.sizes import (
    BASE_ARGS,
    DENSE_PREFIX_KEYS,
    ENCODER_SELF_KEYS,
    ENCODER_SIZES,
    ENCODER_TO_TEXT_KEYS,
    EXPERT_KEYS,
    HEAD_DIM,
    HEADS,
    INDEX_LIST_KEYS,
    NUM_EXPERTS,
    SPARSE_KINDS,
    TEXT_OVERRIDES,
    TEXT_SIZES,
    TOP_K,
    TOP_K_KEYS,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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


def config_kwargs(cfg: PretrainedConfig) -> dict[str, Any]:
    """Constructor arguments that rebuild `cfg`; sub-configs become dicts (with their model_type).

    Scalar fields whose declared default is None are passed as None, so `__post_init__` derives
    them again from the shrunk sizes (qk_head_dim, head_dim of MLA, ...).
    """
    from transformers import PretrainedConfig

    out: dict[str, Any] = {}
    for name, p in inspect.signature(type(cfg).__init__).parameters.items():
        if name == "self" or name in BASE_ARGS or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        v = _global_attr(cfg, name)
        if v is _MISSING:
            continue
        if isinstance(v, PretrainedConfig):
            v = {**config_kwargs(v), "model_type": v.model_type}
        elif isinstance(v, tuple):
            v = list(v)
        elif p.default is None and not isinstance(v, (list, dict)):
            v = None
        out[name] = v
    if getattr(cfg, "is_heterogeneous", False):  # passed through **kwargs as {"NN": {...}}
        out["per_layer_config"] = cfg.to_dict()["per_layer_config"]
    return out


def shrink_text(d: dict[str, Any], seed: int) -> dict[str, Any]:
    """Generic shrink of a decoder config (as constructor kwargs, with its model_type)."""
    out, kept = _select_layers(d)
    heads = d.get("num_attention_heads")
    old_head_dim: int | None = d.get("head_dim") or (
        d["hidden_size"] // heads if _is_int(d.get("hidden_size")) and _is_int(heads) and heads else None
    )
    for k, v in TEXT_SIZES.items():
        if _is_int(out.get(k)) and out[k] > 0:
            out[k] = v
    if isinstance(out.get("moe_intermediate_size"), list):  # ernie4_5_vl_moe: (text, vision) experts
        out["moe_intermediate_size"] = [TEXT_SIZES["moe_intermediate_size"]] * len(out["moe_intermediate_size"])
    if "head_dim" in out and out["head_dim"] != 0:  # 0: glm5_next derives it
        tied_to_rope = _is_int(d.get("qk_rope_head_dim")) and d.get("head_dim") == d["qk_rope_head_dim"]
        out["head_dim"] = out["qk_rope_head_dim"] if tied_to_rope else HEAD_DIM
    kv = d.get("num_key_value_heads")
    if _is_int(kv) and _is_int(heads):
        out["num_key_value_heads"] = HEADS if kv == heads else (1 if kv == 1 else 2)
    for k in EXPERT_KEYS:
        if k in out and (out[k] is None or _is_int(out[k])):
            out[k] = NUM_EXPERTS
    for k in TOP_K_KEYS:
        if k in out and (out[k] is None or _is_int(out[k])):
            out[k] = TOP_K
    for k in ("n_group", "num_expert_group"):
        if _is_int(out.get(k)) and out[k] > 1:
            out[k], out["topk_group"] = 4, 2
    for k, v in d.items():
        if ("dropout" in k or "pdrop" in k or k.endswith("layerdrop")) and isinstance(v, float):
            out[k] = 0.0
    vocab = out.get("vocab_size", TEXT_SIZES["vocab_size"])
    for k, fallback in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        token = out.get(k)
        if _is_int(token) and token >= vocab:
            out[k] = fallback
        elif isinstance(token, list):
            out[k] = [x if x < vocab else fallback for x in token]
    if isinstance(out.get("rope_parameters"), dict) and old_head_dim:
        out["rope_parameters"] = _shrink_rope(out["rope_parameters"], (out.get("head_dim") or HEAD_DIM) / old_head_dim)
    if isinstance(d.get("per_layer_config"), dict):
        out["per_layer_config"] = _shrink_per_layer(d, out, kept)
    if _is_int(out.get("seed")):
        out["seed"] = seed
    out.update(TEXT_OVERRIDES.get(d.get("model_type", ""), {}))
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
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 2 and k not in INDEX_LIST_KEYS]
    mlp_keys = [k for k in per_layer if "mlp" in k or k == "layers_block_type"]

    def dense(i: int) -> bool:
        if any(isinstance(d.get(k), int) and i < d[k] for k in DENSE_PREFIX_KEYS):
            return True
        if i in (d.get("mlp_only_layers") or ()):
            return True
        if isinstance(d.get("moe_layers"), list) and i not in d["moe_layers"]:
            return True
        step = d.get("decoder_sparse_step")
        if isinstance(step, int) and step > 1 and (i + 1) % step:
            return True
        return bool(mlp_keys) and not any(d[k][i] in SPARSE_KINDS for k in mlp_keys)

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
            out[k] = [max(1, round(HEADS * v / d["num_attention_heads"])) for v in out[k]]
    if isinstance(d.get("moe_layers"), list):
        out["moe_layers"] = [new[i] for i in kept if not dense(i)]
    if isinstance(d.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [new[i] for i in kept if i in d["mlp_only_layers"]]
    if isinstance(d.get("kv_source_layers"), list):
        out["kv_source_layers"] = [new.get(d["kv_source_layers"][i], new[i]) for i in kept]
    for k in DENSE_PREFIX_KEYS:
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
        rope["max_position_embeddings"] = TEXT_SIZES["max_position_embeddings"]
    return rope


def shrink_encoder(d: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Vision / audio / other encoder sub-config: one small layer, outputs sized for the text model."""
    out = dict(d)
    n = d.get("num_hidden_layers", d.get("depth", -1))
    for k, v in ENCODER_SIZES.items():
        if _is_int(out.get(k)) and out[k] > 0:
            out[k] = v
    for k in ENCODER_TO_TEXT_KEYS:
        if k in out:
            out[k] = text_hidden
    for k in ENCODER_SELF_KEYS:
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
            out[k] = shrink_encoder(v, text_hidden)
        elif isinstance(v, list) and len(v) == n:
            out[k] = out[k][:1]
    if "per_layer_config" in out:
        out["per_layer_config"] = {}
    if _is_int(out.get("vocab_size")):  # nemo_speechlm word-timestamp head
        out["vocab_size"] = 32
        if _is_int(out.get("blank_token_id")):
            out["blank_token_id"] = 31
    return out
