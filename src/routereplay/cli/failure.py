"""How the CLI ends when something goes wrong: exit statuses, one-line messages, and hints.

Exit statuses (the same for every subcommand):
- 0 `OK`: done; for `inspect`, the trace is valid.
- 1 `INVALID`: `inspect` read the file, and the routes in it fail validation (row count, layer
  count, top-k, expert ids out of range, duplicate or partial rows, all-zero layers).
- 2 `ERROR`: nothing usable came out: a bad flag (argparse), a file that cannot be read or is not
  a recognised format (`inspect`: "unreadable"), a corrupt codec blob, a missing optional package,
  or an OS error (missing file, a directory, permission denied, disk full). OS errors print one line
  with the path and the cause; a file being written is replaced only once complete, so the old one
  is kept.
- 130 `INTERRUPTED`: Ctrl-C.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path

from routereplay.cli.arguments import CODEC_LIMIT_FLAGS, trace_file_limits
from routereplay.codec.limits import CodecLimits
from routereplay.errors import CodecLimitError, RouteReplayError, RouteValueError, TraceShapeError
from routereplay.trace.route_trace import RouteTrace
from routereplay.tracefile.format import FileFormat, sniff
from routereplay.tracefile.io import MAX_FILE_BYTES, read_trace
from routereplay.tracefile.payload import PayloadHints


class ExitCode(IntEnum):
    OK = 0
    INVALID = 1
    ERROR = 2
    INTERRUPTED = 130


# a readable payload whose routes fail validation; every other error means "unreadable"
INVALID_ERRORS: tuple[type[RouteReplayError], ...] = (TraceShapeError, RouteValueError)

DESCRIPTIONS = {
    FileFormat.VLLM: "a vLLM response",
    FileFormat.SGLANG: "an SGLang response",
    FileFormat.MEGATRON: "a Megatron response",
    FileFormat.CODEC: "a codec (.rrt) file",
    FileFormat.NPY: "a .npy array",
}
ENGINE_FLAGS = {
    FileFormat.VLLM: "--num-experts (and --moe-layers for an all-layer payload)",
    FileFormat.SGLANG: "--num-experts, --num-layers and --top-k",
    FileFormat.MEGATRON: "--num-experts",
    FileFormat.CODEC: "no model flags (the codec file describes itself)",
    FileFormat.NPY: "--num-experts",
}


def is_invalid(exc: BaseException) -> bool:
    """True when `exc` says the routes were read but are wrong, not that the file could not be read."""
    return isinstance(exc, INVALID_ERRORS)


def exit_code(exc: BaseException) -> ExitCode:
    return ExitCode.INVALID if is_invalid(exc) else ExitCode.ERROR


def os_error_line(exc: OSError) -> str:
    """`PATH: cause` (or `PATH -> PATH2: cause` for a rename) from an OSError, on one line."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return f"{type(exc).__name__}: {cause}"
    where = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{where}: {cause}"


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Give an OSError raised inside (a write that hit a full disk has none) the path being written."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def read_trace_file(
    args: argparse.Namespace, path: str, hints: PayloadHints, *, validate: bool
) -> tuple[RouteTrace, FileFormat]:
    """`read_trace` within the codec-limit flags, adding which engine the file looks like when a forced
    `--engine` fails on it, and which flag raises a codec limit the file is beyond."""
    limits = trace_file_limits(args)
    try:
        return read_trace(path, hints, engine=args.engine, validate=validate, limits=limits)
    except RouteReplayError as exc:
        hint = codec_limit_hint(exc, limits.codec) or engine_hint(path, args.engine)
        if hint is not None and len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}; {hint}",)
        raise


def codec_limit_hint(exc: RouteReplayError, limits: CodecLimits) -> str | None:
    """For a `CodecLimitError`, the sentence naming the CLI flag that raises the limit it names."""
    if not isinstance(exc, CodecLimitError):
        return None
    for name, flag in CODEC_LIMIT_FLAGS.items():
        if f"CodecLimits.{name}=" in str(exc):
            return f"CLI: if the file is trusted, raise the limit with {flag} N (now {getattr(limits, name)})"
    return None


def engine_hint(path: str | Path, forced: str | None) -> str | None:
    """When `--engine forced` disagrees with what the file's bytes say, the sentence that says so."""
    if forced is None:
        return None
    try:
        if Path(path).stat().st_size > MAX_FILE_BYTES:
            return None
        detected, _document = sniff(Path(path).read_bytes())
    except (RouteReplayError, OSError, ValueError, RecursionError):
        return None
    if detected == FileFormat(forced):
        return None
    what = DESCRIPTIONS[detected]
    return (
        f"but this file looks like {what}, not {forced}: pass --engine {detected} (or leave --engine out, "
        f"the format is recognised from the bytes) with {ENGINE_FLAGS[detected]}"
    )


__all__ = [
    "INVALID_ERRORS",
    "ExitCode",
    "codec_limit_hint",
    "engine_hint",
    "exit_code",
    "is_invalid",
    "naming",
    "os_error_line",
    "read_trace_file",
]
