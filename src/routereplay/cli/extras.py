"""Optional packages a command needs, checked before its work starts.

A command that trains for minutes and then fails to write its report loses the output. Each command
therefore lists what its flags need (matplotlib for plots, transformers for models, httpx for remote
engines, zstandard for compressed codec files, tensorboard for --tensorboard) and calls `require`
first; a missing package raises `MissingDependencyError` naming the extra that installs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from routereplay.errors import MissingDependencyError


@dataclass(frozen=True, slots=True)
class Extra:
    """How to get one optional package: the module imported to check it, and the install command."""

    module: str
    install: str


EXTRAS: Mapping[str, Extra] = {
    "matplotlib": Extra("matplotlib.backends.backend_agg", "pip install 'routereplay[demo]'"),
    "transformers": Extra("transformers", "pip install 'routereplay[hf]'"),
    "httpx": Extra("httpx", "pip install 'routereplay[serve]'"),
    "zstandard": Extra("zstandard", "pip install 'routereplay[zstd]'"),
    "tensorboard": Extra("torch.utils.tensorboard", "pip install tensorboard"),
}


def importable(module: str) -> bool:
    """True when `module` imports (a broken install counts as missing, as it would fail later)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(command: str, needs: Mapping[str, str], *, extras: Mapping[str, Extra] = EXTRAS) -> None:
    """Refuse to start `command` when a package in `needs` (package -> what needs it) does not import."""
    missing = [(package, why) for package, why in needs.items() if not importable(extras[package].module)]
    if not missing:
        return
    reasons = "; ".join(f"{package} for {why} ({extras[package].install})" for package, why in missing)
    raise MissingDependencyError(f"routereplay {command} needs {reasons}; nothing was run")


__all__ = ["EXTRAS", "Extra", "importable", "require"]
