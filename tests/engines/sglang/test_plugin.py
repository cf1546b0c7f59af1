"""The plugin as SGLang 0.5.23 loads it: its entry point found and run by SGLang's own `load_plugins()`, its hooks
applied by SGLang's `HookRegistry` onto SGLang's own functions; `SGLANG_PLUGINS` honoured; route forcing's
`install(registry)` called where that package exists and tolerated where it does not.

Needs routereplay installed with its entry-point metadata in the SGLang venv (`pip install --no-deps -e .`, as
`make test-sglang` does).
"""

from __future__ import annotations

import importlib
import sys
import types
from importlib.metadata import entry_points
from typing import Any

import pytest

from routereplay.engines.sglang import SamplingTimeRoutes, install
from routereplay.engines.sglang.plugin import FORCING_MODULE
from routereplay.engines.sglang.retraction import FINISH_TARGET, RELEASE_TARGET


def routereplay_entry_point() -> Any:
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "routereplay"]
    assert found, (
        "no `routereplay` entry point in group sglang.srt.plugins here: install routereplay with its metadata into "
        "this venv (pip install --no-deps -e ., as make test-sglang does)"
    )
    return found[0]


def test_entry_point_names_register() -> None:
    from routereplay.engines.sglang import plugin

    assert routereplay_entry_point().load() is plugin.register


def test_load_plugins_applies_the_retraction_hooks(hook_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookType

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    routereplay_entry_point()
    release, collect = schedule_batch.release_req, SchedulerBatchResultProcessor._maybe_collect_routed_experts
    load_plugins()

    assert schedule_batch.release_req is not release and schedule_batch.release_req.__wrapped__ is release
    assert SchedulerBatchResultProcessor._maybe_collect_routed_experts.__wrapped__ is collect
    for target, kind in ((RELEASE_TARGET, HookType.BEFORE), (FINISH_TARGET, HookType.AFTER)):
        ((hook_type, hook, source),) = [h for h in hook_registry._hooks[target] if h[2].plugin_name == "routereplay"]
        assert hook_type is kind
        assert isinstance(hook.__self__, SamplingTimeRoutes)
        assert source.dist_name == "routereplay"
    assert hook_registry._hooks[RELEASE_TARGET][-1][1].__self__ is hook_registry._hooks[FINISH_TARGET][-1][1].__self__


def test_sglang_plugins_whitelist_leaves_sglang_untouched(hook_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers import schedule_batch
    from sglang.srt.plugins import load_plugins

    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    release = schedule_batch.release_req
    load_plugins()

    assert schedule_batch.release_req is release
    assert RELEASE_TARGET not in hook_registry._hooks


def test_install_without_forcing_package(hook_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, FORCING_MODULE, None)  # import of it raises ModuleNotFoundError, name = it
    plugin = install(hook_registry)

    assert plugin.forcing is None
    assert isinstance(plugin.retraction, SamplingTimeRoutes)
    assert [h[1].__self__ for h in hook_registry._hooks[RELEASE_TARGET]][-1] is plugin.retraction


def test_install_calls_forcing_install_with_the_registry(hook_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    forcing = types.ModuleType(FORCING_MODULE)

    def install_forcing(registry: Any, *, sampling_rows: Any) -> str:
        seen.append(registry)
        assert isinstance(sampling_rows.__self__, SamplingTimeRoutes)
        return "forcing state"

    forcing.install = install_forcing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, FORCING_MODULE, forcing)
    plugin = install(hook_registry)

    assert seen == [hook_registry] and plugin.forcing == "forcing state"


def test_a_missing_dependency_of_forcing_is_not_taken_for_its_absence(
    hook_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the forcing package's own absence means "no forcing"; a module it imports that is missing is raised."""
    real_import = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name == FORCING_MODULE:
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="fastapi"):
        install(hook_registry)
