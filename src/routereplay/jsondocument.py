"""Bounded JSON parsing for documents that come from outside (engine responses on disk, store headers).

`json.loads` on hostile bytes fails in ways that are not routereplay errors: a deeply nested
document raises `RecursionError`, a 5000-digit number `ValueError` (Python's int-string limit),
`Infinity` / `NaN` / `1e999` parse to floats that later raise `OverflowError`. `load_json` checks
the byte size, the nesting depth and the length of every number BEFORE `json.loads` runs (one
vectorised pass over the bytes, in chunks, so the scan itself allocates a bounded amount; skipped
when a count of brackets and a search for long digit runs already show both limits hold), refuses
non-finite numbers while parsing, and reports invalid JSON by line, column and character.

Legend: C = bytes of one scan chunk.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.errors import ConfigError, RouteReplayError

try:  # the optional one-pass pre-check in C (built at install; see setup.py)
    from routereplay import _json_scan as JSON_SCAN
except ImportError:
    JSON_SCAN = None

DEFAULT_MAX_JSON_BYTES = 256 << 20  # 256 MiB of JSON text (json.loads needs several times that in objects)
DEFAULT_MAX_JSON_DEPTH = 64  # engine responses nest <= 7 deep; store headers <= 4 plus user metadata
DEFAULT_MAX_NUMBER_DIGITS = 100  # ids and counts have <= 20 digits; floats <= 17 significant digits
SCAN_CHUNK_BYTES = 1 << 20  # the depth/digit scan works on 1 MiB at a time (78 MiB of temporaries, measured)

_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WHITESPACE = b" \t\r\n"
_DIGIT_MARKS = bytes(0x31 if 0x30 <= byte <= 0x39 else 0x30 for byte in range(256))  # digit -> "1", other -> "0"


@dataclass(frozen=True, slots=True, kw_only=True)
class JsonLimits:
    """What one JSON document may hold: bytes, nesting depth ([ and {), digits of one number.
    `scan_chunk_bytes` sets how much of the document the pre-parse scan looks at at once."""

    max_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS
    scan_chunk_bytes: int = SCAN_CHUNK_BYTES

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_number_digits", "scan_chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"JsonLimits.{name}={value!r} must be a positive int")


def load_json(data: bytes, *, what: str, error: type[RouteReplayError], limits: JsonLimits | None = None) -> Any:
    """Parse `data` as one JSON document within `limits`; any failure raises `error` naming `what`.

    Invalid JSON says where ("line 3, column 7 (character 41)"); NaN, Infinity and numbers that
    overflow a float (1e999) are refused, so every float in the result is finite.
    """
    limits = limits or JsonLimits()
    if len(data) > limits.max_bytes:
        raise error(
            f"{what}: {len(data)} bytes of JSON, above the {limits.max_bytes}-byte limit (JsonLimits.max_bytes); "
            "raise the limit if the document is genuine"
        )
    depth, digits = (0, 0) if _plainly_within(data, limits) else scan(data, limits)[:2]
    if depth > limits.max_depth:
        raise error(
            f"{what}: JSON nested more than {limits.max_depth} levels deep (JsonLimits.max_depth); no engine "
            "response or store header nests like that: the document is corrupt or hostile"
        )
    if digits > limits.max_number_digits:
        raise error(
            f"{what}: a JSON number has more than {limits.max_number_digits} digits (JsonLimits.max_number_digits); "
            "no id, count or size is that long: the document is corrupt or hostile"
        )
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NonFiniteError as exc:
        raise error(f"{what}: JSON holds the non-finite number {exc.args[0]}; only finite numbers are valid") from None
    except json.JSONDecodeError as exc:
        # json's "Unterminated string starting at" leaves its position to the caller: the one named first
        cause = f"{exc.msg[: -len(' at')]} there" if exc.msg.endswith(" at") else exc.msg
        raise error(
            f"{what}: invalid JSON at line {exc.lineno}, column {exc.colno} (character {exc.pos}): {cause}"
            f"{_truncation_hint(data, exc, scan(data, limits)[2])}"
        ) from None
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not UTF-8 text at byte {exc.start} ({exc.reason}), so not a JSON document") from None
    except (RecursionError, ValueError) as exc:  # backstops: the scan bounds depth and digits first
        raise error(f"{what}: JSON that Python cannot parse ({type(exc).__name__}: {exc})") from None


def looks_like_json(data: bytes) -> bool:
    """True when the first non-blank byte opens a JSON object or array."""
    head = data[:4096].lstrip(_WHITESPACE)
    return head[:1] in (b"{", b"[")


class _NonFiniteError(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteError(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFiniteError(f"{text[:40]} (overflows a float)")
    return value


def _plainly_within(data: bytes, limits: JsonLimits) -> bool:
    """True when the depth and digit limits cannot be passed: fewer [ and { in all than `max_depth` and
    no digit run longer than `max_number_digits` anywhere (C-speed counts; base64 payloads pass here).
    With the C pre-check (`json_scan.c`, built at install) both come from one pass over the bytes."""
    if JSON_SCAN is not None:
        # the kernel takes a C ssize_t: a larger limit (10**20, "no limit") asks the same question as sys.maxsize
        brackets, longest_digits = JSON_SCAN.counts(data, min(limits.max_number_digits, sys.maxsize))
        return bool(brackets <= limits.max_depth and longest_digits <= limits.max_number_digits)
    if data.count(b"[") + data.count(b"{") > limits.max_depth:
        return False
    if len(data) <= limits.max_number_digits:
        return True
    return b"1" * (limits.max_number_digits + 1) not in data.translate(_DIGIT_MARKS)


def _truncation_hint(data: bytes, exc: json.JSONDecodeError, unclosed: int) -> str:
    if unclosed > 0 or exc.pos >= len(data.rstrip(_WHITESPACE)) or exc.msg.startswith("Unterminated string"):
        return "; the document ends early: the file was truncated (an interrupted download or write?)"
    return ""


def scan(data: bytes, limits: JsonLimits) -> tuple[int, int, int]:
    """(deepest nesting, longest digit run, containers left open at the end) outside strings,
    stopping early once a limit is passed.

    Strings are tracked through unescaped quotes: a quote preceded by an odd run of backslashes is
    escaped. State carried across chunks: inside a string or not, the backslash run ending the
    chunk, the depth, the digit run ending the chunk.
    """
    in_string = False
    backslashes = 0  # length of the backslash run that ends the previous chunk
    depth = deepest = 0
    digit_run = longest = 0
    view = memoryview(data)
    for begin in range(0, len(data), limits.scan_chunk_bytes):
        chunk_C = np.frombuffer(view[begin : begin + limits.scan_chunk_bytes], np.uint8)
        size = len(chunk_C)
        index_C = np.arange(size, dtype=np.int64)
        # backslash run length ending just before each byte
        is_backslash_C = chunk_C == _BACKSLASH
        last_other_C = np.maximum.accumulate(np.where(is_backslash_C, -1 - backslashes, index_C))
        run_before_C = np.empty(size, np.int64)
        run_before_C[0] = backslashes
        run_before_C[1:] = index_C[:-1] - last_other_C[:-1]
        quote_C = (chunk_C == _QUOTE) & (run_before_C % 2 == 0)
        toggles_C = np.cumsum(quote_C, dtype=np.int64)
        # a byte is inside a string when an odd number of quotes precede it (the opening quote counts)
        inside_C = ((toggles_C - quote_C) % 2 == 1) ^ in_string
        outside_C = ~inside_C & ~quote_C
        steps_C = np.zeros(size, np.int8)
        steps_C[outside_C & ((chunk_C == _OPEN[0]) | (chunk_C == _OPEN[1]))] = 1
        steps_C[outside_C & ((chunk_C == _CLOSE[0]) | (chunk_C == _CLOSE[1]))] = -1
        depth_C = np.cumsum(steps_C, dtype=np.int64) + depth
        deepest = max(deepest, int(depth_C.max()))
        depth = int(depth_C[-1])
        is_digit_C = (chunk_C >= ord("0")) & (chunk_C <= ord("9")) & outside_C
        last_non_digit_C = np.maximum.accumulate(np.where(is_digit_C, -1 - digit_run, index_C))
        run_C = index_C - last_non_digit_C
        longest = max(longest, int(run_C.max()))
        digit_run = int(run_C[-1])
        backslashes = int(index_C[-1] - last_other_C[-1])
        in_string ^= bool(toggles_C[-1] % 2)
        if deepest > limits.max_depth or longest > limits.max_number_digits:
            break
    return deepest, longest, depth


__all__ = [
    "DEFAULT_MAX_JSON_BYTES",
    "DEFAULT_MAX_JSON_DEPTH",
    "DEFAULT_MAX_NUMBER_DIGITS",
    "SCAN_CHUNK_BYTES",
    "JsonLimits",
    "load_json",
    "looks_like_json",
    "scan",
]
