"""Output paths of the CLI: checked before the work starts, written whole at the end.

A command that trains or samples for minutes must not fail at its last line because an output path
was unusable all along, nor leave half an output behind when it is stopped. So:

- `check_output_file(flag, path, force=...)` refuses, before any work and without creating anything:
  `-` (no command writes to stdout: a file named `-` is `./-`), a directory, a FIFO, device node or
  socket (through a symlink too: a symlink is written through, see `atomicfile`), an existing file
  without `--force` (where the command has one), a folder that does not exist (as `cp` and a shell
  redirection do: an output file's folder is never created), and a folder that cannot be written. A
  file the command appends to (`train --log`) may be a FIFO or a device (`/dev/stderr`).
- `check_output_folder(flag, path, force=...)` does the same for a folder: `-`, a file, an existing
  non-empty folder without `--force`, a parent folder that does not exist (the output folder itself is
  created, its parents never: `--report /no-such-dir/a/b` is a typo as much as an output file's is) or
  cannot be written.
- `report_flags(args, default)` settles `--report` / `--force` / `--no-report` of a command that writes a report:
  `--no-report` with either of the others is a `ConfigError`; no `--report` means `default`.
- `staged_folder(path)` yields a new temporary folder beside `path` (in its existing parent) to write into; when
  the block ends
  normally its files land in `path` (renamed, so a reader never sees half a report), and on any
  failure or Ctrl-C the temporary folder is removed and `path` is left as it was. An existing folder
  (with `--force`) keeps its other files; the staged ones replace theirs.

Every refusal is an `OutputPathError` (or an `OSError` naming the path), which the CLI prints as one
line with exit status 2.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from routereplay.atomicfile import regular_target
from routereplay.errors import ConfigError, OutputPathError

STDOUT_NAME = "-"


def check_output_file(flag: str, path: str | Path, *, force: bool | None = None, appends: bool = False) -> Path:
    """Refuse an output file `flag PATH` that cannot be written (see the module docstring); returns the file
    that will be written (a symlink's target). `force=None`: the command replaces or appends without asking.
    `appends`: the command appends to PATH (a log), so an existing FIFO or device (/dev/stderr) is fine."""
    _refuse_stdout(flag, path)
    named = Path(path)
    if appends and named.is_dir():
        raise OutputPathError(f"{flag} {named} is a directory; {flag} appends to a file: name a file (new or existing)")
    if appends and named.exists():
        if not os.access(named, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(named))
        return named
    target = regular_target(named)  # OutputPathError: a directory, FIFO, device or socket
    if force is False and target.exists():
        raise OutputPathError(f"{flag} {named} exists; pass --force to overwrite it")
    folder = target.parent
    if not folder.exists() and not folder.is_symlink():  # not created, as with `cp` or `>`: a typo makes no folders
        raise OutputPathError(
            f"{flag} {named}: the folder {folder} does not exist, and an output file's folder is not created (as "
            f"with cp); create it first (mkdir -p {folder}) or name a file in an existing folder"
        )
    _check_writable_folder(flag, named, folder)
    return target


def check_output_folder(flag: str, path: str | Path, *, force: bool | None = None) -> Path:
    """Refuse an output folder `flag PATH` that cannot be written whole (see the module docstring)."""
    _refuse_stdout(flag, path, "folder")
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{flag} {folder} is a file, not a folder; pass another {flag}")
    if folder.is_dir():
        if force is False and any(folder.iterdir()):
            raise OutputPathError(
                f"{flag} {folder} is a folder that is not empty; pass --force to write into it (its report files "
                f"are replaced, other files kept), or another {flag}"
            )
        _check_writable_folder(flag, folder, folder)
    parent = folder.parent
    if not parent.exists() and not parent.is_symlink():  # created by nobody: a typo makes no folders
        raise OutputPathError(
            f"{flag} {folder}: its parent folder {parent} does not exist, and only {folder.name} itself is created, "
            f"never its parents (as with mkdir without -p); create it first (mkdir -p {parent}) or name a folder in "
            "an existing one"
        )
    _check_writable_folder(flag, folder, parent)
    return folder


def report_flags(args: Any, default: str) -> None:
    """`--no-report` with `--report` or `--force` contradicts itself: refused; else `args.report` defaults to
    `default` (`args` is the command's parsed namespace)."""
    if args.no_report:
        given = [flag for flag, value in (("--report", args.report is not None), ("--force", args.force)) if value]
        if given:
            raise ConfigError(
                f"--no-report and {' and '.join(given)} contradict each other: drop --no-report to write the report "
                f"(to --report, default ./{default}), or drop {' and '.join(given)}"
            )
    elif args.report is None:
        args.report = default


@contextmanager
def staged_folder(path: str | Path) -> Iterator[Path]:
    """Yield a new folder beside `path` (its parent must exist); on a normal exit move its files into `path`
    (created if absent), on an exception (Ctrl-C included) remove it and leave `path` untouched."""
    folder = Path(path)
    staging = folder.parent / f".{folder.name}.{secrets.token_hex(4)}.tmp"  # FileNotFoundError if the parent went
    staging.mkdir(mode=0o777)  # the umask applies, as for any new folder
    try:
        yield staging
        _move_in(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_in(staging: Path, folder: Path) -> None:
    """Put `staging`'s files in `folder`: one rename of the whole folder when `folder` is absent or empty,
    else file by file (each rename atomic; `report.html`, which links the others, last)."""
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    if not folder.exists():
        os.replace(staging, folder)
        return
    names = sorted(os.listdir(staging), key=lambda name: (name.endswith(".html"), name))
    for name in names:
        os.replace(staging / name, folder / name)
    staging.rmdir()


def _refuse_stdout(flag: str, path: str | Path, kind: str = "file") -> None:
    if str(path) == STDOUT_NAME:
        raise OutputPathError(
            f"{flag} -: this command writes its output to a {kind}, not to stdout (stdout carries its table or "
            f"--json); name a {kind}, or ./- for a {kind} named '-'"
        )


def _check_writable_folder(flag: str, named: Path, folder: Path) -> None:
    """Raise unless `folder` exists (or can be created) and a file can be created in it; creates nothing."""
    existing = folder
    while not existing.exists():  # the nearest folder that exists: the rest will be created in it
        if existing.parent == existing:
            break
        if existing.is_symlink():  # a dangling symlink on the way
            raise FileNotFoundError(errno.ENOENT, f"{existing} is a dangling symlink", str(named))
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(named))
    try:
        with tempfile.TemporaryFile(dir=existing):  # the honest test: read-only mounts, ACLs, root
            pass
    except OSError as exc:
        cause = exc.strerror or str(exc)
        raise type(exc)(exc.errno, f"{cause} (cannot create a file in {existing}; {flag})", str(named)) from exc


__all__ = ["STDOUT_NAME", "check_output_file", "check_output_folder", "staged_folder"]
