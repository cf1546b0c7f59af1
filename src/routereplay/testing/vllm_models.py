"""Tiny MoE checkpoints that a real vLLM serves on CPU: built from config, nothing downloaded.

Fixtures for the live vLLM tests, the payload-fixture script (scripts/vllm_fixtures.py) and the
engine benchmarks. Each family starts from `hf_tiny.tiny_config` (the family's own config, shrunk)
and takes the sizes vLLM 0.30's CPU kernels need (`engines/vllm/checkpoint.check_servable`):
- `qwen3_moe`: 3 MoE layers, 16 experts top-2, hidden 128, 2 heads of head_dim 64 (the CPU attention
  backend refuses head_dim 16).
- `qwen3_moe_dense_first`: the same with `mlp_only_layers=[0]`: layer 0 is a dense MLP, layers 1-2
  route; vLLM's payload still has 3 layers, the dense one all zeros.
- `deepseek_v3`: layer 0 dense (`first_k_dense_replace=1`), layers 1-2 with 16 routed experts + 1
  shared, top-2 in n_group 4 / topk_group 2, sigmoid scores with a random (seeded)
  `e_score_correction_bias` so the bias changes choices; MLA with kv_lora_rank 512 and
  qk_rope_head_dim 64 (the only latent size CPU MLA runs; it also forces block size 16 and turns
  prefix caching and chunked prefill off).
The tokenizer is word-level: `<pad>` 0, `<bos>` 1, `<eos>` 2, `<unk>` 3, then `w4` ... `w{V-1}`, split
on whitespace, with a chat template that joins message contents, so `/v1/chat/completions` works
and `text_of(ids)` is the text whose tokens are exactly `ids`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from routereplay.engines.vllm.checkpoint import CheckpointLayout, write_checkpoint
from routereplay.enums import StrEnum
from routereplay.testing.hf.models import tiny_config

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
FIRST_WORD_ID = len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w4 {% endif %}"  # one fixed token marks the assistant turn
)
BIAS_NOISE = 0.5  # std of the random e_score_correction_bias (DeepSeek-V3): large enough to change choices


class TinyFamily(StrEnum):
    QWEN3_MOE = "qwen3_moe"
    QWEN3_MOE_DENSE_FIRST = "qwen3_moe_dense_first"
    DEEPSEEK_V3 = "deepseek_v3"


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}
_FAMILY: dict[TinyFamily, tuple[str, dict[str, Any]]] = {
    TinyFamily.QWEN3_MOE: (
        "qwen3_moe",
        {
            "head_dim": 64,
            "num_local_experts": 16,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    TinyFamily.QWEN3_MOE_DENSE_FIRST: (
        "qwen3_moe",
        {
            "head_dim": 64,
            "num_local_experts": 16,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
    ),
    TinyFamily.DEEPSEEK_V3: (
        "deepseek_v3",
        {
            "first_k_dense_replace": 1,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.0,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "head_dim": 64,
            "rope_interleave": True,
        },
    ),
}


def tiny_vllm_config(family: TinyFamily | str) -> Any:
    """`hf_tiny.tiny_config` of the family's model type with the vLLM-servable sizes above."""
    model_type, sizes = _FAMILY[TinyFamily(family)]
    base = tiny_config(model_type)
    accepted = inspect.signature(type(base).__init__).parameters
    fields = {k: v for k, v in base.to_dict().items() if k in accepted and k not in _NOT_COPIED}  # no derived fields
    config = type(base)(**{**fields, **_COMMON, **sizes})
    config.architectures = [_ARCHITECTURES[model_type]]
    return config


_NOT_COPIED = ("architectures", "transformers_version", "model_type", "self")
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def tiny_vllm_model(family: TinyFamily | str, *, seed: int = 0) -> nn.Module:
    """A randomly initialised (seeded) fp32 model of `family`, in eval mode."""
    import transformers

    config = tiny_vllm_config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros after init: make the bias matter
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * BIAS_NOISE)
    return model.eval()


def word_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A word-level `PreTrainedTokenizerFast`: specials, then one word `w{i}` per id, whitespace split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        unk_token=SPECIAL_TOKENS[UNK_ID],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def text_of(ids: list[int]) -> str:
    """The text that `word_tokenizer` encodes to exactly `ids` (word ids only, no specials)."""
    if any(not FIRST_WORD_ID <= i for i in ids):
        raise ValueError(f"text_of: ids must be word ids (>= {FIRST_WORD_ID}), got {ids}")
    return " ".join(f"w{i}" for i in ids)


def build_checkpoint(
    family: TinyFamily | str, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[nn.Module, CheckpointLayout]:
    """Build the tiny model of `family` and write it (config, tokenizer, `dtype` weights) to `folder`.

    Returns the fp32 model, its weights rounded to `dtype` (so it holds exactly the values vLLM loads:
    the trainer side of a comparison), and the checkpoint's routing layout.
    """
    model = tiny_vllm_model(family, seed=seed)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))
    vocab_size = int(cast(Any, model).config.vocab_size)
    layout = write_checkpoint(model, word_tokenizer(vocab_size), folder, dtype=dtype)
    return model, layout


__all__ = [
    "EOS_ID",
    "FIRST_WORD_ID",
    "TinyFamily",
    "build_checkpoint",
    "text_of",
    "tiny_vllm_config",
    "tiny_vllm_model",
    "word_tokenizer",
]
