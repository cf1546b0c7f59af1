"""`IndexerReplayer(model)`: record and replay the top-k of a model's DSA indexers.

Binding is by module identity: each indexer's `forward` becomes an instance attribute that wraps
its own forward (the class is untouched, nothing global is patched) and `detach()` deletes it,
putting back a forward another library had set before. A pickled or deep-copied model carries
inert stand-ins (its indexers run naturally; binding the copy unwraps them). The canonical
(B, S, L, I) form and the discovery rules are in `runtime/indexer/discovery.py`.

    ir = IndexerReplayer(model)
    with ir.record() as rec:
        model(input_ids, attention_mask=mask)
    indices_BSLI = rec.indices                      # int32, -1 padded, sorted per row
    with ir.replay(indices_BSLI, attention_mask=mask):
        loss = loss_fn(model(input_ids, attention_mask=mask)); loss.backward()

Replay returns the forced positions in the shape the attention expects (`[B, S, min(I, keys)]`,
int32; -1 slots repeat the row's first position, so the attention's scatter unmasks nothing
else). A row of only -1 takes the live indexer's choice for that query (`torch.where` against a live
top-k, run only in layers whose rows hold one: decided on the host at entry). The call itself holds
no host sync. Every forward inside the context forces the same choices: replay covers full-sequence
forwards (keys == S, no KV cache prefix); record also covers incremental decoding, whose steps
concatenate along S.

Recompute safety: an indexer call made during backward (an activation-checkpoint recompute) returns,
in record, the positions its forward returned (the latest of that layer with the same shape), and in
replay the same forced positions. Threads: a context belongs to the thread that opened it; other
threads' forwards run the indexers naturally. Another controller (the router `Replayer`) can drive
the contexts with `begin_record()`, `begin_replay(...)` and `end()`.

Legend: B = batch rows, S = query positions, T = key positions, L = indexer layers, I = index_topk,
k = the live top-k width min(I, T).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from routereplay.enums import ReplayMode
from routereplay.errors import (
    AlreadyAttachedError,
    BatchShapeError,
    ForeignThreadError,
    KernelBypassError,
    NoRoutersError,
    RecomputeError,
    ReplayStateError,
)
from routereplay.runtime.attachment import _holding_forward, _is_bound_class_forward, _unwrapped
from routereplay.runtime.indexer.discovery import (
    ForcedIndices,
    IndexerSite,
    attendable_BST,
    canonical_indices,
    discover_indexers,
    prepare_forced,
)
from routereplay.runtime.interception import in_backward, on_thread


@dataclass(slots=True)
class IndexerStats:
    """Counters of what the indexers did (`IndexerReplayer.stats`, reset with `.reset()`)."""

    calls: int = 0  # indexer forward calls inside a context (recomputes excluded)
    recompute_calls: int = 0  # indexer calls made during backward (checkpoint recompute)
    recorded_rows: int = 0  # (query, layer) rows recorded
    replayed_rows: int = 0  # (query, layer) rows forced (attended queries when replay got a mask)
    fallback_rows: int = 0  # (query, layer) rows of only -1, served by the live indexer

    def reset(self) -> None:
        self.calls = self.recompute_calls = self.recorded_rows = self.replayed_rows = self.fallback_rows = 0


@dataclass(slots=True)
class IndexerRecording:
    """What a record context captured: per layer, one (canonical `[B, S, I]`, live `[B, S, k]`) per call."""

    layers: tuple[int, ...]
    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def indices(self) -> torch.Tensor:
        """The (B, S, L, I) int32 canonical choices; several forward calls concatenate along S."""
        counts = {layer: len(self.calls.get(layer, [])) for layer in self.layers}
        if not any(counts.values()):
            raise ReplayStateError("no indexer ran: call the model inside `with indexer_replayer.record():`")
        if len(set(counts.values())) != 1:
            raise KernelBypassError(f"indexer calls per layer differ {counts}: some indexers did not run every forward")
        steps = [
            torch.stack([self.calls[layer][step][0] for layer in self.layers], dim=2)
            for step in range(counts[self.layers[0]])
        ]
        return torch.cat(steps, dim=1)


class _Context:
    """One open record or replay context: its owner thread, what it forces or what it recorded."""

    __slots__ = ("forced", "mode", "on_device", "recording", "thread")

    def __init__(self, mode: ReplayMode, layers: tuple[int, ...], forced: ForcedIndices | None) -> None:
        self.mode, self.forced, self.thread = mode, forced, threading.get_ident()
        self.recording = IndexerRecording(layers, {layer: [] for layer in layers})
        self.on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forced_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The forced (L, B, S, I) positions and (L, B, S, 1) unknown rows on `device`, copied once."""
        assert self.forced is not None
        if device not in self.on_device:
            self.on_device[device] = (self.forced.filled_LBSI.to(device), self.forced.unknown_LBS1.to(device))
        return self.on_device[device]


class _IndexerForward:
    """The binding of one indexer: its `forward` instance attribute is this object's `forward` method.

    Pickled, it becomes the forward it wraps; deep-copied, an inert binding (`owner` None) that calls
    it, so a saved or copied model carries no replayer state and runs its indexers naturally."""

    __slots__ = ("index", "original", "owner", "parameters")

    def __init__(self, owner: IndexerReplayer | None, index: int, original: Callable[..., Any]) -> None:
        self.owner, self.index, self.original = owner, index, original
        self.parameters = list(inspect.signature(original).parameters)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner is None:  # a copy's inert stand-in
            return self.original(*args, **kwargs)
        return self.owner._call(self, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled bound method is `getattr(<its __self__ reduced>, "forward")`
        owner_module = getattr(self.original, "__self__", None)
        if isinstance(owner_module, nn.Module) and _is_bound_class_forward(self.original, owner_module):
            return (_unwrapped, (owner_module,))  # re-resolved on the copy: its class's forward
        return (_holding_forward, (self.original,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _IndexerForward:
        return _IndexerForward(None, self.index, copy.deepcopy(self.original, memo))

    def argument(self, name: str, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        index = self.parameters.index(name) if name in self.parameters else position
        return args[index] if index < len(args) else None


class IndexerReplayer:
    """Binds every DSA indexer of `model`; `.layers` are their global layer numbers, in order."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: list[IndexerSite] = discover_indexers(model)
        if not self.sites:
            raise NoRoutersError(f"{type(model).__name__} has no DSA indexer (a module with `index_topk` and a top-k)")
        widths = {site.index_topk for site in self.sites}
        if len(widths) != 1:
            raise NoRoutersError(f"DSA indexers disagree on index_topk {sorted(widths)}; one width per model")
        self.layers: tuple[int, ...] = tuple(site.layer for site in self.sites)
        self.index_topk: int = widths.pop()
        self.stats = IndexerStats()
        self._context: _Context | None = None
        self._last: IndexerRecording | None = None
        self._bindings: list[_IndexerForward] = []
        for index, site in enumerate(self.sites):
            original = site.module.forward
            stand_in = getattr(original, "__self__", None)
            if isinstance(stand_in, _IndexerForward):
                if stand_in.owner is not None:
                    raise AlreadyAttachedError(f"indexer {site.name!r} is already bound; detach the other one first")
                original = stand_in.original  # a deep copy's inert stand-in: wrap what it calls
            binding = _IndexerForward(self, index, original)
            site.module.forward = binding.forward  # instance attribute only
            self._bindings.append(binding)

    # -- contexts ----------------------------------------------------------------------------------
    @contextmanager
    def record(self) -> Iterator[IndexerRecording]:
        """Record the live choices of every indexer call of this thread's forwards."""
        recording = self.begin_record()
        try:
            yield recording
        finally:
            self.end()

    @contextmanager
    def replay(
        self, indices_BSLI: torch.Tensor, *, attention_mask: torch.Tensor | None = None
    ) -> Iterator[IndexerStats]:
        """Force `indices_BSLI` (canonical or any row order; -1 = unknown); forward and backward inside."""
        self.begin_replay(indices_BSLI, attention_mask=attention_mask)
        try:
            yield self.stats
        finally:
            self.end()

    def begin_record(self) -> IndexerRecording:
        """Open a record context (for a controller; `record()` wraps it). Returns the recording it fills."""
        context = self._open(ReplayMode.RECORD, None)
        return context.recording

    def begin_replay(self, indices_BSLI: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> None:
        """Validate `indices_BSLI` on the host and open a replay context (for a controller)."""
        self._refuse_open()
        context = self._open(
            ReplayMode.REPLAY, prepare_forced(indices_BSLI, self.layers, self.index_topk, attention_mask)
        )
        for site in self.sites:  # one copy per device of the indexers, on entry rather than in a call
            device = next((p.device for p in site.module.parameters()), None)
            if device is not None and device.type != "meta":
                context.forced_on(device)

    def end(self) -> IndexerRecording | None:
        """Close the open context; returns what a record context captured (also `.last_recording`)."""
        context, self._context = self._context, None
        if context is None:
            raise ReplayStateError("no indexer context is open")
        if context.mode is ReplayMode.RECORD:
            self._last = context.recording
            return context.recording
        return None

    @property
    def last_recording(self) -> IndexerRecording | None:
        """The recording of the last closed record context, if any."""
        return self._last

    def detach(self) -> None:
        """Delete the `forward` attributes (putting back one another library had set); the model is as before."""
        if self._context is not None:
            raise ReplayStateError("close the indexer context before detach()")
        for site, binding in zip(self.sites, self._bindings, strict=True):
            current = site.module.__dict__.get("forward")
            if getattr(current, "__self__", None) is binding:
                del site.module.__dict__["forward"]
                if not _is_bound_class_forward(binding.original, site.module):
                    site.module.forward = binding.original  # another library's wrapper, set before binding
        self._bindings.clear()

    def _refuse_open(self) -> None:
        context = self._context
        if context is None:
            return
        if context.thread != threading.get_ident():
            raise ForeignThreadError(
                "another thread holds this IndexerReplayer's context; bind a model copy per thread"
            )
        raise ReplayStateError("an indexer context is already open; close it before opening another")

    def _open(self, mode: ReplayMode, forced: ForcedIndices | None) -> _Context:
        self._refuse_open()
        if not self._bindings:
            raise ReplayStateError("this IndexerReplayer was detached; bind a new one")
        self._context = _Context(mode, self.layers, forced)
        return self._context

    # -- the indexer call --------------------------------------------------------------------------
    def _call(self, binding: _IndexerForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        context = self._context
        if context is None or not on_thread(context.thread):
            return binding.original(*args, **kwargs)
        hidden = binding.argument("hidden_states", 0, args, kwargs)
        mask = binding.argument("attention_mask", 3, args, kwargs)
        batch, positions = int(hidden.shape[0]), int(hidden.shape[1])
        keys = int(mask.shape[-1]) if mask is not None else positions
        layer = self.layers[binding.index]
        recompute = in_backward()
        if recompute:
            self.stats.recompute_calls += 1
        else:
            self.stats.calls += 1
        if context.mode is ReplayMode.RECORD:
            calls = context.recording.calls[layer]
            if recompute:  # reuse the choice its forward made, not a fresh top-k
                for _, live in reversed(calls):
                    if live.shape[:2] == (batch, positions) and live.device == hidden.device:
                        return live
                raise RecomputeError(
                    f"indexer layer {layer} is recomputed for {(batch, positions)} queries, "
                    "but no forward of this record context ran it with that shape"
                )
            live = binding.original(*args, **kwargs)
            allowed = attendable_BST(mask, batch, positions, keys)
            calls.append((canonical_indices(live, allowed, self.index_topk), live))
            self.stats.recorded_rows += batch * positions
            return live
        forced = context.forced
        assert forced is not None
        if (batch, positions) != forced.batch_shape or keys != positions:
            raise BatchShapeError(
                f"indexer layer {layer} runs {(batch, positions)} queries over {keys} keys, but the replay choices are "
                f"for (B, S) = {forced.batch_shape} with S keys; align the choices with the model input (no KV cache)"
            )
        filled_LBSI, unknown_LBS1 = context.forced_on(hidden.device)
        chosen = filled_LBSI[binding.index, :, :, : min(self.index_topk, keys)]
        if forced.has_unknown_L[binding.index]:  # rows of only -1: the live indexer decides those queries
            chosen = torch.where(unknown_LBS1[binding.index], binding.original(*args, **kwargs), chosen)
        if not recompute:
            self.stats.replayed_rows += forced.replayed_L[binding.index]
            self.stats.fallback_rows += forced.fallback_L[binding.index]
        return chosen


__all__ = ["IndexerRecording", "IndexerReplayer", "IndexerStats"]
