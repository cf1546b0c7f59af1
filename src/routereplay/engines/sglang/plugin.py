"""The routereplay SGLang plugin: the `sglang.srt.plugins` entry point and what it registers.

Installed with the `sglang` extra, `register` is listed under SGLang's entry-point group `sglang.srt.plugins`
(pyproject.toml, name `routereplay`), so SGLang's own `load_plugins()` calls it in every process it starts (the
launcher, the engine, each scheduler subprocess before `Scheduler()` is built) and then applies the hooks
(`HookRegistry.apply_hooks()`); `SGLANG_PLUGINS=routereplay` keeps it when other plugins are whitelisted away.
It registers, on SGLang's `HookRegistry`:
- sampling-time routes across retraction (`retraction.SamplingTimeRoutes`): a retracted request returns, at
  finish, the route each row had when it was first computed, not the re-prefill's;
- route forcing (`routereplay.engines.sglang.forcing.install(registry)`), where that package is present, given the
  retraction's kept rows (a retracted request's re-prefill can be forced with them).

`install(registry)` does the same on a registry it is given (tests, or an embedding that loads no entry points)
and returns what it registered. Importing this module does not import SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from routereplay.engines.sglang.retraction import SamplingTimeRoutes

FORCING_MODULE = "routereplay.engines.sglang.forcing"


@dataclass(slots=True)
class SGLangPlugin:
    """What one `install` registered: the retraction state, and route forcing's own object (None without it)."""

    retraction: SamplingTimeRoutes
    forcing: Any


def install(registry: Any) -> SGLangPlugin:
    """Register every routereplay hook on `registry` (SGLang's `HookRegistry`); the caller applies them."""
    retraction = SamplingTimeRoutes()
    retraction.install(registry)
    return SGLangPlugin(retraction=retraction, forcing=_install_forcing(registry, retraction))


def register() -> None:
    """The `sglang.srt.plugins` entry point: `load_plugins()` calls it, then applies the hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    install(HookRegistry)


def _install_forcing(registry: Any, retraction: SamplingTimeRoutes) -> Any:
    """Route forcing's `install(registry, sampling_rows=...)` where `routereplay.engines.sglang.forcing` exists
    (a forced re-prefill reads the retraction's kept rows); None where it does not (an ImportError from inside that
    package is not swallowed)."""
    import importlib

    try:
        forcing = importlib.import_module(FORCING_MODULE)
    except ModuleNotFoundError as error:
        if error.name != FORCING_MODULE:
            raise
        return None
    return forcing.install(registry, sampling_rows=retraction.sampling_rows)
