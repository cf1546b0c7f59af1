"""Argument groups shared by several subcommands, and the parsers (argparse types) of their values.

Every numeric flag of every subcommand is checked when the command line is parsed, before any work
starts: argparse then prints `argument --num-experts: must be an integer >= 1, got '0'` and exits 2.
The bounds are keyword arguments of the type factories, with the module constants below as defaults.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from routereplay.codec.limits import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_EXPANSION, CodecLimits
from routereplay.tracefile.format import FileFormat
from routereplay.tracefile.io import TraceFileLimits
from routereplay.tracefile.payload import PayloadHints

MAX_INT_FLAG = 2**31 - 1  # sizes, counts and offsets: larger is a typo, and would not fit an int32 tensor
MAX_SEED = 2**32 - 1  # numpy's and torch's seed range
MAX_LAYER_NUMBER = 65535  # global layer numbers in --moe-layers: far above any model's depth
MAX_ENTRIES_FLAG = 1 << 40  # --max-entries: 2 TiB of int16 ids, far above any one trace
# the CodecLimits field each codec flag sets (a CodecLimitError names the field; the CLI names the flag)
CODEC_LIMIT_FLAGS = {"max_expansion": "--max-expansion", "max_entries": "--max-entries"}
_NUMBER = re.compile(r"[0-9]{1,9}")


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` (subcommands' parsers are of the same class) whose `usage_verdict`, when set, sees a
    bad command line before argparse prints its usage error and exits 2: `inspect --json` prints its verdict
    then. An error the top-level parser finds (an unrecognised argument) goes to the subcommand's hook."""

    usage_verdict: Callable[[str, list[str]], None] | None = None  # (argparse's message, the command's arguments)
    given: tuple[str, ...] = ()  # the arguments of the latest parse

    def parse_known_args(  # type: ignore[override]  # the signature differs across Python versions
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.given = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hook, given = self.usage_verdict, self.given
        if hook is None:
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for at, token in enumerate(given):
                        command = action.choices.get(token)
                        if isinstance(command, CommandParser):
                            hook, given = command.usage_verdict, given[at + 1 :]
                            break
        if hook is not None:
            hook(message, list(given))
        super().error(message)


def bounded_int(minimum: int, maximum: int = MAX_INT_FLAG) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be an integer <= {maximum}, got {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def bounded_float(minimum: float, maximum: float = math.inf, *, open_minimum: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [minimum, maximum] (or (minimum, maximum] when `open_minimum`)."""
    low = "(" if open_minimum else "["
    high = f"{maximum:g}]" if math.isfinite(maximum) else "inf)"
    interval = f"{low}{minimum:g}, {high}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text!r}") from None
        too_low = value <= minimum if open_minimum else value < minimum
        if not math.isfinite(value) or too_low or value > maximum:
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text!r}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)
seed_int = bounded_int(0, MAX_SEED)
positive_float = bounded_float(0.0, open_minimum=True)
non_negative_float = bounded_float(0.0)
probability = bounded_float(0.0, 1.0, open_minimum=True)  # top-p: (0, 1]
MAX_SYNC_TOKENS = 1 << 20  # --sync-tokens: a trainer step lasting more engine tokens than this is a typo


def token_range(text: str) -> tuple[int, int]:
    """An argparse type: `LOW,HIGH` engine tokens, 0 <= LOW <= HIGH <= MAX_SYNC_TOKENS."""
    parts = text.split(",")
    if len(parts) != 2 or not all(_NUMBER.fullmatch(p.strip()) for p in parts):
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH (two integers, e.g. 1,3), got {text!r}")
    low, high = (int(p) for p in parts)
    if low > high or high > MAX_SYNC_TOKENS:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH with 0 <= LOW <= HIGH <= {MAX_SYNC_TOKENS}, got {text!r}")
    return low, high


def any_case(*choices: str) -> Callable[[str], str]:
    """An argparse type that spells `text` as the choice it names in any case (`--mode r3` is `R3`); argparse's
    `choices` then refuses what names none of them."""
    spelled = {choice.casefold(): choice for choice in choices}

    def parse(text: str) -> str:
        return spelled.get(text.casefold(), text)

    return parse


def layer_list(text: str, *, max_layer: int = MAX_LAYER_NUMBER) -> list[int]:
    """Parse "1-47", "1,3,5" or "0,2-4" into ascending global layer numbers (no repeats, <= max_layer)."""
    layers: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low_text, dash, high_text = (piece.strip() for piece in part.partition("-"))
        if not _NUMBER.fullmatch(low_text) or (dash and not _NUMBER.fullmatch(high_text)):
            raise argparse.ArgumentTypeError(
                f"bad layer list {text!r} (part {part!r}); use non-negative layer numbers, e.g. 1-47 or 0,2,4-6"
            )
        low = int(low_text)
        high = int(high_text) if dash else low
        if high < low:
            raise argparse.ArgumentTypeError(f"layer range {part!r} in {text!r} runs backwards; write {high}-{low}")
        if high > max_layer:
            raise argparse.ArgumentTypeError(f"layer {high} in {text!r} is above the largest layer number {max_layer}")
        if layers and low <= layers[-1]:
            raise argparse.ArgumentTypeError(
                f"layer list {text!r} is not ascending: {part!r} comes after layer {layers[-1]}; list each layer "
                "once, in increasing order"
            )
        layers.extend(range(low, high + 1))
    return layers


def add_payload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that say what an engine payload does not: model facts and which sequence."""
    group = parser.add_argument_group(
        "engine payloads", "model facts an engine payload does not carry (from the model's config.json)"
    )
    group.add_argument(
        "--engine", choices=[f.value for f in FileFormat], help="input format (default: recognised from the bytes)"
    )
    group.add_argument(
        "--num-experts", type=positive_int, help="routed experts per MoE layer (n_routed_experts / num_experts)"
    )
    group.add_argument(
        "--num-layers", type=positive_int, help="layers in the payload: every hidden layer (SGLang: required)"
    )
    group.add_argument("--top-k", type=positive_int, help="experts per token (num_experts_per_tok; SGLang: required)")
    group.add_argument(
        "--moe-layers",
        type=layer_list,
        help="global numbers of the MoE layers to keep from an all-layer payload, ascending, e.g. 1-47 or 0,2-4",
    )
    group.add_argument(
        "--num-tokens", type=positive_int, help="prompt + generated tokens: checks rows == num_tokens - 1 - start"
    )
    group.add_argument(
        "--start",
        type=non_negative_int,
        help="token position of row 0 (prompt_start / start_len; default 0, or what the file records)",
    )
    group.add_argument(
        "--index",
        type=non_negative_int,
        help="choice / request index inside an engine response (default 0; a .rrt or .npy file holds one sequence)",
    )


def add_codec_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """`--max-expansion`, `--max-entries`: the `CodecLimits` a codec (.rrt) input is decoded within."""
    group = parser.add_argument_group(
        "codec limits",
        "bounds a codec (.rrt) input is decoded within, checked before anything is allocated; raise them "
        "only for a file you trust",
    )
    group.add_argument(
        "--max-expansion",
        type=positive_int,
        metavar="N",
        help=f"most decoded bytes per byte of file (default {DEFAULT_MAX_EXPANSION}); a zstd file of almost "
        "only -1 rows, or a zero-bit layout (top-k == experts, or one expert), may need more",
    )
    group.add_argument(
        "--max-entries",
        type=bounded_int(1, MAX_ENTRIES_FLAG),
        metavar="N",
        help=f"most expert ids (tokens x layers x top-k) in the file (default {DEFAULT_MAX_ENTRIES} = 2**28, "
        "512 MiB of int16 ids)",
    )


def codec_limits(args: argparse.Namespace) -> CodecLimits:
    """The `CodecLimits` of `--max-expansion` / `--max-entries` (defaults where a flag is absent)."""
    given = {name: getattr(args, name, None) for name in CODEC_LIMIT_FLAGS}
    return CodecLimits(**{name: value for name, value in given.items() if value is not None})


def trace_file_limits(args: argparse.Namespace) -> TraceFileLimits:
    """The `TraceFileLimits` `read_trace` applies for this command line (codec limits from the flags)."""
    return TraceFileLimits(codec=codec_limits(args))


def payload_hints(args: argparse.Namespace) -> PayloadHints:
    return PayloadHints(
        num_experts=args.num_experts,
        num_layers=args.num_layers,
        top_k=args.top_k,
        moe_layers=args.moe_layers,
        num_tokens=args.num_tokens,
        start=args.start or 0,  # None: not given
        index=args.index or 0,
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


__all__ = [
    "CODEC_LIMIT_FLAGS",
    "MAX_ENTRIES_FLAG",
    "MAX_INT_FLAG",
    "MAX_LAYER_NUMBER",
    "MAX_SEED",
    "CommandParser",
    "add_codec_limit_arguments",
    "add_json_argument",
    "add_payload_arguments",
    "any_case",
    "bounded_float",
    "bounded_int",
    "codec_limits",
    "layer_list",
    "non_negative_float",
    "non_negative_int",
    "payload_hints",
    "positive_float",
    "positive_int",
    "probability",
    "seed_int",
    "token_range",
    "trace_file_limits",
]
