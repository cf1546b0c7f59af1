"""Host -> device moves of a replay context's routes and ids, with no host sync in the step.

A replayed training step on a GPU must never wait for the device: a host sync stalls the CPU that
queues the step's kernels, and what it costs is the whole queue draining. So a replay context reads
values only on the host, once, at entry: its routes (as an engine or a trace delivers them: numpy
or a CPU tensor) and its attention mask. What the routers need goes to their device with one
`non_blocking` copy from pinned memory (`to_device`), and nothing in a router call or a forward
reads a device value back.

Sync-free is the default when the routers are off the CPU. `Replayer(sync_free=True)` takes the
same path on CPU (the CPU fast paths that read a value are then off), which is how the tests check
on a machine without a GPU that a replayed step holds no host sync (`tests/runtime/test_host_syncs.py`).

The one check that needs device values per forward, the traces' token ids against each forward's
`input_ids`, is deferred in a sync-free context (`DeferredTokenCheck`): each forward compares on
its device and keeps a flag; the context reads the flags once, after it closed (outside the step),
and raises the `TokenMismatchError` the eager check would have raised.

What still costs a host sync, by design: routes or an attention mask given on a device (one
device->host copy each at entry: pass them on the host), and modality routers (Ernie-4.5-VL: the
model's own token split reads the device, `runtime/modality.py`).

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from routereplay.runtime.alignment import check_tokens
from routereplay.trace.route_trace import RouteTrace


def sync_free_default(devices: Iterable[torch.device]) -> bool:
    """Sync-free unless every router computes on the CPU (where reading a value waits for nothing)."""
    return any(device.type != "cpu" for device in devices)


def to_device(host: np.ndarray, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`host` as a `dtype` tensor on `device`: copied in its own (compact) dtype, without a host sync.

    A CUDA copy goes from pinned memory (`non_blocking` from pageable memory may wait for the stream);
    the cast runs on the device, after the copy."""
    tensor = torch.from_numpy(np.ascontiguousarray(host))
    if device.type == "cpu":
        return tensor.to(dtype)
    if device.type == "cuda" and torch.cuda.is_available():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True).to(dtype)


def expected_ids(traces: Sequence[RouteTrace], mask_BS: np.ndarray) -> np.ndarray:
    """(B, S) the id each position must hold by the traces' `token_ids`, -1 where none is known.

    The same positions `check_tokens` compares: token i of a trace on the i-th attended position."""
    expected_BS = np.full(mask_BS.shape, -1, dtype=np.int64)
    for b, trace in enumerate(traces):
        if trace.token_ids is None:
            continue
        attended_T = np.flatnonzero(mask_BS[b])
        stop = min(trace.stop, attended_T.size)
        count = stop - trace.start
        if count > 0:
            expected_BS[b, attended_T[trace.start : stop]] = trace.token_ids[:count]
    return expected_BS


class DeferredTokenCheck:
    """The token-id check of a sync-free context: compared on the device per forward, read once at the end."""

    def __init__(self, traces: Sequence[RouteTrace], mask_BS: np.ndarray) -> None:
        self.traces, self.mask_BS = traces, mask_BS
        self.sequences = sum(trace.token_ids is not None for trace in traces)
        self.expected_BS = expected_ids(traces, mask_BS)
        self.on_device: dict[torch.device, torch.Tensor] = {}
        self.flags: list[torch.Tensor] = []  # per forward: whether any known id differs (a device bool)
        self.inputs: list[torch.Tensor] = []  # the forwards' input_ids, for the message

    def add(self, input_ids: torch.Tensor) -> int:
        """Compare a forward's ids on their device (no sync); returns the sequences checked."""
        if tuple(input_ids.shape) != self.expected_BS.shape or input_ids.is_floating_point():
            return check_tokens(self.traces, self.mask_BS, input_ids)  # raises on the shapes alone, reading nothing
        device = input_ids.device
        if device not in self.on_device:
            self.on_device[device] = to_device(self.expected_BS, device)
        expected_BS = self.on_device[device]
        self.flags.append(((input_ids != expected_BS) & (expected_BS >= 0)).any())
        self.inputs.append(input_ids)
        return self.sequences

    def finish(self) -> None:
        """After the context: one read of every forward's flag; a mismatch raises `TokenMismatchError`."""
        flags, inputs = self.flags, self.inputs
        self.flags, self.inputs = [], []
        if not flags:
            return
        device = flags[0].device
        if not bool(torch.stack([flag.to(device) for flag in flags]).any()):  # the one sync, outside the step
            return
        for input_ids in inputs:
            check_tokens(self.traces, self.mask_BS, input_ids)


__all__ = ["DeferredTokenCheck", "expected_ids", "sync_free_default", "to_device"]
