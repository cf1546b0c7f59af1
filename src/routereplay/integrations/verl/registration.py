"""routereplay's FSDP engine in verl's `EngineRegistry`, registered whenever verl's engines are imported.

verl 0.9.1 builds the training engine with `EngineRegistry.new(model_type, strategy, ...)`, which takes the
class registered for (device, vendor) and else the device-only default: its own `FSDPEngineWithLMHead`,
which ignores `router_replay.mode`. `fsdp_engine` registers its subclass under the vendor key, so it must
run once `EngineRegistry` exists, whatever the order of imports:

- `actor_rollout_ref.model.external_lib=routereplay.integrations.verl.fsdp_engine`: verl imports it in a
  worker where `verl.workers` is loaded, and it registers at once;
- `VERL_USE_EXTERNAL_MODULES=routereplay.integrations.verl.fsdp_engine`: `verl/__init__` imports it before
  `verl.workers` exists; and any process may import it before verl. Then `PackageImportHook` (first on
  `sys.meta_path`) wraps the loader of `verl.workers.engine`, the package that defines `EngineRegistry` and
  imports verl's FSDP engines, registers right after that package has run, and leaves `sys.meta_path`.

Registering without either would hand such a process verl's own engine, with replay off and nothing said.
The hook imports nothing itself and changes no verl file; the module keeps verl's own loader.

verl's agent loops go the same way (`register_agent_loops_when_verl_loads`): `fsdp_engine` is imported in every
`AgentLoopWorker` too (verl's `HFModelConfig` imports `external_lib`), where verl's agent-loop package is loaded,
and registers routereplay's checked `single_turn_agent` / `tool_agent` at once (`checked_loops.py`); a process that
imports it first gets them right after `verl.experimental.agent_loop` has registered verl's own loops. verl's
`RolloutReplicaRegistry` likewise (`register_sglang_replica_when_verl_loads`): "sglang" names routereplay's SGLang
server (`tokenizer_routes.register_sglang_replica`) once `verl.workers.rollout.replica` has run.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

from routereplay.errors import ConfigError, RouteReplayError

ENGINE_PACKAGE = "verl.workers.engine"  # defines EngineRegistry and imports verl's FSDP engines
LOADED_MARKERS = (ENGINE_PACKAGE, "verl.workers.config")  # either loaded: verl is in use, register now
HOOK_MARK = "routereplay_verl_engine_hook"  # attribute naming our hook on sys.meta_path (survives reloads)
AGENT_LOOP_PACKAGE = "verl.experimental.agent_loop"  # its __init__ imports verl's loops, which register themselves
AGENT_LOOP_HOOK_MARK = "routereplay_verl_agent_loop_hook"
REPLICA_MODULE = "verl.workers.rollout.replica"  # defines RolloutReplicaRegistry, registers verl's "sglang" loader
REPLICA_HOOK_MARK = "routereplay_verl_replica_hook"


def register_under(cls: type, vendor: str, devices: Sequence[str]) -> None:
    """Register `cls` for language_model / fsdp and fsdp2 on each (device, vendor). Idempotent; a key held by
    another class is a `ConfigError` (verl's `register` would assert)."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        free = []
        for device in devices:
            held = table.get(backend, {}).get((device, vendor))
            if held is None:
                free.append(device)
            elif held is not cls:
                raise ConfigError(
                    f"verl's EngineRegistry already maps language_model/{backend} on ({device}, {vendor}) to "
                    f"{held.__name__}; routereplay's engine would replace it: unregister that engine first"
                )
        if free:
            EngineRegistry.register(model_type="language_model", backend=backend, device=free, vendor=vendor)(cls)


def register_when_verl_loads(register: Callable[[], object]) -> None:
    """Call `register` now if verl's workers are loaded, else right after `verl.workers.engine` is imported."""
    when_loaded(ENGINE_PACKAGE, LOADED_MARKERS, HOOK_MARK, register, "routereplay's FSDP engine")


def register_agent_loops_when_verl_loads(register: Callable[[], object]) -> None:
    """Call `register` now if verl's agent-loop package is loaded, else right after it is imported."""
    when_loaded(AGENT_LOOP_PACKAGE, (AGENT_LOOP_PACKAGE,), AGENT_LOOP_HOOK_MARK, register, "routereplay's agent loops")


def register_sglang_replica_when_verl_loads(register: Callable[[], object]) -> None:
    """Call `register` now if verl's rollout-replica registry is loaded, else right after it is imported."""
    when_loaded(REPLICA_MODULE, (REPLICA_MODULE,), REPLICA_HOOK_MARK, register, "routereplay's SGLang server")


def when_loaded(package: str, markers: Sequence[str], mark: str, register: Callable[[], object], what: str) -> None:
    """`register` now if any of `markers` is imported, else from a hook (marked `mark`) once `package` has run."""
    if any(name in sys.modules for name in markers):
        run(register, what)
    elif not any(getattr(finder, mark, False) for finder in sys.meta_path):
        sys.meta_path.insert(0, PackageImportHook(register, package=package, mark=mark, what=what))


def run(register: Callable[[], object], what: str = "routereplay's FSDP engine") -> None:
    try:
        register()
    except RouteReplayError:
        raise
    except Exception as err:  # verl too old or too new for this engine: say so where it is imported
        raise ConfigError(f"registering {what} with verl failed: {err}") from err


class PackageImportHook(importlib.abc.MetaPathFinder):
    """Finds `package` (`verl.workers.engine` by default) through the other finders and gives it a loader that
    registers after it. The hook carries the attribute `mark` (True), by which `when_loaded` finds it."""

    def __init__(
        self,
        register: Callable[[], object],
        *,
        package: str = ENGINE_PACKAGE,
        mark: str = HOOK_MARK,
        what: str = "routereplay's FSDP engine",
    ) -> None:
        self.register, self.package, self.what = register, package, what
        setattr(self, mark, True)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.package:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = RegisteringLoader(spec.loader, self)
                return spec
        return None

    def leave(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class RegisteringLoader(importlib.abc.Loader):
    """verl's loader for `verl.workers.engine`, then the registration (the module keeps verl's loader)."""

    def __init__(self, loader: importlib.abc.Loader, hook: PackageImportHook) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.hook.leave()
        run(self.hook.register, self.hook.what)


__all__ = [
    "AGENT_LOOP_PACKAGE",
    "ENGINE_PACKAGE",
    "PackageImportHook",
    "register_agent_loops_when_verl_loads",
    "register_sglang_replica_when_verl_loads",
    "register_under",
    "register_when_verl_loads",
]
