"""An integration's framework import (`integrations.framework.Framework`): absent or too old is refused."""

from __future__ import annotations

import pytest

from routereplay.errors import MissingDependencyError
from routereplay.integrations.framework import Framework


def _numpy(oldest: tuple[int, int], module: str = "numpy") -> Framework:
    return Framework(
        module=module,
        label="NumPy",
        oldest=oldest,
        needed_by="routereplay.integrations.example",
        requirement=f"needs NumPy >= {oldest[0]}.{oldest[1]}",
        install_hint="pip install 'routereplay[example]'",
    )


def test_a_present_framework_comes_with_its_version() -> None:
    import numpy

    module, version = _numpy((1, 0)).imported()
    assert module is numpy and version == numpy.__version__


def test_an_absent_framework_names_the_module_that_needs_it_and_the_extra() -> None:
    absent = _numpy((1, 0), module="routereplay_no_such_framework")
    with pytest.raises(MissingDependencyError, match=r"example needs NumPy: pip install 'routereplay\[example\]'"):
        absent.imported()


def test_a_too_old_framework_names_the_version_found() -> None:
    import numpy

    with pytest.raises(
        MissingDependencyError, match=rf"needs NumPy >= 999.0; numpy {numpy.__version__} is installed: pip"
    ):
        _numpy((999, 0)).imported()
