"""Atomic writes (issue 11 item 18): temporaries of killed writers are cleaned, modes follow the umask."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace
from routereplay.atomicfile import TEMP_SUFFIX, atomic_write, stale_temporaries, temporary_path
from routereplay.store.route_store import RouteStore

CHUNK_BYTES = 4 << 20
CHUNKS_BEFORE_KILL = 8  # the child has written 32 MiB of its temporary when it is killed

# The child starts the atomic write of a store file with a real `atomic_write`, hands it chunks of a
# real store's bytes, says how far it got, and waits to be killed: SIGKILL lands mid-write every time.
CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from routereplay import RouteTrace
    from routereplay.atomicfile import atomic_write
    from routereplay.store.route_store import RouteStore

    target, chunk, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = RouteStore()
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((4096, 4, 64)), axis=2)[..., :8].astype(np.int16)
    store.add_turn("big", np.arange(4097), RouteTrace(experts, 64))
    data = store.to_bytes()

    def chunks():
        for _ in range(count):
            yield (data * (chunk // len(data) + 1))[:chunk]
        print("written", flush=True)
        time.sleep(600)  # killed here, mid-write
        yield b""

    atomic_write(target, chunks())
    """
)


def small_store(seed: int) -> RouteStore:
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((7, 2, 8)), axis=2)[..., :2].astype(np.int16)
    store = RouteStore()
    store.add_turn("s", np.arange(8), RouteTrace(experts, 8))
    return store


def kill_mid_write(target: Path) -> Path:
    """Run a child that dies by SIGKILL inside `atomic_write(target, ...)`; returns its leftover temporary."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(target), str(CHUNK_BYTES), str(CHUNKS_BEFORE_KILL)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "written"
        leftovers = sorted(target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"))
        assert len(leftovers) == 1 and leftovers[0].stat().st_size == CHUNK_BYTES * CHUNKS_BEFORE_KILL
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()  # reaped: its pid no longer names a process
    assert child.returncode == -signal.SIGKILL
    return leftovers[0]


def test_sigkilled_writer_leaves_old_file_and_next_write_removes_its_temporary(tmp_path: Path) -> None:
    """Resource exhaustion (issue 11 item 18): a writer SIGKILLed mid-write left its temporary forever
    (11 files, 204 MB beside a 22 MB store after 60 kills). The old file survives the kill, and the
    next write to the same target removes the dead writer's temporary."""
    target = tmp_path / "batch.rrst"
    old = small_store(0)
    old.save(target)
    leftover = kill_mid_write(target)
    assert RouteStore.load(target) == old  # the kill left the complete old file
    assert stale_temporaries(target) == [leftover]
    new = small_store(1)
    new.save(target)
    assert RouteStore.load(target) == new
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.rrst"]


def test_many_kills_leave_at_most_one_temporary(tmp_path: Path) -> None:
    """Resource exhaustion (issue 11 item 18): temporaries no longer pile up across repeated kills."""
    target = tmp_path / "routes.rrst"
    small_store(0).save(target)
    for _ in range(3):
        kill_mid_write(target)
        small_store(1).save(target)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["routes.rrst"]


def test_live_writers_and_other_targets_are_left_alone(tmp_path: Path) -> None:
    """Data loss guard (issue 11 item 18): only temporaries of the same target whose writer is dead go;
    a live writer's temporary, another target's and foreign files stay."""
    target = tmp_path / "a.rrst"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = temporary_path(target, sleeper.pid)
        live.write_bytes(b"in progress")
        mine = temporary_path(target, os.getpid())  # another thread of this process may be writing it
        mine.write_bytes(b"in progress")
        other_target = temporary_path(tmp_path / "b.rrst", dead_pid())
        other_target.write_bytes(b"x")
        foreign = tmp_path / ".a.rrst.notours.tmp"
        foreign.write_bytes(b"x")
        dead = temporary_path(target, dead_pid())
        dead.write_bytes(b"x")
        atomic_write(target, b"new")
        assert target.read_bytes() == b"new"
        assert live.exists() and mine.exists() and other_target.exists() and foreign.exists()
        assert not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_new_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """Misleading permissions (issue 11 item 18): saved files were created 0600 whatever the umask;
    now they get 0o666 & ~umask, as open(path, "w") gives."""
    previous = os.umask(umask)
    try:
        written = small_store(0).save(tmp_path / "s.rrst")
        atomic_write(tmp_path / "raw.bin", b"abc")
    finally:
        os.umask(previous)
    assert written == (tmp_path / "s.rrst").stat().st_size
    assert (tmp_path / "s.rrst").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "raw.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_replaced_files_keep_their_mode(tmp_path: Path) -> None:
    """Data exposure guard (issue 11 item 18): a file the user chmod-ed keeps its mode when rewritten."""
    target = tmp_path / "t.bin"
    atomic_write(target, b"one")
    target.chmod(0o640)
    atomic_write(target, [b"tw", b"o"])
    assert target.read_bytes() == b"two"
    assert target.stat().st_mode & 0o777 == 0o640


def test_a_failed_write_removes_its_temporary_and_keeps_the_old_file(tmp_path: Path) -> None:
    """Data loss guard (issue 11 item 18): an exception inside the write leaves the old file and no temporary."""
    target = tmp_path / "t.bin"
    atomic_write(target, b"old")

    def failing() -> object:
        yield b"partial"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, failing())  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]
