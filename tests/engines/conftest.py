"""Session fixtures for tests that drive a real vLLM (marker `vllm`): one server per tiny model.

A test that asks for `vllm_qwen3` or `vllm_dense_first` gets a running vLLM OpenAI server on
127.0.0.1 (a free port) serving that tiny checkpoint (`routereplay.testing.vllm_models`) with routes on, plus
the checkpoint's routing layout and the HF model holding the same (bf16-rounded) weights. Each server
starts once per test session (60-120 s on two busy cores) and is always stopped at the end, also
when tests fail; a server that does not start fails its tests with the end of its log.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

READY_TIMEOUT = 900.0  # seconds: generous, other work shares the cores


@dataclass(frozen=True, slots=True)
class LiveServer:
    """A running vLLM server and what the tests need to check its routes."""

    url: str
    served_model_name: str
    layout: Any  # routereplay.engines.vllm.checkpoint.CheckpointLayout
    model: Any  # the HF model with the checkpoint's weights (fp32 copies of the bf16 values)
    block_size: int
    log_path: Path


def _serve(family: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from routereplay.engines.vllm.server import ServerConfig, VLLMServer
    from routereplay.testing.vllm_models import build_checkpoint

    folder = tmp_path_factory.mktemp(f"vllm-{family}")
    model, layout = build_checkpoint(family, folder / "checkpoint")
    config = ServerConfig(model=folder / "checkpoint", ready_timeout=READY_TIMEOUT, log_path=folder / "server.log")
    with VLLMServer(config) as server:
        yield LiveServer(server.url, config.served_model_name, layout, model, config.block_size, server.log_path)


@pytest.fixture(scope="session")
def vllm_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """vLLM serving the tiny Qwen3-MoE (every layer routed), prefix caching on, block size 32."""
    yield from _serve("qwen3_moe", tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_dense_first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """vLLM serving the tiny dense-first Qwen3-MoE (layer 0 dense, layers 1-2 routed)."""
    yield from _serve("qwen3_moe_dense_first", tmp_path_factory)


@pytest.fixture(scope="session")
def colocated_qwen3() -> Iterator[Any]:
    """The colocated vLLM engine (`VLLMEngine`, in this process) on the tiny Qwen3-MoE, shared by every module
    that drives it; a `tests.engines.colocated_engine.Colocated`."""
    from tests.engines.colocated_engine import start

    yield from start("qwen3_moe")
