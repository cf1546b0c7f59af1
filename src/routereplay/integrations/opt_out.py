"""An integration's opt-out switch: one environment variable that turns a refusal into a counted fallback.

The verl and SkyRL trainers refuse routes that no digest ties to their tokens (`UncheckedRoutesError`) unless the
worker's environment opts out: `ROUTEREPLAY_VERL_UNCHECKED_ROUTES` (verl/route_checks.py) and
`ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES` (skyrl/token_check.py). `env_opt_out` reads such a variable the same way for
both: unset, empty, 0, false or no is off; 1, true or yes is on (any case, blanks around ignored); any other value
is a `ConfigError` that says what each setting does, so a typo never switches a check off or on silently.
"""

from __future__ import annotations

import os

from routereplay.errors import ConfigError

OFF_VALUES = ("", "0", "false", "no")
ON_VALUES = ("1", "true", "yes")


def env_opt_out(name: str, *, on: str, off: str) -> bool:
    """Whether the environment variable `name` opts out; `on` and `off` say, for the error message, what setting
    it to 1 and to 0 (or leaving it unset) does."""
    value = os.environ.get(name, "").strip().lower()
    if value in OFF_VALUES:
        return False
    if value in ON_VALUES:
        return True
    raise ConfigError(f"{name}={os.environ[name]!r}: set it to 1 ({on}) or to 0 / leave it unset ({off})")


__all__ = ["OFF_VALUES", "ON_VALUES", "env_opt_out"]
