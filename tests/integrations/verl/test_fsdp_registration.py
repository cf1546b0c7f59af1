"""verl's `EngineRegistry` hands out routereplay's engine whatever the order of imports (fresh processes).

verl 0.9.1 imports `VERL_USE_EXTERNAL_MODULES` from `verl/__init__`, before `verl.workers` exists, and
any process may import the engine module before verl. Each case runs in a fresh interpreter of this
venv with the real verl, and asks verl's own `EngineRegistry.get_engine_cls` which class it would build
for language_model / fsdp and fsdp2 (`VERL_ENGINE_DEVICE=cuda`: this CPU machine's device has no FSDP
engine in verl; the vendor is verl's platform fallback, "nvidia", or `VERL_ENGINE_VENDOR`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.verl

MODULE = "routereplay.integrations.verl.fsdp_engine"
REPORT = """
import json, sys
{imports}
from verl.workers.engine import EngineRegistry
import verl.workers.engine as package
from routereplay.integrations.verl.registration import HOOK_MARK
print(json.dumps({{
    "early": early,
    "engines": [EngineRegistry.get_engine_cls("language_model", b).__name__ for b in ("fsdp", "fsdp2")],
    "value_model": EngineRegistry.get_engine_cls("value_model", "fsdp").__name__,
    "hooks_left": sum(bool(getattr(f, HOOK_MARK, False)) for f in sys.meta_path),
    "loader": type(package.__loader__).__name__,
}}))
"""
VERL_INIT_FIRST = f"""
import verl
early = "verl.workers.engine" not in sys.modules and "{MODULE}" in sys.modules
"""
MODULE_FIRST = f"""
import {MODULE}
early = "verl" not in sys.modules
"""
VERL_WORKERS_FIRST = f"""
import verl.workers.config
import {MODULE}
early = False
"""


def _report(imports: str, **env: str) -> dict:
    pytest.importorskip("verl")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    environ.update(VERL_ENGINE_DEVICE="cuda", OMP_NUM_THREADS="1", **env)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", REPORT.format(imports=imports)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_verl_use_external_modules_imports_it_before_verl_workers_and_verl_builds_routereplays_engine() -> None:
    got = _report(VERL_INIT_FIRST, VERL_USE_EXTERNAL_MODULES=MODULE)
    assert got["early"], "verl/__init__ must import the module before verl.workers exists, or this tests nothing"
    assert got["engines"] == ["RouteReplayFSDPEngine"] * 2, got
    assert got["value_model"] == "FSDPEngineWithValueHead"
    assert got["hooks_left"] == 0 and got["loader"] == "SourceFileLoader", "the hook leaves and verl's loader stays"


def test_module_imported_before_verl_registers_when_verl_engines_load() -> None:
    got = _report(MODULE_FIRST)
    assert got["early"]
    assert got["engines"] == ["RouteReplayFSDPEngine"] * 2, got
    assert got["hooks_left"] == 0


def test_module_imported_after_verl_workers_registers_at_once_and_under_verl_engine_vendor() -> None:
    got = _report(VERL_WORKERS_FIRST, VERL_ENGINE_VENDOR="metax")
    assert got["engines"] == ["RouteReplayFSDPEngine"] * 2, "VERL_ENGINE_VENDOR's key must hold the engine too"
    assert got["hooks_left"] == 0


AGENT_LOOPS_REPORT = f"""
import json, sys
import {MODULE}
early = "verl.experimental.agent_loop" not in sys.modules
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from routereplay.integrations.verl.registration import AGENT_LOOP_HOOK_MARK
print(json.dumps({{
    "early": early,
    "loops": {{name: _agent_loop_registry[name]["_target_"] for name in ("single_turn_agent", "tool_agent")}},
    "hooks_left": sum(bool(getattr(f, AGENT_LOOP_HOOK_MARK, False)) for f in sys.meta_path),
}}))
"""


def test_module_imported_before_verls_agent_loops_registers_the_checked_loops_once_verl_has_registered_its_own() -> (
    None
):
    """An AgentLoopWorker imports the module (verl's HFModelConfig imports `external_lib`) after verl's loops are
    registered (tests/integrations/verl/test_agent_loops.py); a process that imports it first must not lose the
    names to verl's own `@register` running later."""
    pytest.importorskip("verl")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", AGENT_LOOPS_REPORT],
        capture_output=True,
        text=True,
        env={**environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["early"], "the module must load before verl's agent loops, or this tests nothing"
    assert got["loops"] == {
        "single_turn_agent": "routereplay.integrations.verl.checked_loops.RouteCheckedSingleTurnAgentLoop",
        "tool_agent": "routereplay.integrations.verl.checked_loops.RouteCheckedToolAgentLoop",
    }
    assert got["hooks_left"] == 0
