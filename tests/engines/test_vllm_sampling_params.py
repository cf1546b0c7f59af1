"""`VLLMEngine.generate` names the params class it takes (issue 22 item 11): vLLM's own `SamplingParams` (or
anything else) is a `ConfigError` naming routereplay's `SamplingParams` and, for vLLM's, its equivalent;
before, it was an `AttributeError` ('SamplingParams' object has no attribute 'max_new_tokens')."""

from __future__ import annotations

import pytest

from routereplay.engines.hf import HFEngine, SamplingParams, checked_params
from routereplay.errors import ConfigError
from tests.engines.colocated_engine import Colocated, prompts


def test_checked_params_takes_routereplays_and_names_it_otherwise() -> None:
    params = SamplingParams(max_new_tokens=4, seed=2)
    assert checked_params(params, "VLLMEngine") is params
    with pytest.raises(ConfigError, match=r"params is a builtins.dict; pass routereplay.engines.hf.SamplingParams\("):
        checked_params({"max_tokens": 4}, "VLLMEngine")


@pytest.mark.hf
def test_the_built_in_engine_names_the_params_class_too() -> None:
    """`HFEngine.generate(prompts, vllm_like_params)` was a bare AttributeError deep inside sampling."""
    from routereplay.testing import tiny_model

    class VLLMLike:  # the fields of vllm.SamplingParams that the hint reads
        max_tokens, temperature, top_p, seed = 8, 0.0, 1.0, 3

    engine = HFEngine(tiny_model("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"HFEngine\.generate: params is a .*VLLMLike.*temperature=1e-05, top_p=1.0"):
        engine.generate([[5, 6, 7]], VLLMLike())  # type: ignore[arg-type]


@pytest.mark.vllm
@pytest.mark.hf
@pytest.mark.xdist_group("vllm-live")
def test_generate_with_vllms_sampling_params_names_the_equivalent(colocated_qwen3: Colocated) -> None:
    import vllm

    given = vllm.SamplingParams(max_tokens=8, temperature=0.0, seed=3)  # greedy
    equivalent = r"SamplingParams\(max_new_tokens=8, temperature=1e-05, top_p=1.0, seed=3, eos_token_id="
    with pytest.raises(ConfigError, match=r"params is a vllm\.sampling_params\.SamplingParams.*" + equivalent):
        colocated_qwen3.engine.generate(prompts(1, [3, 5]), given)  # refused before vLLM is asked anything
