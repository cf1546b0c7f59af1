"""A live vLLM server that dies mid-suite is named with its cause (issue 30 item 0), with a real death.

On the AMX Xeon the session's `vllm serve` worker died of SIGILL on a 3-token prompt and 5 later tests
failed on `Connection refused`. Here the same death is real on this suite's CPU (AMD EPYC, no AMX): the
server's processes get vLLM's AMX probe forced (a `sitecustomize` on their PYTHONPATH: vLLM has no switch
of its own for it), and the routereplay plugin is left out (`VLLM_PLUGINS`, vLLM's own switch), so nothing
guards them. vLLM then picks its AMX attention kernel and its worker executes a tile instruction on a CPU
without AMX: the CPU raises SIGILL, exactly what a tile instruction without the tile permission does on the
Xeon. A small inner pytest session drives it through `tests/engines/conftest.py`'s own fixtures and hook:
the test the server dies under reports which process died and how, the next one errors at set-up with
`ServerDiedError` instead of `Connection refused`.
The same server with the plugin in place refuses to start, by name (`AmxPermissionError`): Linux refuses
this CPU the tile permission for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from routereplay.engines.vllm.server import deaths, exit_description

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

REPO = Path(__file__).resolve().parents[2]
FORCE_AMX_PROBE = "import torch.cpu\ntorch.cpu._is_amx_tile_supported = lambda: True\n"
INNER_CONFTEST = """
import json, os
import pytest
from tests.engines.conftest import pytest_runtest_makereport, vllm_qwen3, vllm_qwen3_session  # noqa: F401


@pytest.fixture(scope="session")
def vllm_server_environment():
    return json.loads(os.environ["INNER_SERVER_ENVIRONMENT"])
"""
INNER_TESTS = """
import httpx


def _complete(server, prompt):
    body = {"model": server.served_model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=300.0)


def test_a_three_token_prompt(vllm_qwen3):
    assert _complete(vllm_qwen3, [5, 6, 7]).status_code == 200


def test_a_later_request(vllm_qwen3):
    assert _complete(vllm_qwen3, [8, 9, 10, 11]).status_code == 200


def test_another_later_request(vllm_qwen3):
    assert _complete(vllm_qwen3, [12, 13]).status_code == 200
"""


def test_exit_codes_and_vllms_death_lines_are_read_by_name() -> None:
    """The words the diagnosis is made of: signals by name and cause, and vLLM 0.30's own death lines."""
    assert exit_description(-4).startswith("was killed by SIGILL (exit code -4): an illegal instruction")
    assert "AMX tile permission" in exit_description(-4)
    assert exit_description(-9).startswith("was killed by SIGKILL") and exit_description(1) == "exited with status 1"
    log = (
        "ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting\n"
        "RuntimeError: Process EngineCore_DP0 (PID: 812) died with exit code 1\n"
        "RuntimeError: Engine core process EngineCore_DP0 died unexpectedly.\n"
        "ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting\n"
    )
    assert deaths(log) == [("VllmWorker-0", -4), ("EngineCore_DP0", 1), ("EngineCore_DP0", None)]
    assert deaths("INFO all is well") == []
    # vLLM may log the death before the worker's status is reaped ("exit code: None"); Python's fault handler
    # (PYTHONFAULTHANDLER=1 in the server's processes) then names the signal
    unreaped = "ERROR [multiproc_executor.py:314] Worker proc VllmWorker-0 died unexpectedly (exit code: None)\n"
    assert deaths(unreaped) == [("VllmWorker-0", None)]
    assert deaths("Fatal Python error: Illegal instruction\n\nThread 0x01 (most recent call first):\n" + unreaped) == [
        ("VllmWorker-0", -4)
    ]


def _inner_session(tmp_path: Path, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the inner suite (its own conftest re-using ours) in a child pytest; its output is the evidence."""
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text(INNER_CONFTEST)
    (inner / "test_inner.py").write_text(INNER_TESTS)
    import json

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "INNER_SERVER_ENVIRONMENT": json.dumps(environment),
        "COLUMNS": "2000",  # the short summary's lines whole
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE", "--rootdir", str(inner)]
    return subprocess.run(
        [*argv, str(inner)], cwd=inner, env=env, capture_output=True, text=True, timeout=1500, check=False
    )


def _forced_probe(tmp_path: Path) -> str:
    shim = tmp_path / "force_amx_probe"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(FORCE_AMX_PROBE)
    return os.pathsep.join([str(shim), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.mark.slow
def test_a_server_killed_by_sigill_mid_suite_is_named_with_its_cause(tmp_path: Path) -> None:
    """Issue 30 item 0: a real worker death (SIGILL from vLLM's AMX attention kernel on a CPU without AMX,
    nothing guarding it) in the middle of a live suite: the test it died under says which process died and
    how, and every later test errors at set-up naming it, not on `Connection refused`."""
    environment = {"PYTHONPATH": _forced_probe(tmp_path), "VLLM_PLUGINS": "none-routereplay-left-out"}
    result = _inner_session(tmp_path, environment)
    out = result.stdout + result.stderr
    (tmp_path / "inner.out").write_text(out)
    assert result.returncode == 1, out[-6000:]
    assert "1 failed" in out and "2 errors" in out, out[-3000:]
    assert "vLLM server vllm_qwen3 died" in out, out[-6000:]  # the section the hook adds to the failed test
    assert "VllmWorker-0 was killed by SIGILL (exit code -4)" in out, out[-6000:]
    errors = [line for line in out.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 2 and all("ServerDiedError" in line and "SIGILL" in line for line in errors), errors
    assert "Connection refused" not in "\n".join(errors)


@pytest.mark.slow
def test_the_plugin_refuses_a_server_that_cannot_have_amx_tiles_by_name(tmp_path: Path) -> None:
    """Issue 30 item 0: the same forced server with the routereplay plugin in place (vLLM runs it in each of its
    processes) does not start: Linux really refuses this CPU the tile permission, and the server's start-up
    error carries `AmxPermissionError` instead of a worker's SIGILL at its first short prompt."""
    from routereplay.engines.vllm.server import ServerConfig, VLLMServer
    from routereplay.errors import EngineStartError
    from routereplay.testing.vllm_models import build_checkpoint

    build_checkpoint("qwen3_moe", tmp_path / "checkpoint")
    config = ServerConfig(
        model=tmp_path / "checkpoint",
        ready_timeout=900.0,
        log_path=tmp_path / "server.log",
        environment={"PYTHONPATH": _forced_probe(tmp_path)},
    )
    with pytest.raises(EngineStartError, match=r"(?s)exited with status.*AmxPermissionError.*routereplay vLLM plugin"):
        VLLMServer(config).start()
