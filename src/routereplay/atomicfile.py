"""Atomic file writes: a reader sees the old file or the new one, never half of one.

`atomic_write(path, data)` writes a temporary file beside `path`, fsyncs it, renames it over
`path` and fsyncs the folder. The temporary is named after its target and its writer,
`.<name>.<host>.<pid>.<random>.tmp`, so a writer killed mid-write (SIGKILL, OOM killer, power loss)
leaves a file that says whose it was: the next write to the same target removes the temporaries
of that target whose writer process (on this host) is gone. Temporaries of live writers, of other
targets and of other hosts are never touched.

New files get the usual `0o666 & ~umask` mode (as `open(path, "w")` would); a file that is
replaced keeps its mode.

The target must be a regular file or absent. A symlink is written through: the file it points to is
replaced (atomically, beside it) and the link stays. A FIFO, a device node (`/dev/full`, `/dev/null`)
or a socket is refused with `OutputPathError` before anything is written, rather than replaced by a
regular file; a directory too. An OS error (a read-only folder, a full disk) names the target, not
the temporary.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

from routereplay.errors import OutputPathError

TEMP_SUFFIX = ".tmp"


def atomic_write(path: str | Path, data: bytes | bytearray | memoryview | Iterable[bytes]) -> int:
    """Write `data` (bytes, or an iterable of byte chunks) to `path` atomically; returns the bytes written.

    Stale temporaries of `path` left by dead writers are removed first. A symlink is written through;
    a FIFO, device, socket or directory at `path` raises `OutputPathError` (see the module docstring).
    """
    named = Path(path)
    path = regular_target(named)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    temporary = temporary_path(path, os.getpid())
    mode = _existing_mode(path)
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:  # a read-only folder: say which output could not be written, not the temporary's name
        raise _naming(exc, named, f"cannot create a file in {path.parent}") from exc
    written = 0
    try:
        with os.fdopen(descriptor, "wb") as stream:
            if mode is not None:
                os.fchmod(stream.fileno(), mode)
            chunks = (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
            for chunk in chunks:
                stream.write(chunk)
                written += len(chunk)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise _naming(exc, named, None) from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return written


def regular_target(path: str | Path) -> Path:
    """The file `atomic_write(path)` replaces: `path`, or the file a symlink at `path` points to (followed
    to the end, dangling allowed). Raises `OutputPathError` when that is a directory, FIFO, device or socket."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target
    except OSError:
        return target  # e.g. no permission on a parent folder: the write says so, naming the path
    if stat.S_ISREG(mode):
        return target
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    via = f" (through the symlink {path})" if target != path else ""
    raise OutputPathError(
        f"{target}{via} is {kind}, not a regular file: an output is written beside it and renamed over it, "
        "which would replace it; name a regular file (or a new path)"
    )


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _naming(exc: OSError, path: Path, why: str | None) -> OSError:
    """`exc` again, of the same type, naming `path` (the output asked for) instead of the temporary."""
    cause = exc.strerror or str(exc)
    return type(exc)(exc.errno, f"{cause} ({why})" if why else cause, str(path))


def temporary_path(path: Path, pid: int) -> Path:
    """The temporary a writer with process id `pid` on this host uses for `path`."""
    return path.with_name(f".{path.name}.{_host()}.{pid}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def stale_temporaries(path: str | Path) -> list[Path]:
    """Temporaries of `path` written on this host by processes that no longer exist."""
    path = Path(path)
    pattern = re.compile(
        rf"\.{re.escape(path.name)}\.{re.escape(_host())}\.(\d+)\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}"
    )
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    stale = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is not None and not _alive(int(match.group(1))):
            stale.append(path.parent / name)
    return stale


def remove_stale_temporaries(path: str | Path) -> int:
    """Delete the temporaries `stale_temporaries(path)` names; returns how many went."""
    removed = 0
    for temporary in stale_temporaries(path):
        try:
            temporary.unlink()
            removed += 1
        except FileNotFoundError:
            pass  # another writer cleaned it first
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of this process may be writing it
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    except OverflowError:
        return False
    return True


def _host() -> str:
    """This host's name reduced to [A-Za-z0-9-] (it sits between dots in a file name)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _existing_mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return None


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; some platforms cannot open a folder, which is then skipped."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


__all__ = [
    "TEMP_SUFFIX",
    "atomic_write",
    "regular_target",
    "remove_stale_temporaries",
    "stale_temporaries",
    "temporary_path",
]
