"""The colocated vLLM engine without vLLM installed: a named error, not a bare ImportError (runs everywhere)."""

from __future__ import annotations

import sys

import pytest

from routereplay.errors import MissingDependencyError

pytestmark = [pytest.mark.hf]


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Error that is not a RouteReplayError (issue 12 item 2): without vLLM, VLLMEngine raises
    MissingDependencyError (an ImportError) naming the extra to install, before writing anything."""
    from routereplay.engines.vllm.colocated import VLLMEngine
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where vLLM is not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'routereplay\[vllm\]'"):
        VLLMEngine(tiny_vllm_model("qwen3_moe"), word_tokenizer())


def test_engine_config_refuses_a_context_longer_than_the_model() -> None:
    """Misleading message (issue 12 item 2): a max_model_len above the model's max_position_embeddings
    (vLLM refuses it deep in its start-up) is a ConfigError naming both numbers; the default is capped."""
    from routereplay.engines.vllm.colocated import DEFAULT_MAX_MODEL_LEN, EngineConfig
    from routereplay.errors import ConfigError
    from routereplay.testing.vllm_models import tiny_vllm_model

    model = tiny_vllm_model("qwen3_moe")  # max_position_embeddings 512
    with pytest.raises(ConfigError, match="max_model_len=1024 exceeds the model's max_position_embeddings=512"):
        EngineConfig(max_model_len=1024).for_model(model)
    assert EngineConfig().for_model(model).max_model_len == min(DEFAULT_MAX_MODEL_LEN, 512)
    model.config.max_position_embeddings = 64  # type: ignore[union-attr]
    assert EngineConfig().for_model(model).max_model_len == 64
    with pytest.raises(ConfigError, match="block_size=0 must be an int >= 1"):
        EngineConfig(block_size=0)


def test_only_the_known_harmless_reload_warnings_are_dropped() -> None:
    """Misleading message (issue 12 item 2): vLLM 0.30 reports the (loaded) expert weights as unloaded and
    the rotary cache as failed on every correct reload; those two are dropped, any other unloaded weight
    is still logged."""
    import logging

    from routereplay.engines.vllm.workarounds import RELOAD_LAYER_FAILED, RELOAD_UNLOADED, quiet_reload_warnings

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("vllm.v1.worker.gpu_model_runner", logging.WARNING, __file__, 1, msg, args, None)

    logger = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    experts = {"model.layers.0.mlp.experts.routed_experts.w13_weight"}
    with quiet_reload_warnings():
        assert not logger.filter(record(RELOAD_UNLOADED, experts))
        assert not logger.filter(record(RELOAD_LAYER_FAILED, "RotaryEmbedding"))
        assert logger.filter(record(RELOAD_UNLOADED, {*experts, "model.layers.0.self_attn.qkv_proj.weight"}))
        assert logger.filter(record(RELOAD_LAYER_FAILED, "QKVParallelLinear"))
    assert logger.filter(record(RELOAD_UNLOADED, experts)), "the filter outlived the block"
