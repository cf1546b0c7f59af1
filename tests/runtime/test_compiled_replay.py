"""Replay inside `torch.compile`d MoE blocks (issue 15 item 4): the router path holds no host sync, so
dynamo traces it whole, and compiled replay chooses and computes exactly what eager replay does.

The blocks use HF's `batched_mm` experts: the default `eager` experts loop over `nonzero()` hits,
a data-dependent graph break of HF's own, not of the router.

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens, H = hidden size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf

LAYERS, TOP_K, EXPERTS = 3, 2, 8
TIMEOUT_S = 120  # only a guard against a hung thread; nothing is timed


class _GraphCounter:
    """A torch.compile backend that counts the graphs dynamo hands it and runs them as captured."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return graph.forward


@dataclass(frozen=True, slots=True)
class _Pass:
    """What one replayed forward + backward produced."""

    logits: torch.Tensor
    routes_BSLK: torch.Tensor  # the routes used (forced ids, live choice on -1 rows)
    counts: tuple[int, int, int, dict[int, int]]  # router_calls, replayed_rows, fallback_rows, by layer
    gate_grads: tuple[torch.Tensor, ...]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # compiled graphs live on the blocks' shared code object, across models
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    model = tiny_qwen3(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    model.config._experts_implementation = "batched_mm"
    return model


def _compile_blocks(model: torch.nn.Module, backend: _GraphCounter) -> None:
    for layer in model.model.layers:
        layer.mlp.compile(backend=backend, fullgraph=True)  # fullgraph: any graph break is an error


def _batches() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, routes) with -1 rows in every layer, in none, and in one layer only."""
    ids_BS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    full_BS = torch.ones_like(ids_BS)
    padded_BS = full_BS.clone()
    padded_BS[0, :2] = 0  # left padding: its -1 rows route live but count as neither
    every = random_routes(2, 6, LAYERS, TOP_K, EXPERTS, seed=1)
    every[0, :2] = -1
    every[1, 3, 1] = -1  # one attended fallback row, in layer 1
    one = random_routes(2, 6, LAYERS, TOP_K, EXPERTS, seed=3)
    one[0, 4, 1] = -1
    return {
        "fallback in every layer": (ids_BS, padded_BS, every),
        "no fallback": (ids_BS, full_BS, random_routes(2, 6, LAYERS, TOP_K, EXPERTS, seed=2)),
        "fallback in layer 1 only": (ids_BS, full_BS, one),
    }


def _replay(
    model: torch.nn.Module, replayer: Any, batch: tuple[torch.Tensor, ...], gates: list[torch.nn.Module] | None = None
) -> _Pass:
    """One replayed forward + backward; gradients of `gates` (default: every layer's `mlp.gate`)."""
    ids_BS, mask_BS, routes_BSLK = batch
    replayer.stats.reset()
    model.zero_grad(set_to_none=True)
    with replayer.replay(routes_BSLK, attention_mask=mask_BS) as used:
        logits = model(input_ids=ids_BS, attention_mask=mask_BS).logits
        logits.float().square().mean().backward()
        routes_used = used.routes
    stats = replayer.stats
    counts = (stats.router_calls, stats.replayed_rows, stats.fallback_rows, dict(stats.fallback_rows_by_layer))
    gates = gates if gates is not None else [layer.mlp.gate for layer in model.model.layers]
    grads = tuple(gate.weight.grad.clone() for gate in gates)
    return _Pass(logits.detach(), routes_used, counts, grads)


def test_compiled_blocks_replay_as_eager_in_one_graph_per_variant() -> None:
    """Host sync and graph break per router per micro-batch (issue 15 item 4): every router call decided
    its -1 rows with `bool(fallback.any())` and counted rows with `.tolist()`, a device->host sync on GPU
    and a graph break per router under torch.compile. Now the -1 layers are known on the host when the
    routes are set: the blocks compile with fullgraph=True, one graph serves every layer (one per
    fallback variant, no recompile per batch), and logits, routes used, counts and gate gradients equal
    eager replay bit for bit, with -1 rows in every layer, in none, and in one layer only."""
    from routereplay.runtime import attach

    model = _model()
    replayer = attach(model)
    batches = _batches()
    eager = {name: _replay(model, replayer, batch) for name, batch in batches.items()}
    backend = _GraphCounter()
    _compile_blocks(model, backend)
    for name, batch in batches.items():
        compiled = _replay(model, replayer, batch)
        reference = eager[name]
        assert torch.equal(compiled.routes_BSLK, reference.routes_BSLK), f"{name}: compiled replay chose other experts"
        assert torch.equal(compiled.logits, reference.logits), f"{name}: compiled replay computed other logits"
        assert compiled.counts == reference.counts, f"{name}: compiled replay counted {compiled.counts}"
        for layer, (got, want) in enumerate(zip(compiled.gate_grads, reference.gate_grads, strict=True)):
            assert torch.equal(got, want), f"{name}: layer {layer}'s gate gradient differs from eager replay"
    assert eager["no fallback"].counts == (3, 2 * 6 * LAYERS, 0, {})  # controls: the variants differ
    assert eager["fallback in every layer"].counts == (3, 10 * LAYERS - 1, 1, {1: 1})
    assert eager["fallback in layer 1 only"].counts == (3, 12 * LAYERS - 1, 1, {1: 1})
    assert backend.graphs == 2, f"{backend.graphs} graphs: want one per fallback variant, shared by all layers"
    for batch in batches.values():
        _replay(model, replayer, batch)
    assert backend.graphs == 2, "a later batch recompiled the blocks"


class _Checkpointed(torch.nn.Module):
    """Activation checkpointing around a (compiled) MoE block, as an eager wrapper."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, hidden_BSH, use_reentrant=False)


def test_checkpointed_compiled_blocks_recompute_the_replayed_routes() -> None:
    """Natural routing in a recompute under torch.compile: a compiled router takes its forward path in a
    checkpoint recompute (dynamo cannot guard on the autograd engine), so the recompute must still force
    the replayed routes: logits, routes used and gate gradients equal the eager checkpointed replay."""
    from routereplay.runtime import attach

    model = _model()
    blocks = [layer.mlp for layer in model.model.layers]
    for layer, block in zip(model.model.layers, blocks, strict=True):
        layer.mlp = _Checkpointed(block)
    replayer = attach(model)
    batch = _batches()["fallback in every layer"]
    gates = [block.gate for block in blocks]
    eager = _replay(model, replayer, batch, gates)
    assert replayer.stats.recompute_calls == LAYERS  # control: eager recomputed every block's router
    backend = _GraphCounter()
    for block in blocks:
        block.compile(backend=backend, fullgraph=True)
    compiled = _replay(model, replayer, batch, gates)
    assert backend.graphs == 1, "the checkpointed blocks did not run compiled"
    assert torch.equal(compiled.logits, eager.logits) and torch.equal(compiled.routes_BSLK, eager.routes_BSLK)
    gradients = zip(compiled.gate_grads, eager.gate_grads, strict=True)
    assert all(torch.equal(got, want) for got, want in gradients), "gradients differ"
    assert compiled.counts[1:3] == eager.counts[1:3]  # replayed rows, fallback rows


def test_compiled_blocks_record_the_routes_eager_record_keeps() -> None:
    """Lost or misplaced recordings under torch.compile: a compiled router leaves its choice for the host
    to fold at the next forward (counting inside the graph would recompile it per call), so a record
    context of two forwards must still keep each forward's own routes and count its rows, as eager."""
    from routereplay.runtime import attach

    model = _model()
    replayer = attach(model)
    ids_BS, mask_BS, _ = _batches()["no fallback"]
    second_BS = ids_BS.flip(1)

    def record() -> tuple[list[torch.Tensor], int, int]:
        replayer.stats.reset()
        with torch.no_grad(), replayer.record() as rec:
            model(input_ids=ids_BS, attention_mask=mask_BS)
            model(input_ids=second_BS, attention_mask=mask_BS)
        return rec.steps, replayer.stats.recorded_rows, replayer.stats.router_calls

    eager_steps, eager_rows, eager_calls = record()
    _compile_blocks(model, _GraphCounter())
    steps, rows, calls = record()
    assert len(steps) == 2 and all(torch.equal(a, b) for a, b in zip(steps, eager_steps, strict=True))
    assert not torch.equal(steps[0], steps[1])  # control: each forward kept its own routes
    assert (rows, calls) == (eager_rows, eager_calls) == (2 * 12 * LAYERS, 2 * LAYERS)


def test_explain_finds_no_graph_break_in_a_replayed_moe_block() -> None:
    """Graph break per router (issue 15 item 4): `torch._dynamo.explain` of one MoE block called inside a
    replay context (with -1 rows, so the live top-k runs too) finds one graph and no break; before, the
    router's `bool(tensor)` and `.tolist()` broke it (and the thread and backward checks)."""
    from routereplay.runtime import attach

    model = _model()
    replayer = attach(model)
    routes_1TLK = random_routes(1, 12, LAYERS, TOP_K, EXPERTS, seed=4)
    routes_1TLK[0, 5] = -1
    hidden_1TH = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    block = model.model.layers[0].mlp
    with torch.no_grad(), replayer.replay(routes_1TLK):
        explained = torch._dynamo.explain(block)(hidden_1TH)
    reasons = [reason.reason.splitlines()[0] for reason in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), f"graph breaks: {reasons}"
    assert replayer.stats.router_calls == 1 and replayer.stats.fallback_rows == 1


def test_a_compiled_block_routes_naturally_on_a_thread_without_the_context() -> None:
    """Replay leaking across threads under torch.compile: ownership is read through a thread-local that
    dynamo guards per calling thread, so while the main thread replays, another thread running the same
    compiled blocks routes naturally, and the main thread's replay is still exact."""
    from routereplay.runtime import attach

    model = _model()
    ids_BS, mask_BS, routes_BSLK = _batches()["no fallback"]
    with torch.no_grad():
        natural = model(input_ids=ids_BS, attention_mask=mask_BS).logits
    replayer = attach(model)
    with torch.no_grad(), replayer.replay(routes_BSLK, attention_mask=mask_BS):
        replayed = model(input_ids=ids_BS, attention_mask=mask_BS).logits
    _compile_blocks(model, _GraphCounter())
    replayer.stats.reset()
    result: dict[str, torch.Tensor] = {}

    def other_thread() -> None:
        with torch.no_grad():
            result["logits"] = model(input_ids=ids_BS, attention_mask=mask_BS).logits

    with torch.no_grad(), replayer.replay(routes_BSLK, attention_mask=mask_BS) as used:
        owner = model(input_ids=ids_BS, attention_mask=mask_BS).logits
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(TIMEOUT_S)
        again = model(input_ids=ids_BS, attention_mask=mask_BS).logits
    assert not thread.is_alive(), "the second thread did not finish"
    assert torch.equal(result["logits"], natural), "the other thread's compiled forward used the replayed routes"
    assert torch.equal(owner, replayed) and torch.equal(again, replayed)
    assert not torch.equal(natural, replayed)  # control: the forced routes change the logits
    assert used.stats.forwards == 2 and used.stats.router_calls == 2 * LAYERS  # the other thread is not counted


@pytest.mark.gpu
def test_replay_on_cuda_never_waits_for_the_device_in_a_router_call() -> None:
    """Host sync per router per micro-batch (issue 15 item 4): on CUDA, `bool(fallback.any())` and the
    counting `.tolist()` made every router call wait for the device. With CUDA's sync debug mode set to
    error, a replayed MoE block's forward and backward run without one sync, with -1 rows and without;
    entering the context (reading the routes on the host once) is outside the checked region."""
    from routereplay.runtime import attach

    model = _model().cuda()
    replayer = attach(model)
    block = model.model.layers[0].mlp
    for fallbacks in (1, 0):
        routes_1TLK = random_routes(1, 64, LAYERS, TOP_K, EXPERTS, seed=fallbacks)
        routes_1TLK[0, :fallbacks] = -1
        hidden_1TH = torch.randn(1, 64, model.config.hidden_size, device="cuda", requires_grad=True)
        replayer.stats.reset()
        with replayer.replay(routes_1TLK):
            torch.cuda.set_sync_debug_mode("error")
            try:
                block(hidden_1TH).float().square().mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert (replayer.stats.router_calls, replayer.stats.fallback_rows) == (1, fallbacks)
        assert hidden_1TH.grad is not None and bool(hidden_1TH.grad.abs().sum() > 0)
