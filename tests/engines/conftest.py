"""Session fixtures for tests that drive a real vLLM (marker `vllm`): one server per tiny model.

A test that asks for `vllm_qwen3` or `vllm_dense_first` gets a running vLLM OpenAI server on
127.0.0.1 (a free port) serving that tiny checkpoint (`routereplay.testing.vllm_models`) with routes on, plus
the checkpoint's routing layout and the HF model holding the same (bf16-rounded) weights. Each server
starts once per test session (60-120 s on two busy cores) and is always stopped at the end, also
when tests fail; a server that does not start fails its tests with the end of its log.

A server that dies mid-session (issue 30 item 0: a worker killed by SIGILL) is named with its cause: the
test it died under gets a "vLLM server ... died" section in its report (`pytest_runtest_makereport`), and
every later test that asks for it errors at set-up with `ServerDiedError` (which process, exit code or
signal, the log's last lines) instead of failing on `Connection refused`.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
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
    process: Any = None  # the routereplay.engines.vllm.server.VLLMServer, for its diagnosis

    def failure(self) -> str | None:
        """Why the server no longer serves (which process died, how, its log's end), or None while it does."""
        return None if self.process is None else self.process.failure()

    def check(self) -> LiveServer:
        """This server, or `ServerDiedError` naming why it no longer serves."""
        if self.process is not None:
            self.process.check()
        return self


LIVE_FIXTURES = ("vllm_qwen3", "vllm_dense_first")
DIED_GRACE = 10.0  # seconds a failed live test waits for its server's death to show in the server's log


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """A failed test that used a live server which has died gets a section saying which process died and why."""
    report = yield
    if report.when == "call" and report.failed:
        funcargs = getattr(item, "funcargs", {})
        for name in LIVE_FIXTURES:
            server = funcargs.get(name)
            reason = _failure_within(server, DIED_GRACE) if isinstance(server, LiveServer) else None
            if reason is not None:
                report.sections.append((f"vLLM server {name} died", reason))
    return report


def _failure_within(server: LiveServer, seconds: float) -> str | None:
    """The server's failure, waiting up to `seconds` for it to show (vLLM logs a death as it shuts down)."""
    deadline = time.monotonic() + seconds
    while (reason := server.failure()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    return reason


def _serve(
    family: str, tmp_path_factory: pytest.TempPathFactory, environment: dict[str, str] | None = None
) -> Iterator[LiveServer]:
    from routereplay.engines.vllm.server import ServerConfig, VLLMServer
    from routereplay.testing.vllm_models import build_checkpoint

    folder = tmp_path_factory.mktemp(f"vllm-{family}")
    model, layout = build_checkpoint(family, folder / "checkpoint")
    config = ServerConfig(
        model=folder / "checkpoint",
        ready_timeout=READY_TIMEOUT,
        log_path=folder / "server.log",
        environment=dict(environment or {}),
    )
    with VLLMServer(config) as server:
        yield LiveServer(
            server.url, config.served_model_name, layout, model, config.block_size, server.log_path, server
        )


@pytest.fixture(scope="session")
def vllm_server_environment() -> dict[str, str]:
    """Variables added to the live servers' environment: none (a session that forces vLLM's paths overrides it)."""
    return {}


@pytest.fixture(scope="session")
def vllm_qwen3_session(
    tmp_path_factory: pytest.TempPathFactory, vllm_server_environment: dict[str, str]
) -> Iterator[LiveServer]:
    yield from _serve("qwen3_moe", tmp_path_factory, vllm_server_environment)


@pytest.fixture(scope="session")
def vllm_dense_first_session(
    tmp_path_factory: pytest.TempPathFactory, vllm_server_environment: dict[str, str]
) -> Iterator[LiveServer]:
    yield from _serve("qwen3_moe_dense_first", tmp_path_factory, vllm_server_environment)


@pytest.fixture
def vllm_qwen3(vllm_qwen3_session: LiveServer) -> LiveServer:
    """vLLM serving the tiny Qwen3-MoE (every layer routed), prefix caching on, block size 32 (one per session;
    `ServerDiedError` at set-up once it has died)."""
    return vllm_qwen3_session.check()


@pytest.fixture
def vllm_dense_first(vllm_dense_first_session: LiveServer) -> LiveServer:
    """vLLM serving the tiny dense-first Qwen3-MoE (layer 0 dense, layers 1-2 routed; one per session)."""
    return vllm_dense_first_session.check()


@pytest.fixture(scope="session")
def colocated_qwen3() -> Iterator[Any]:
    """The colocated vLLM engine (`VLLMEngine`, in this process) on the tiny Qwen3-MoE, shared by every module
    that drives it; a `tests.engines.colocated_engine.Colocated`."""
    from tests.engines.colocated_engine import start

    yield from start("qwen3_moe")
