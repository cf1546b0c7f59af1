"""How the CLI ends when something goes wrong: exit statuses, one-line messages, and hints.

Exit statuses (the same for every subcommand):
- 0 `OK`: done; for `inspect`, the trace is valid.
- 1 `INVALID`: `inspect` read the file, and the routes in it fail validation (row count, layer
  count, top-k, expert ids out of range, duplicate or partial rows, all-zero layers).
- 2 `ERROR`: nothing usable came out: a bad flag (argparse; `inspect --json` still prints its
  verdict), flags that contradict each other or the file, a file that cannot be read or is not a
  recognised format (`inspect`: "unreadable"), a corrupt codec blob, a model checkpoint that cannot
  be loaded (`CheckpointError`: truncated weights; for the demo model's cache the message names the
  folder to delete), a missing optional package, or an OS error (missing file, a directory,
  permission denied, disk full). OS errors print one line with the path and the cause; a file being
  written is replaced only once complete, so the old one is kept. A library message printed here
  goes through `cli_message`, which names CLI flags where the library names Python keywords.
- 130 `INTERRUPTED`: Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path

from routereplay.cli.arguments import CODEC_LIMIT_FLAGS, trace_file_limits
from routereplay.codec.limits import CodecLimits
from routereplay.errors import (
    CodecLimitError,
    ConfigError,
    RouteReplayError,
    RouteValueError,
    RowCountError,
    TraceShapeError,
)
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


# Library messages advise Python keywords (`pass start_len=0`); the CLI names its flag for each instead
KEYWORD_FLAGS = {
    "num_experts": "--num-experts",
    "num_layers": "--num-layers",
    "top_k": "--top-k",
    "moe_layers": "--moe-layers",
    "num_tokens": "--num-tokens",
    "start": "--start",
    "start_len": "--start",
    "prompt_start": "--start",
    "choice": "--index",
    "index": "--index",
    "max_expansion": "--max-expansion",
    "max_entries": "--max-entries",
}
_KEYWORDS = "|".join(sorted(KEYWORD_FLAGS, key=len, reverse=True))
# `num_layers=47 (CLI: --num-layers)`: the library already named the flag; keep only the flag
_NAMED_FLAG = re.compile(r"(?<![\w.])\w+=(-?\d+\b)? \(CLI: (--[\w-]+)[^)]*\)")
# `records start=2` / `wrote this payload with num_experts=64` state what a file holds: not advice, kept
_KEYWORD = re.compile(rf"(?<![\w.])(?<!records )(?<!with )({_KEYWORDS})=(-?\d+\b)?")
# advice for a keyword no flag sets: an alternative (`, or raise retries=/timeout=`) or a whole clause or sentence
_NO_FLAG_ALTERNATIVE = re.compile(r",? or (?:raise|pass|set) \w+=(?:/\w+=)*(?=[\s,;.]|$)")
_NO_FLAG_ADVICE = re.compile(r"(?<![\w.])\w+=(?=[\s,;)/.]|$)")
_CLAUSE_BREAK = re.compile(r"(;\s+|\.\s+(?=[A-Z]))")
# `choices index 5 is out of range` (wire.payload.pick / pick_choice): the index is what --index asked for
_INDEX_OUT_OF_RANGE = re.compile(r"(?<![\w.-])(choices|requests|results) index (-?\d+) is out of range")


def cli_message(text: str) -> str:
    """A library message as the CLI prints it: each Python keyword it advises becomes the flag that sets it
    (`pass start_len=0` -> `pass --start 0`, `choice=1` -> `--index 1`), and advice for a keyword no flag
    sets (`raise retries=/timeout=`, `pass layers=`) is left out rather than pointing at nothing."""
    text = _INDEX_OUT_OF_RANGE.sub(lambda m: f"--index {m[2]} (the {m[1]} index) is out of range", text)
    text = _NAMED_FLAG.sub(lambda m: m[2] + (f" {m[1]}" if m[1] else ""), text)
    text = _KEYWORD.sub(lambda m: KEYWORD_FLAGS[m[1]] + (f" {m[2]}" if m[2] else ""), text)
    text = _NO_FLAG_ALTERNATIVE.sub("", text)
    first, *rest = _CLAUSE_BREAK.split(text)  # [clause, break, clause, break, clause, ...]
    kept = [first]
    for brk, clause in zip(rest[::2], rest[1::2], strict=True):
        if not _NO_FLAG_ADVICE.search(clause):
            kept += [brk, clause]
        elif brk.startswith(".") and not kept[-1].endswith("."):
            kept.append(".")  # the dropped sentence's full stop ended the one before
    return "".join(kept)


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
        trace, found = read_trace(path, hints, engine=args.engine, validate=validate, limits=limits)
    except RouteReplayError as exc:
        hint = codec_limit_hint(exc, limits.codec) or engine_hint(path, args.engine)
        if hint is not None and len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}; {hint}",)
        raise
    if found in (FileFormat.CODEC, FileFormat.NPY):
        check_sequence_flags(args, trace, found, Path(path).name)
    return trace, found


def check_sequence_flags(args: argparse.Namespace, trace: RouteTrace, found: FileFormat, where: str) -> None:
    """`--index`, `--start` and `--num-tokens` on a file of one sequence (.rrt, .npy): a contradiction is
    refused, never ignored. `--index` picks a response's choice or request; `--start` must match what a
    codec file records; `--num-tokens` checks the rows as it does for an engine payload."""
    what = DESCRIPTIONS[found]
    if args.index:
        raise ConfigError(
            f"{where}: --index {args.index} picks a choice or request inside an engine response, but this is {what}, "
            "which holds one sequence: drop --index"
        )
    if found is FileFormat.CODEC and args.start is not None and args.start != trace.start:
        raise ConfigError(
            f"{where}: the file records start={trace.start} but --start says {args.start}; a codec file carries its "
            f"own start: drop --start (or pass {trace.start})"
        )
    if args.num_tokens is not None and trace.num_tokens != args.num_tokens - 1 - trace.start:
        expected = args.num_tokens - 1 - trace.start
        raise RowCountError(
            f"{where}: {trace.num_tokens} route rows, expected {expected} = --num-tokens({args.num_tokens}) - 1 - "
            f"start({trace.start}); drop --num-tokens, or pass --num-tokens {trace.num_tokens + 1 + trace.start} "
            "if the file is the sequence you meant"
        )


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
    "KEYWORD_FLAGS",
    "ExitCode",
    "check_sequence_flags",
    "cli_message",
    "codec_limit_hint",
    "engine_hint",
    "exit_code",
    "is_invalid",
    "naming",
    "os_error_line",
    "read_trace_file",
]
