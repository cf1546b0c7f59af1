"""The wire decoders moved from `routereplay.engines.X` to `routereplay.wire.X`; the old paths stay.

External code imports `routereplay.engines.vllm` (and payload, limits, ...) and pickles name
`routereplay.engines.limits.WireLimits`; both must keep working, and `routereplay.wire` must not
pull in the engines package (engines import the decoders, never the other way round).
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest

import routereplay
from routereplay.wire.limits import WireLimits

MOVED = ("vllm", "sglang", "megatron", "payload", "assembler", "limits", "diagnosis")


@pytest.mark.parametrize("name", MOVED)
def test_old_path_exposes_the_same_objects(name: str) -> None:
    """Guards against a shim that drops a name or re-defines one (two `WireLimits` classes would
    make `isinstance` checks and pickles disagree between old and new import paths)."""
    new = importlib.import_module(f"routereplay.wire.{name}")
    old = importlib.import_module(f"routereplay.engines.{name}")
    assert old.__all__ == new.__all__
    for attribute in new.__all__:
        assert getattr(old, attribute) is getattr(new, attribute), f"routereplay.engines.{name}.{attribute}"


def test_package_level_decoders_are_the_wire_ones() -> None:
    """Guards against `routereplay.decode_vllm` / `routereplay.engines.decode_vllm` drifting from the
    decoder in `routereplay.wire` after the move."""
    from routereplay import engines, wire

    for attribute in ("decode_vllm", "decode_sglang", "decode_megatron"):
        assert getattr(routereplay, attribute) is getattr(wire, attribute)
        assert getattr(engines, attribute) is getattr(wire, attribute)


def test_pickle_naming_the_old_module_still_loads() -> None:
    """Guards against pickles written before the move (they name `routereplay.engines.limits`)
    failing to load with ModuleNotFoundError or AttributeError."""
    limits = WireLimits(max_layers=7)
    old_pickle = pickle.dumps(limits, protocol=0).replace(b"routereplay.wire.limits", b"routereplay.engines.limits")
    assert b"routereplay.engines.limits" in old_pickle
    loaded = pickle.loads(old_pickle)
    assert type(loaded) is WireLimits
    assert loaded == limits


def test_wire_does_not_import_engines() -> None:
    """Guards against an import cycle: a wire decoder importing `routereplay.engines` (whose
    `__init__` imports the wire decoders) would make import order decide whether it works."""
    code = (
        "import sys, routereplay.wire.vllm, routereplay.wire.sglang, routereplay.wire.megatron\n"
        "print(sorted(m for m in sys.modules if m.startswith('routereplay.engines')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
