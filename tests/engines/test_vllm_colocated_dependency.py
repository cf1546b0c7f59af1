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
