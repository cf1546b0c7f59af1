"""`env_opt_out`: the environment switch of the verl and SkyRL token checks, read the same way by both."""

from __future__ import annotations

import pytest

from routereplay.errors import ConfigError
from routereplay.integrations.opt_out import env_opt_out
from routereplay.integrations.skyrl import token_check
from routereplay.integrations.verl import route_checks

NAME = "ROUTEREPLAY_TEST_OPT_OUT"


@pytest.mark.parametrize(
    ("value", "expected"), [("", False), (" 0 ", False), ("No", False), ("TRUE", True), ("1", True)]
)
def test_values_switch_it_off_and_on(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(NAME, value)
    assert env_opt_out(NAME, on="skip", off="refuse") is expected


def test_unset_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_opt_out(NAME, on="skip", off="refuse") is False


def test_another_value_is_refused_naming_both_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "on")
    with pytest.raises(ConfigError, match=r"ROUTEREPLAY_TEST_OPT_OUT='on': set it to 1 \(skip\) or to 0 .*\(refuse\)"):
        env_opt_out(NAME, on="skip", off="refuse")


@pytest.mark.parametrize("module", [token_check, route_checks], ids=["skyrl", "verl"])
def test_each_trainer_reads_its_own_variable(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    env = module.UNCHECKED_ENV  # type: ignore[attr-defined]
    monkeypatch.setenv(env, "yes")
    assert module.unchecked_opt_out() is True  # type: ignore[attr-defined]
    monkeypatch.setenv(env, "maybe")
    with pytest.raises(ConfigError, match=f"{env}='maybe': set it to 1 .*refuse them"):
        module.unchecked_opt_out()  # type: ignore[attr-defined]
