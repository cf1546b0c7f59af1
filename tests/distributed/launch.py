"""Start a 2-rank gloo job on this machine and wait for it, bounded in time.

Each rank is a fresh `python -m tests.distributed.worker SCENARIO DIR` with the usual env://
variables (MASTER_ADDR 127.0.0.1, a port the OS picked as free, RANK, WORLD_SIZE) and one thread.
Ranks read `DIR/case.pt` and write `DIR/rank{r}.pt`; their output goes to `DIR/rank{r}.log`.
A rank that fails ends the job at once (its partner would otherwise wait in a collective), a job
over its time limit is killed, and both fail the calling test with the logs' tails. If another
process took the port between the pick and the bind, the job is started again once on a new port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 120.0  # a job takes ~5 s alone; generous for 2 cores shared by pytest-xdist workers
PORT_TAKEN = ("address already in use", "eaddrinuse")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(scenario: str, workdir: Path, *, world_size: int = 2, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Run `scenario` on `world_size` ranks; fail the test if any rank fails or the job hangs."""
    for attempt in range(2):
        failure = _run(scenario, workdir, world_size, timeout_s)
        if failure is None:
            return
        if attempt == 0 and any(marker in failure.lower() for marker in PORT_TAKEN):
            continue
        pytest.fail(failure, pytrace=False)


def _run(scenario: str, workdir: Path, world_size: int, timeout_s: float) -> str | None:
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        }
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname resolves to
        with logs[rank].open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.distributed.worker", scenario, str(workdir)],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout_s
    problem = None
    try:
        while problem is None and any(p.poll() is None for p in procs):
            failed = [rank for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                problem = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                problem = f"timed out after {timeout_s:g} s (a hang in a collective?)"
            else:
                time.sleep(0.05)
        failed = [rank for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
        if problem is None and failed:
            problem = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if problem is None:
        return None
    tails = "\n".join(f"--- rank {rank} log (tail) ---\n{_tail(log)}" for rank, log in enumerate(logs))
    return f"distributed job {scenario!r} on {world_size} ranks: {problem}\n{tails}"


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])
