"""The SGLang tests' gate, their test-venv shims, and fixtures over SGLang's own process state.

These tests run real SGLang 0.5.23 code in its own venv (`make test-sglang`: `.venv-sglang`, sglang --no-deps plus
what the tested modules import). Every test here needs SGLang: the `sglang` fixture below is autouse and skips where
`sglang.srt` does not import (the main venv, which collects and skips them). Test modules that import SGLang at
module level use `pytest.importorskip` the same way.

Two shims, test-venv only, both named in the Makefile and docs/sglang.md; users on SGLang's CUDA stack need neither:
- torchvision: the registry's torchvision 0.28.0 for the pinned torch 2.13.0 is the CUDA build, whose `_C.so` needs
  `libtorch_cuda.so`; beside the CPU torch it fails to load, and torchvision's import then stops at
  `register_fake("torchvision::nms")` ("operator torchvision::nms does not exist"). SGLang imports torchvision only
  for its image processors (pulled in by `sglang.srt.configs` at import). Where `_C.so` does not load,
  `install_shims()` declares the two operator schemas torchvision registers fakes for unconditionally (`nms`,
  `qnms`), so torchvision's Python parts import; its C++ ops stay absent and raise if called.
- pinned host memory: SGLang allocates the routed-experts host buffer pinned and CUDA-host-registered
  (`ALLOC_MEMORY_FUNCS`, `mem_cache/pool_host/common.py`), which a CPU-only torch cannot do; the `cpu_host_buffers`
  fixture allocates it with plain `torch.empty` (same shape and dtype) for device "cpu", for one test.
"""

from __future__ import annotations

import importlib.util
import pkgutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.engines.sglang.tiny_model import tiny_qwen3_moe_config

_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list[Any] = []  # the torchvision schema library must outlive the session (torch drops it when freed)


def _torchvision_ops_load() -> bool:
    """Whether the installed torchvision's `_C` extension loads (what torchvision's own `extension.py` tries)."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torchvision: nothing to shim
    for folder in spec.submodule_search_locations:
        for library in Path(folder).glob("_C*.so"):
            try:
                torch.ops.load_library(str(library))
            except OSError:
                return False
            return True
    return False


def install_shims() -> None:
    """The torchvision shim, idempotent, only where SGLang is installed and torchvision's ops do not load."""
    if importlib.util.find_spec("sglang") is None or "torchvision" in sys.modules or _LIBRARIES:
        return
    if _torchvision_ops_load():
        return
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for schema in _TORCHVISION_SCHEMAS:
        library.define(schema)
    _LIBRARIES.append(library)


install_shims()


@pytest.fixture(autouse=True)
def sglang() -> Any:
    """The gate: every test in this folder needs SGLang 0.5.23 (`make test-sglang`)."""
    return pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed here (make test-sglang)")


@pytest.fixture
def cpu_host_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's host state buffers for device "cpu" as plain tensors (the pinned-host-memory shim, above)."""
    import torch
    from sglang.srt.mem_cache.pool_host import common

    def alloc_plain(shape: Any, dtype: torch.dtype, device: str, pin_memory: bool, allocator: Any) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", alloc_plain)


@contextmanager
def _published(**overrides: Any) -> Iterator[Any]:
    """SGLang's process-wide config published, as SGLang's own `published_topology` test helper does
    (`sglang/test/test_utils.py`, which itself imports benchmark deps this venv lacks): a CPU `ServerArgs` with
    routed-experts capture on (and `overrides`), WORLD rank 0; the context is reset after."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        enable_return_routed_experts=True,
        chunked_prefill_size=64,
        max_running_requests=4,
        **overrides,
    )
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield server_args
    finally:
        reset_context()


@pytest.fixture
def published() -> Iterator[Any]:
    """SGLang's process-wide config (`_published`) for one test."""
    with _published() as server_args:
        yield server_args


@pytest.fixture
def published_sync() -> Iterator[Any]:
    """`published` with the non-overlap scheduler (the capturer copies each forward's rows to its host buffer
    inside `ModelRunner.forward`)."""
    with _published(disable_overlap_schedule=True) as server_args:
        yield server_args


@pytest.fixture
def model_config(tmp_path: Path) -> Any:
    """SGLang's own `ModelConfig` of the tiny Qwen3-MoE (`tiny_model.py`), saved to a temporary folder."""
    from sglang.srt.configs.model_config import ModelConfig

    tiny_qwen3_moe_config().save_pretrained(tmp_path)
    return ModelConfig(str(tmp_path))


@pytest.fixture
def hook_registry() -> Iterator[Any]:
    """SGLang's `HookRegistry` (class-level state) for one test: the test registers and applies hooks (directly or
    through `load_plugins()`); afterwards every target patched during the test is put back, in its own module and
    in every module `_propagate_patch` rebound, and the registry and `load_plugins`' once-only flag are restored."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks_before = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    patched_before = set(HookRegistry._patched)
    loaded_before = plugins._plugins_loaded
    plugins._plugins_loaded = False
    try:
        yield HookRegistry
    finally:
        for target in HookRegistry._patched - patched_before:
            _unpatch(target, len(HookRegistry._hooks.get(target, [])) - len(hooks_before.get(target, [])))
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(hooks_before)
        HookRegistry._patched.clear()
        HookRegistry._patched.update(patched_before)
        plugins._plugins_loaded = loaded_before


@pytest.fixture
def plugin_env() -> dict[str, str]:
    """Environment variables the server is started with (a test parametrizes it)."""
    return {}


@pytest.fixture
def plugin(hook_registry: Any, monkeypatch: pytest.MonkeyPatch, plugin_env: dict[str, str]) -> Any:
    """The routereplay plugin as SGLang loads it: `load_plugins()` runs the entry point and applies the hooks; the
    objects it registered are read back from SGLang's `HookRegistry`."""
    from sglang.srt.plugins import load_plugins

    from routereplay.engines.sglang import SGLangPlugin
    from routereplay.engines.sglang.forcing import SGLangForcing
    from routereplay.engines.sglang.forcing.requests import REPREFILL_ENV
    from routereplay.engines.sglang.retraction import SamplingTimeRoutes

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv(REPREFILL_ENV, raising=False)
    for name, value in plugin_env.items():
        monkeypatch.setenv(name, value)
    load_plugins()
    owners = [
        hook.__self__
        for hooks in hook_registry._hooks.values()
        for _, hook, source in hooks
        if source is not None and source.plugin_name == "routereplay"
    ]
    forcing = list({id(o): o for o in owners if isinstance(o, SGLangForcing)}.values())
    retraction = list({id(o): o for o in owners if isinstance(o, SamplingTimeRoutes)}.values())
    assert len(forcing) == 1 and len(retraction) == 1, owners
    return SGLangPlugin(retraction=retraction[0], forcing=forcing[0])


def _unpatch(target: str, layers: int) -> None:
    """Undo `HookRegistry._apply_target` for one target wrapped by `layers` function hooks."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    current = raw.__func__ if kind is not None else raw
    original = current
    for _ in range(layers):
        original = original.__wrapped__
    setattr(owner, name, kind(original) if kind is not None else original)
    for module in list(sys.modules.values()):
        if module is None or module is owner:
            continue
        try:
            names = [key for key, value in vars(module).items() if value is current]
        except TypeError:
            continue
        for key in names:
            setattr(module, key, original)
