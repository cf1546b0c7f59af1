"""The colocated vLLM engine without vLLM installed: a named error, not a bare ImportError (runs everywhere)."""

from __future__ import annotations

import sys

import pytest

from routereplay.errors import MissingDependencyError

pytestmark = [pytest.mark.hf]


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Error that is not a RouteReplayError (issue 12 item 2): without vLLM, VLLMEngine raises
    MissingDependencyError (an ImportError) naming the extra to install, before writing anything."""
    from routereplay.engines.vllm_colocated import VLLMEngine
    from routereplay.vllm_tiny import tiny_vllm_model, word_tokenizer

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where vLLM is not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'routereplay\[vllm\]'"):
        VLLMEngine(tiny_vllm_model("qwen3_moe"), word_tokenizer())


def test_engine_config_refuses_a_context_longer_than_the_model() -> None:
    """Misleading message (issue 12 item 2): a max_model_len above the model's max_position_embeddings
    (vLLM refuses it deep in its start-up) is a ConfigError naming both numbers; the default is capped."""
    from routereplay.engines.vllm_colocated import DEFAULT_MAX_MODEL_LEN, EngineConfig
    from routereplay.errors import ConfigError
    from routereplay.vllm_tiny import tiny_vllm_model

    model = tiny_vllm_model("qwen3_moe")  # max_position_embeddings 512
    with pytest.raises(ConfigError, match="max_model_len=1024 exceeds the model's max_position_embeddings=512"):
        EngineConfig(max_model_len=1024).for_model(model)
    assert EngineConfig().for_model(model).max_model_len == min(DEFAULT_MAX_MODEL_LEN, 512)
    model.config.max_position_embeddings = 64  # type: ignore[union-attr]
    assert EngineConfig().for_model(model).max_model_len == 64
    with pytest.raises(ConfigError, match="block_size=0 must be an int >= 1"):
        EngineConfig(block_size=0)
