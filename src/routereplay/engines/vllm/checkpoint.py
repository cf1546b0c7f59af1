"""Write a Hugging Face MoE model as a checkpoint folder that vLLM serves with the same routing.

`write_checkpoint(model, tokenizer, folder)` saves config.json, the tokenizer files and the weights
(safetensors, in `dtype`) into `folder`, after two things vLLM needs and HF does not write:
- DeepSeek-V3-style configs: transformers' `DeepseekV3Config` has no `topk_method` / `scoring_func`
  (its router is always sigmoid + `e_score_correction_bias` + group-limited top-k), but vLLM's
  deepseek_v2.py reads them and, when absent, scores with softmax and builds no correction bias (the
  checkpoint then fails to load with a KeyError). `vllm_config_fixes` writes `"noaux_tc"` and
  `"sigmoid"`, which is what the HF model computes.
- `check_servable` refuses, with `UnservableModelError`, a config vLLM's CPU backend cannot run:
  attention head sizes other than `CPU_HEAD_SIZES`, and MLA latent sizes other than
  kv_lora_rank 512 + qk_rope_head_dim 64 (`CPU_MLA_LATENT`). Checked before anything is written.
The returned `CheckpointLayout` holds what decoding vLLM's routes needs: the payload's layer axis is
every hidden layer (dense layers zero-filled), so `decode_kwargs()` passes the model's own MoE layer
numbers (`moe_layers`), its expert count and top-k to `decode_vllm` / `VLLMClient`.

Layouts come from the model's routers (`runtime.discovery`), never from guessed config fields, so
the same numbers drive `routereplay.attach(model)` on the trainer side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from routereplay.errors import ConfigError, NoRoutersError, UnservableModelError

# attention head sizes vLLM 0.30's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# CPU MLA runs only the DeepSeek latent layout: kv_lora_rank 512 + qk_rope_head_dim 64 = 576
CPU_MLA_KV_LORA_RANK = 512
CPU_MLA_ROPE_DIM = 64
CPU_MLA_LATENT = CPU_MLA_KV_LORA_RANK + CPU_MLA_ROPE_DIM
# model types whose HF config lacks the routing fields vLLM reads: the values HF's router computes
ROUTING_FIELDS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
}
CONFIG_FILE = "config.json"


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """What a vLLM checkpoint's routes look like: every hidden layer on the wire, MoE layers routed."""

    path: Path
    model_type: str
    architecture: str
    num_layers: int  # hidden layers = the layer axis of vLLM's routed_experts payload
    moe_layers: tuple[int, ...]  # global numbers of the layers with a router
    num_experts: int
    top_k: int
    vocab_size: int

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Hidden layers without a router: vLLM fills their payload rows with zeros."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def decode_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `decode_vllm` / `VLLMClient` for this checkpoint's payloads."""
        return {"num_experts": self.num_experts, "moe_layers": self.moe_layers, "top_k": self.top_k}

    def to_json(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "vocab_size": self.vocab_size,
        }


def vllm_config_fixes(config: Any) -> dict[str, Any]:
    """Config fields vLLM needs that the HF config lacks (only those not already set)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    wanted = ROUTING_FIELDS.get(str(getattr(text, "model_type", "")), {})
    return {k: v for k, v in wanted.items() if getattr(text, k, None) is None}


def check_servable(config: Any, *, where: str = "model") -> None:
    """Raise `UnservableModelError` for attention shapes vLLM's CPU backend refuses at start-up."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    if kv_lora_rank is not None:  # MLA (DeepSeek-V2/V3 family)
        rope = getattr(text, "qk_rope_head_dim", None)
        if kv_lora_rank != CPU_MLA_KV_LORA_RANK or rope != CPU_MLA_ROPE_DIM:
            raise UnservableModelError(
                f"{where}: MLA with kv_lora_rank={kv_lora_rank} and qk_rope_head_dim={rope} (latent "
                f"{kv_lora_rank + (rope or 0)}); vLLM's CPU MLA runs only kv_lora_rank={CPU_MLA_KV_LORA_RANK} "
                f"with qk_rope_head_dim={CPU_MLA_ROPE_DIM} (latent {CPU_MLA_LATENT}); build the model with those"
            )
        return
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if head_dim not in CPU_HEAD_SIZES:
        raise UnservableModelError(
            f"{where}: attention head_dim={head_dim}; vLLM's CPU attention supports head sizes "
            f"{list(CPU_HEAD_SIZES)} (it fails at start-up with 'Unsupported CPU attention configuration'); "
            "set config.head_dim to one of them (64 is the smallest that the MoE families use)"
        )


def layout_of(model: nn.Module, folder: str | Path = "") -> CheckpointLayout:
    """The routing layout of an HF MoE model, from its routers (global layer numbers)."""
    from routereplay.runtime.discovery import discover

    config: Any = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"{type(model).__name__} has no .config; pass a transformers model")
    text = config.get_text_config()
    sites, refused = discover(model)
    if not sites:
        reasons = "; ".join(f"{r.name}: {r.reason}" for r in refused) or "no router modules"
        raise NoRoutersError(f"{type(model).__name__} has no bindable MoE router ({reasons}); vLLM routes need one")
    tops = {s.top_k for s in sites}
    choices = {s.num_choices for s in sites}
    if len(tops) != 1 or len(choices) != 1:
        raise UnservableModelError(
            f"{type(model).__name__}: layers route with different top-k {sorted(tops)} or expert counts "
            f"{sorted(choices)}; vLLM's routed_experts payload has one (L, K) shape for every layer"
        )
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    return CheckpointLayout(
        path=Path(folder),
        model_type=str(text.model_type),
        architecture=str(architectures[0]),
        num_layers=int(text.num_hidden_layers),
        moe_layers=tuple(sorted(s.layer for s in sites)),
        num_experts=choices.pop(),
        top_k=tops.pop(),
        vocab_size=int(text.vocab_size),
    )


def write_checkpoint(
    model: nn.Module, tokenizer: Any, folder: str | Path, *, dtype: torch.dtype = torch.bfloat16
) -> CheckpointLayout:
    """Save `model` (weights in `dtype`), its config with `vllm_config_fixes` and `tokenizer` to `folder`.

    The model itself is not modified (the weights are cast on a copy of the state dict). Refuses what
    vLLM's CPU backend cannot serve (`UnservableModelError`) before writing anything.
    """
    config: Any = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained"):
        raise ConfigError(f"{type(model).__name__} is not a transformers PreTrainedModel (no config/save_pretrained)")
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise ConfigError("write_checkpoint needs the model's tokenizer (vLLM loads it from the checkpoint folder)")
    check_servable(config, where=type(model).__name__)
    folder = Path(folder)
    layout = layout_of(model, folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(dtype) for name, tensor in model.state_dict().items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)
    path = folder / CONFIG_FILE
    written = json.loads(path.read_text())
    fixes = vllm_config_fixes(config)
    target = written.get("text_config", written) if "text_config" in written else written
    target.update(fixes)
    written["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return layout


__all__ = [
    "CPU_HEAD_SIZES",
    "CPU_MLA_LATENT",
    "CheckpointLayout",
    "check_servable",
    "layout_of",
    "vllm_config_fixes",
    "write_checkpoint",
]
