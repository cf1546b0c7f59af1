"""Every flag of every subcommand: validated numbers at parse time, and help text everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from routereplay.cli import arguments
from routereplay.cli.main import EXIT_ERROR, build_parser, main
from routereplay.cli.threads import thread_count

# the positional arguments each subcommand needs before its flags can be parsed
POSITIONALS = {"inspect": ["in.json"], "convert": ["in.json", "out.rrt"], "bench": ["codec"]}

# per validated type: values it must refuse
BAD_VALUES: dict[Callable[[str], Any], list[str]] = {
    arguments.positive_int: ["0", "-5", "1.5", "x", "", "9" * 5000],
    arguments.non_negative_int: ["-1", "2.0", "x"],
    arguments.seed_int: ["-1", str(2**32), "x"],
    arguments.positive_float: ["0", "-1", "nan", "inf", "x"],
    arguments.non_negative_float: ["-0.1", "nan", "-inf"],
    arguments.probability: ["0", "1.5", "-0.1", "nan"],
    arguments.layer_list: ["", "26-1", "3,1", "1,1", "1-3,2", "1-", "-3", "a", "1,,2", "0-99999999"],
    thread_count: ["0", "-2"],
}


def subparsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    yield from choices.items()


def flag_actions() -> Iterator[tuple[str, argparse.Action]]:
    for command, sub in subparsers():
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield command, action


def numeric_flags() -> list[tuple[str, str, Callable[[str], Any]]]:
    """(command, flag, type) of every flag whose value is a number or a layer list."""
    found = []
    for command, action in flag_actions():
        if action.type in BAD_VALUES:
            found.append((command, action.option_strings[-1], action.type))
    return found


def test_no_numeric_flag_is_parsed_by_bare_int_or_float() -> None:
    """Silent misroute (issue 11 item 29): `--num-experts 0` / `-5` were accepted ("expert id 63 is outside
    [0, -5)"); every numeric flag of every subcommand now has a validating type, none is a bare int/float."""
    loose = [
        f"{command} {action.option_strings[-1]}"
        for command, action in flag_actions()
        if action.type in (int, float)
        or (
            action.type is None
            and isinstance(action.default, (int, float))
            and not isinstance(action.default, bool)
            and action.nargs != 0
        )
    ]
    assert not loose, f"flags parsed without a range check: {loose}"
    assert len(numeric_flags()) >= 40, "the numeric flags of demo, train, inspect, convert and bench are all found"


@pytest.mark.parametrize(("command", "flag", "kind"), numeric_flags())
def test_every_numeric_flag_refuses_out_of_range_values_naming_the_flag(
    command: str, flag: str, kind: Callable[[str], Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Silent misroute (issue 11 item 29): a zero, negative, non-finite or malformed value is refused when the
    command line is parsed, before any work, with a message naming the flag."""
    for value in BAD_VALUES[kind]:
        with pytest.raises(SystemExit) as exit_info:
            main([command, *POSITIONALS.get(command, []), f"{flag}={value}"])
        assert exit_info.value.code == EXIT_ERROR
        err = capsys.readouterr().err
        assert f"argument {flag}" in err, f"{command} {flag}={value!r}: {err}"
        assert "Traceback" not in err


def test_num_experts_zero_and_negative_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Silent misroute (issue 11 item 29): the exact flags from the report are refused at parse time."""
    for value in ("0", "-5"):
        with pytest.raises(SystemExit):
            main(["inspect", "moonlight_vllm.json", "--num-experts", value])
        assert f"argument --num-experts: must be an integer >= 1, got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "layers"),
    [("1-26", list(range(1, 27))), ("0,2-4", [0, 2, 3, 4]), ("5", [5]), (" 1 - 3 , 7 ", [1, 2, 3, 7])],
)
def test_layer_list_accepts_ascending_ranges(text: str, layers: list[int]) -> None:
    assert arguments.layer_list(text) == layers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("26-1", "runs backwards; write 1-26"),
        ("3,1", "is not ascending"),
        ("1,1", "is not ascending"),
        ("1-", "bad layer list"),
        ("0-70000", "above the largest layer number 65535"),
    ],
)
def test_layer_list_refusals_say_why(text: str, message: str) -> None:
    """Silent misroute (issue 11 item 29): a repeated or out-of-order layer list would select the wrong rows."""
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        arguments.layer_list(text)


def test_valid_values_still_parse() -> None:
    args = build_parser().parse_args(
        ["inspect", "x", "--num-experts", "64", "--moe-layers", "1-26", "--start", "0", "--layers-shown", "0"]
    )
    assert (args.num_experts, args.moe_layers[0], args.moe_layers[-1], args.layers_shown) == (64, 1, 26, 0)
    args = build_parser().parse_args(["demo", "--top-p", "1", "--temperature", "0.5", "--rl-steps", "0"])
    assert (args.top_p, args.temperature, args.rl_steps) == (1.0, 0.5, 0)
    args = build_parser().parse_args(["train", "--kl-coef", "0", "--lr", "1e-4", "--seed", str(2**32 - 1)])
    assert (args.kl_coef, args.lr, args.seed) == (0.0, 1e-4, 2**32 - 1)


@pytest.mark.parametrize("command", [name for name, _ in subparsers()])
def test_every_flag_has_help_text_shown_by_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Misleading message (issue 11): `routereplay COMMAND --help` runs for every subcommand, and every flag and
    positional argument carries help text that --help shows."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    sub = dict(subparsers())[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{command} {name} has no help text"
        assert name in out
        shown = " ".join(action.help.split("%(default)s")[0].split()[:4])
        assert shown in out, f"{command} {name}: help text {shown!r} not in --help"


def test_train_mode_is_taken_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38 item 20: `train --mode r3` was refused ("invalid choice: 'r3'"); it is R3. A mode that names none
    of them is still refused by argparse."""
    for given, mode in (("r3", "R3"), ("r2", "R2"), ("OFF", "off"), ("R3", "R3")):
        assert build_parser().parse_args(["train", "--mode", given]).mode == mode
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--mode", "r4"])
    assert "invalid choice: 'r4'" in capsys.readouterr().err
