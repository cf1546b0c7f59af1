"""A replayed step reads no device value: checked on CPU by counting what would sync a GPU host.

A GPU host syncs when it reads a device value: `.item()`, `bool(tensor)`, `.tolist()`, `.numpy()`,
`.cpu()`, and the ops whose output size depends on values (`nonzero`, `masked_select`, `unique`,
boolean indexing, `repeat_interleave` without a size, `equal`). `SyncCounter` records each of them
made on a *device* tensor while a whole step runs: the model's parameters, its inputs and every
tensor computed from them are device tensors; the routes and the mask the test hands over on the
host (numpy, as an engine delivers them) and what the replayer derives from them on the host are not.

`attach(model, sync_free=True)` runs the accelerator path on CPU (the CPU's set-order fast path,
which reads a flag, is off), so the count covers what runs on a GPU. On the code before sync-free
replay the counter found a `bool()` per router call in set order (the CPU fast path's flag: there was
no way to run the device path on CPU), a `.cpu()` of each forward's `input_ids` for traces with token
ids, and two device->host copies of device routes at entry (now one). The `gpu` test
checks the same on CUDA with `torch.cuda.set_sync_debug_mode("error")`.

Legend: B = batch rows, S = positions, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from routereplay.errors import TokenMismatchError
from routereplay.runtime import Replayer, attach
from routereplay.runtime.transfer import expected_ids, sync_free_default, to_device
from routereplay.trace import RouteTrace
from tests.runtime.models import random_routes, tiny_qwen3

LAYERS, EXPERTS, TOP_K, B, S = 2, 8, 2, 2, 6
aten = torch.ops.aten

# ops whose result the host must wait for (value-dependent output or a scalar read)
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.item.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
}
# Tensor methods that copy a device value to the host
READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__"}


def _storages(tensors: Any) -> set[int]:
    out = set()
    for leaf in tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            pointer = leaf.untyped_storage().data_ptr()
            if pointer:
                out.add(pointer)
    return out


class SyncCounter(TorchDispatchMode):
    """Records every op that would sync a GPU host, made on a device tensor (see the module docstring)."""

    def __init__(self, device_tensors: Any) -> None:
        super().__init__()
        self.device = _storages(device_tensors)
        self.syncs: list[str] = []
        counter = self

        class Reads(TorchFunctionMode):
            def __torch_function__(
                self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
            ) -> Any:
                name = getattr(func, "__name__", "")
                if name in READS and args and _storages(args[0]) & counter.device:
                    counter.syncs.append(f"Tensor.{name}")
                return func(*args, **(kwargs or {}))

        self.reads = Reads()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        on_device = bool(_storages((args, kwargs)) & self.device)
        if on_device and (func in SYNC_OPS or _boolean_index(func, args)):
            self.syncs.append(str(func))
        out = func(*args, **kwargs)
        if on_device or "device" in kwargs:  # computed on the device (or made there by a factory)
            self.device |= _storages(out)
        return out

    def __enter__(self) -> SyncCounter:
        self.reads.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.reads.__exit__(*exc)


def _boolean_index(func: Any, args: tuple[Any, ...]) -> bool:
    """Indexing with a boolean mask (`x[mask]`, `x[mask] = v`): a hidden `nonzero`."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _model() -> nn.Module:
    model = tiny_qwen3(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    model.config._experts_implementation = "batched_mm"  # the eager experts loop syncs (its own `nonzero`)
    return model.train()


def _batch() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(input_ids, host mask with left padding in row 0, host routes with -1 rows on padding and one more)."""
    ids_BS = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(3))
    mask_BS = np.ones((B, S), dtype=np.int64)
    mask_BS[0, :2] = 0
    routes_BSLK = random_routes(B, S, LAYERS, TOP_K, EXPERTS, seed=4).numpy()
    routes_BSLK[0, :2] = -1
    routes_BSLK[1, S - 1] = -1  # the last token: engines never route it
    return ids_BS, mask_BS, routes_BSLK


def _own_traces(model: nn.Module, replayer: Replayer) -> tuple[torch.Tensor, np.ndarray, list[RouteTrace]]:
    """(input_ids, host mask, the traces of the model's own record of them, with their token ids)."""
    ids_BS, mask_BS, _ = _batch()
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids_BS)
    return ids_BS, mask_BS, rec.traces(torch.from_numpy(mask_BS), input_ids=ids_BS)


def _step(model: nn.Module, ids_BS: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids_BS).logits
        logits.float().logsumexp(-1).mean().backward()

    return step


def _contexts(
    model: nn.Module, ids_BS: torch.Tensor, counting: bool = True
) -> dict[str, Callable[[], AbstractContextManager[Any]]]:
    replayer = attach(model, sync_free=True, count_disagreement=counting)
    _, mask_BS, partial_BSLK = _batch()
    with replayer.record(weights=True) as rec, torch.no_grad():
        model(input_ids=ids_BS)
    full_BSLK = rec.routes.cpu().numpy().astype(np.int16)  # a compact host copy, as a codec decodes it
    weights_BSLK = rec.weights.cpu()  # the engine's combine weights, on the host as a codec decodes them
    traces = rec.traces(torch.from_numpy(mask_BS), input_ids=ids_BS)
    return {
        "set, engine weights": lambda: replayer.replay(full_BSLK, weights=weights_BSLK),
        "set, threshold": lambda: replayer.replay(partial_BSLK, torch.from_numpy(mask_BS), threshold=0.01),
        "engine, threshold": lambda: replayer.replay(full_BSLK, order="engine", threshold=0.0),
        "engine, engine weights, live grad": lambda: replayer.replay(
            full_BSLK, order="engine", weights=weights_BSLK, weights_grad="live"
        ),
        "record": replayer.record,
        "set": lambda: replayer.replay(full_BSLK),
        "set, -1 rows, host mask": lambda: replayer.replay(partial_BSLK, torch.from_numpy(mask_BS)),
        "engine": lambda: replayer.replay(full_BSLK, order="engine"),
        "engine, -1 rows": lambda: replayer.replay(partial_BSLK, order="engine", check_alignment=False),
        "set, traces with token ids": lambda: replayer.replay(traces, mask_BS),  # type: ignore[arg-type]
    }


# the contexts the CUDA test runs (the CPU test adds the traces' token check and threshold replay)
CUDA_CASES = (
    "record",
    "set",
    "set, -1 rows, host mask",
    "engine",
    "engine, -1 rows",
    "set, engine weights",
    "engine, engine weights, live grad",
)


def _read_events(syncs: list[str]) -> list[str]:
    """The reads of a sync list, each once: a `.cpu()` then `.tolist()`/`.numpy()` of its (CPU: the same) tensor,
    or a `bool()` then its scalar read, is one read."""
    follow = {"Tensor.cpu": ("Tensor.tolist", "Tensor.numpy"), "Tensor.__bool__": ("aten._local_scalar_dense.default",)}
    events: list[str] = []
    for sync in syncs:
        if events and sync in follow.get(events[-1], ()):
            continue
        events.append(sync)
    return events


@contextmanager
def _counted(counter: SyncCounter) -> Iterator[SyncCounter]:
    with counter:
        yield counter


@pytest.mark.parametrize("counting", [True, False], ids=["counting disagreement", "not counting"])
@pytest.mark.parametrize("case", [*CUDA_CASES, "set, traces with token ids", "set, threshold", "engine, threshold"])
def test_a_replayed_step_reads_no_device_value(case: str, counting: bool) -> None:
    """Counting disagreement (the default) adds no read to the step, and at the exit one read shared with the
    threshold's counts; off, it adds nothing."""
    model = _model()
    ids_BS, _, _ = _batch()
    contexts = _contexts(model, ids_BS, counting)
    step = _step(model, ids_BS)
    device = [*model.parameters(), *model.buffers(), ids_BS]
    with _counted(SyncCounter(device)) as off:
        step()
    assert off.syncs == [], f"the model itself syncs: {off.syncs}"
    context = contexts[case]()
    with ExitStack() as stack, _counted(SyncCounter(device)) as entry_and_step:
        stack.enter_context(context)  # entry: routes and mask are read on the host only
        step()
        stack.pop_all()
    assert entry_and_step.syncs == [], f"{case}: a replayed step syncs the host: {entry_and_step.syncs}"
    with _counted(SyncCounter(device)) as exit_:
        exit_.device |= entry_and_step.device  # what the step computed on the device is a device value too
        context.__exit__(None, None, None)
    # after the step: the deferred token check, the weights' sum checks folded into one read, and the device
    # counts (threshold's replaced rows and disagreement) read together in one copy
    device_counts = case != "record" and ("threshold" in case or counting)
    reads = int(case == "set, traces with token ids") + int("weights" in case) + int(device_counts)
    assert len(_read_events(exit_.syncs)) <= reads, f"{case}: exit syncs {exit_.syncs}"
    assert exit_.syncs.count("Tensor.cpu") == int(device_counts), f"{case}: device counts not read once {exit_.syncs}"


def test_routes_on_a_device_cost_one_copy_at_entry() -> None:
    model = _model()
    replayer = attach(model, sync_free=True, count_disagreement=False)  # its one read at the exit: tested above
    ids_BS, _, _ = _batch()
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids_BS)
    routes_BSLK = rec.routes  # computed by the model: a device tensor
    device = [*model.parameters(), *model.buffers(), ids_BS, routes_BSLK]
    with _counted(SyncCounter(device)) as counter, replayer.replay(routes_BSLK):
        _step(model, ids_BS)()
    assert counter.syncs.count("Tensor.cpu") == 1, counter.syncs  # one device->host copy, where the routes are checked


def test_sync_free_threshold_counts_what_the_cpu_path_counts() -> None:
    """Threshold replay's replaced rows: counted on the device and read once at the exit when sync-free, the same
    per layer as the CPU path's per-call count, with rows replaced (random routes rarely sit within the margin)."""
    ids_BS, mask_BS, partial_BSLK = _batch()
    found = []
    for sync_free in (False, True):
        model = _model()
        replayer = attach(model, sync_free=sync_free)
        with replayer.replay(partial_BSLK, torch.from_numpy(mask_BS), threshold=0.01) as rep:
            model(input_ids=ids_BS).logits.float().logsumexp(-1).mean().backward()
        stats = replayer.stats
        found.append((rep.routes, stats.replaced_rows, dict(stats.replaced_rows_by_layer), stats.replace_rate))
    (routes_a, *counts_a), (routes_b, *counts_b) = found
    assert torch.equal(routes_a, routes_b) and counts_a == counts_b
    assert counts_a[0] > 0 and sorted(counts_a[1]) == [0, 1]


@pytest.mark.parametrize("order", ["set", "engine"])
def test_sync_free_replay_is_bit_identical_to_the_cpu_path(order: str) -> None:
    ids_BS, mask_BS, partial_BSLK = _batch()
    results = []
    for sync_free in (False, True):
        model = _model()
        replayer = attach(model, sync_free=sync_free)
        with replayer.replay(partial_BSLK, torch.from_numpy(mask_BS), order=order) as rep:
            logits = model(input_ids=ids_BS).logits
            logits.float().logsumexp(-1).mean().backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("gate.weight")]
        results.append((logits.detach(), rep.routes, grads, replayer.stats.replayed_rows, replayer.stats.fallback_rows))
    (logits_a, routes_a, grads_a, *counts_a), (logits_b, routes_b, grads_b, *counts_b) = results
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(routes_a, routes_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert counts_a == counts_b


def test_deferred_token_check_raises_after_the_step() -> None:
    model = _model()
    replayer = attach(model, sync_free=True)
    ids_BS, mask_BS, traces = _own_traces(model, replayer)
    shifted_BS = ids_BS.roll(1, dims=1)
    forwards = []
    with pytest.raises(TokenMismatchError, match="sequence 0: token 0"):
        with replayer.replay(traces, torch.from_numpy(mask_BS)):
            model(input_ids=shifted_BS)
            forwards.append("ran")  # the step is not interrupted: the check reads the device after it
    assert forwards == ["ran"]
    assert replayer.stats.checked_sequences == B


def test_expected_ids_place_token_ids_on_attended_positions() -> None:
    model = _model()
    ids_BS, mask_BS, traces = _own_traces(model, attach(model))
    expected_BS = expected_ids(traces, mask_BS.astype(bool))
    assert (expected_BS[mask_BS == 0] == -1).all()
    assert np.array_equal(expected_BS[mask_BS == 1], ids_BS.numpy()[mask_BS == 1])


def test_to_device_and_the_default() -> None:
    host_LTK = np.array([[[1, -1]]], dtype=np.int16)
    moved = to_device(host_LTK, torch.device("cpu"))
    assert moved.dtype == torch.long and moved.tolist() == [[[1, -1]]]
    assert not sync_free_default([torch.device("cpu")])
    assert sync_free_default([torch.device("cpu"), torch.device("cuda", 0)])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES)
def test_a_replayed_cuda_step_never_syncs(case: str) -> None:
    model = _model().cuda()
    ids_BS = _batch()[0].cuda()
    contexts = _contexts(model, ids_BS)  # routes and mask stay on the host, as an engine delivers them
    step = _step(model, ids_BS)
    step()  # warm-up: the first call allocates (cuBLAS handles, pinned blocks) outside the check
    with contexts[case]():
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    context = contexts[case]()
    try:
        step()  # the model alone must not sync, or the check below says nothing about replay
        context.__enter__()  # entry, forward and backward: no host sync anywhere
        step()
        if "weights" not in case:  # the weights' sum checks read the device once, at the exit (after the step)
            context.__exit__(None, None, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if "weights" in case:
        context.__exit__(None, None, None)
    torch.cuda.synchronize()
