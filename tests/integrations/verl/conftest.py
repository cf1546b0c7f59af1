"""Fixtures of the verl engine tests: one gloo rank, and verl's engine module answering "cpu" for its device."""

from __future__ import annotations

import pytest

from tests.distributed.launch import free_port


@pytest.fixture(scope="module")
def world() -> None:
    pytest.importorskip("verl")
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.fixture
def cpu_engine_module(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's engine module asks the platform for its device; on this CPU machine that is "cpu"."""
    import verl.utils.seqlen_balancing as balancing
    import verl.workers.engine.fsdp.transformer_impl as impl

    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(balancing, "get_device_name", lambda: "cpu")  # dynamic batch size's micro-batch count


@pytest.fixture
def unchecked_verl_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented opt-out: replay verl's own digest-less `routed_experts` under R3 (counted, logged).
    Set in os.environ, so processes the test spawns (the Ulysses ranks) inherit it like Ray workers do."""
    from routereplay.integrations.verl.route_checks import UNCHECKED_ENV

    monkeypatch.setenv(UNCHECKED_ENV, "1")
