"""Shared fixtures, and the one place where optional-dependency markers turn into skips.

Markers are declared in pyproject.toml ([tool.pytest.ini_options].markers); a test marked `hf`,
`megatron`, `zstd` or `gpu` is skipped with a reason only when that dependency is missing here.

Hypothesis runs under one project-wide profile (`routereplay`): no per-example deadline and no
`too_slow` health check, because both are wall-clock limits that fail on a busy machine (issue 11
item 26); time targets live in the benchmarks (`routereplay bench`), not in tests.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

HYPOTHESIS_PROFILE = "routereplay"
HYPOTHESIS_MAX_EXAMPLES = 100

settings.register_profile(
    HYPOTHESIS_PROFILE,
    deadline=None,
    max_examples=HYPOTHESIS_MAX_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(HYPOTHESIS_PROFILE)

OPTIONAL = {
    "hf": ("transformers", "pip install 'routereplay[hf]'"),
    "megatron": ("megatron.core", "pip install 'routereplay[megatron]'"),
    "zstd": ("zstandard", "pip install 'routereplay[zstd]'"),
}


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, (module, fix) in OPTIONAL.items():
            if marker in item.keywords and not _has_module(module):
                item.add_marker(pytest.mark.skip(reason=f"{module} is not installed ({fix})"))
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
