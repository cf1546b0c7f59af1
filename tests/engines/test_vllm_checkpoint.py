"""vLLM checkpoints written from HF models (engines/vllm/checkpoint.py) and the tiny servable models
(routereplay.testing.vllm_models): config fixes, refusals of shapes vLLM's CPU backend cannot run, routing layout.
These need transformers only; tests/engines/test_vllm_live.py serves the same checkpoints for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from routereplay.engines.vllm.checkpoint import check_servable, layout_of, vllm_config_fixes, write_checkpoint
from routereplay.errors import ConfigError, NoRoutersError, UnservableModelError

pytestmark = pytest.mark.hf


def test_deepseek_v3_config_gets_the_routing_fields_vllm_reads(tmp_path: Path) -> None:
    """Silent misroute (issue 12 item 1): HF's DeepSeek-V3 config.json lacks topk_method/scoring_func, and
    vLLM then scores with softmax and no correction bias; the written config names what HF computes."""
    from routereplay.testing.vllm_models import build_checkpoint, tiny_vllm_config

    config = tiny_vllm_config("deepseek_v3")
    assert getattr(config, "topk_method", None) is None, "HF's config has no topk_method: the fix is needed"
    assert vllm_config_fixes(config) == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    model, layout = build_checkpoint("deepseek_v3", tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["topk_method"], written["scoring_func"], written["dtype"]) == ("noaux_tc", "sigmoid", "bfloat16")
    assert (layout.num_layers, layout.moe_layers, layout.dense_layers) == (3, (1, 2), (0,))
    assert (layout.num_experts, layout.top_k) == (16, 2)
    bias = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
    assert bias and all(b.abs().sum() > 0 for b in bias), "a zero bias would not exercise noaux_tc"
    assert vllm_config_fixes(tiny_vllm_config("qwen3_moe")) == {}


def test_written_weights_are_the_models_bf16_values(tmp_path: Path) -> None:
    """Silent misroute (issue 12 item 1): the model returned beside the checkpoint holds exactly the
    bf16 values vLLM loads, so HF-vs-vLLM comparisons use the same weights; files load back in HF."""
    import transformers

    from routereplay.testing.vllm_models import build_checkpoint, word_tokenizer

    model, layout = build_checkpoint("qwen3_moe_dense_first", tmp_path, seed=3)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert layout.moe_layers == (1, 2) and layout.decode_kwargs() == {
        "num_experts": 16,
        "moe_layers": (1, 2),
        "top_k": 2,
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("w5 w6 w999")["input_ids"] == word_tokenizer()("w5 w6 w999")["input_ids"] == [5, 6, 999]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}], add_generation_prompt=True)


def test_head_sizes_the_cpu_backend_refuses_are_named(tmp_path: Path) -> None:
    """Misleading message (issue 12 item 1): head_dim 16 (the demo model's) or an MLA latent other than
    512 + 64 fail inside vLLM at start-up with a kernel message; refused before anything is written."""
    from routereplay.testing.hf import models as hf_tiny
    from routereplay.testing.vllm_models import word_tokenizer

    qwen = hf_tiny.tiny_model("qwen3_moe")  # head_dim 16
    with pytest.raises(UnservableModelError, match=r"head_dim=16.*supports head sizes \[32, 64"):
        write_checkpoint(qwen, word_tokenizer(128), tmp_path / "qwen")
    assert not (tmp_path / "qwen").exists()
    with pytest.raises(UnservableModelError, match="kv_lora_rank=16 and qk_rope_head_dim=8.*kv_lora_rank=512"):
        check_servable(hf_tiny.tiny_config("deepseek_v3"))
    with pytest.raises(ConfigError, match="tokenizer"):
        write_checkpoint(qwen, None, tmp_path / "qwen")


def test_a_dense_model_has_no_routes_to_serve() -> None:
    """Error that is not a RouteReplayError (issue 12 item 1): a dense model gets NoRoutersError."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, head_dim=64
    )
    with pytest.raises(NoRoutersError, match="no bindable MoE router"):
        layout_of(transformers.AutoModelForCausalLM.from_config(config))
