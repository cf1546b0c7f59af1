"""The test suite's own hygiene: no wall-clock limits inside tests (issue 11 item 26)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def test_hypothesis_profile_has_no_deadline() -> None:
    """Timed test in disguise (issue 11 item 26): hypothesis' default 200 ms deadline failed
    tests/layout under load; the conftest profile turns deadlines off project-wide."""
    assert settings.get_current_profile_name() == "routereplay"
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check
    assert 1 <= settings.default.max_examples <= 200


@given(st.integers())
def test_undecorated_given_inherits_profile(value: int) -> None:
    """Timed test in disguise (issue 11 item 26): a @given test without its own @settings runs
    with the profile's settings, so it has no deadline either."""
    assert isinstance(value, int)
    assert settings().deadline is None
