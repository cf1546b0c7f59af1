"""One record or replay context of a `Replayer`: its state, what it captured, and the counters.

`Session` is the state of one open context: the thread that owns it, its steps (one per forward call,
each holding the routes every bound layer used) and, in replay, the routes it forces. `Recording` is
what `with replayer.record()` / `replayer.replay(...)` yields; the counters are `ReplayStats` (`runtime/stats.py`),
folded here (disagreement: `runtime/disagreement.py`).
`guard_backward` makes a gradient that reaches a router after its replay context closed an error.

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens in a call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from routereplay.enums import ReplayMode, ReplayOrder, Source
from routereplay.errors import BatchShapeError, KernelBypassError, RecomputeError, ReplayStateError
from routereplay.runtime.alignment import check_tokens
from routereplay.runtime.disagreement import DisagreementCounter, read_together
from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.gate_weights.forcing import WeightsCapture
from routereplay.runtime.indexer.choices import IndexerGeometry, indexer_traces
from routereplay.runtime.indexer.replayer import IndexerRecording
from routereplay.runtime.interception import RouterSlot, in_backward
from routereplay.runtime.modality import scatter_rows, take_rows
from routereplay.runtime.routes import mask_array, routes_to_traces
from routereplay.runtime.stats import ReplayStats
from routereplay.runtime.threshold import replaced_count
from routereplay.runtime.transfer import DeferredTokenCheck, sync_free_default, to_device
from routereplay.trace.route_trace import RouteTrace


class SessionOwner(Protocol):
    """What a context reads of the `Replayer` that opened it (`runtime/replayer.py`)."""

    @property
    def sites(self) -> Sequence[RouterSite]: ...
    @property
    def slots(self) -> Sequence[RouterSlot]: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def slot_names(self) -> tuple[str, ...] | None: ...
    @property
    def stats(self) -> ReplayStats: ...
    @property
    def _stats(self) -> ReplayStats: ...
    @property
    def indexer(self) -> IndexerGeometry | None: ...
    @property
    def sync_free(self) -> bool | None: ...


class Session:
    """State of one record or replay context: its owner thread, steps (forward calls) and routes.

    Replay decides on the host, once, what the router calls need: each layer's routes (moved to its
    router's device), whether they hold -1 rows, and the rows each call of that layer counts as
    replayed and as fallback (attended positions only). A router call then only reads its
    `RouterSlot` and leaves its choice there; `collect` folds the choices into the steps and counters
    on the host: right after each eager call, and under `torch.compile` (where counting inside the
    graph would recompile it) at the next forward, at exit, and when `.stats` or `.routes` are read.
    A sync-free context (`sync_free`, see `runtime/transfer.py`) reads no device value from entry to exit.
    """

    def __init__(
        self,
        replayer: SessionOwner,
        mode: ReplayMode,
        routes_BSLK: np.ndarray | None = None,
        attention_mask: torch.Tensor | np.ndarray | None = None,
        traces: Sequence[RouteTrace] | None = None,
        order: ReplayOrder = ReplayOrder.SET,
        routes_device: torch.device | None = None,
    ) -> None:
        self.replayer, self.mode, self.open, self.order = replayer, mode, True, order
        self.stats = replayer._stats  # the Replayer's counters, without folding (`Replayer.stats` folds)
        self.thread = threading.get_ident()  # the context belongs to the thread that opened it
        self.local = threading.local()  # `owner` is set on the opening thread only (a guard under compile)
        self.local.owner = True
        self.traces = None if traces is None or all(t.token_ids is None for t in traces) else list(traces)
        self.mask_BS = None if attention_mask is None or self.traces is None else mask_array(attention_mask)
        self.slots = replayer.slots
        self.indexer_recording: IndexerRecording | None = None  # record: the DSA indexers' choices
        self.indexer_replayed = False  # replay: the DSA indexers were forced too
        self.attended_T: np.ndarray | None = None
        self.routes_LTK: torch.Tensor | None = None
        self.batch_shape: tuple[int, int] | None = None
        self.replayed_L: list[int] = []  # rows each call of layer l counts as replayed (attended, forced)
        self.fallback_L: list[int] = []  # rows each call of layer l counts as fallback (attended, -1)
        self.replaced_pending: list[tuple[int, torch.Tensor]] = []  # sync-free threshold counts: (layer, count)
        self.attended_on: dict[torch.device, torch.Tensor] = {}  # sync-free: attended_T on each router device
        self.disagreement: DisagreementCounter | None = None  # replay(count_disagreement=True): device counts
        devices = [router_device(site) or routes_device or torch.device("cpu") for site in replayer.sites]
        chosen = replayer.sync_free
        self.sync_free = sync_free_default(devices) if chosen is None else chosen  # see `runtime/transfer.py`
        self.token_check = (
            DeferredTokenCheck(self.traces, self.mask_BS)
            if self.sync_free and self.traces is not None and self.mask_BS is not None
            else None
        )
        if routes_BSLK is not None:
            batch, positions, layers, k = routes_BSLK.shape
            self.batch_shape = (batch, positions)
            routes_LTK = np.ascontiguousarray(routes_BSLK.transpose(2, 0, 1, 3)).reshape(layers, batch * positions, k)
            self.routes_LTK = torch.from_numpy(routes_LTK)  # the host copy (the routes' own compact dtype)
            self._plan(routes_LTK, attention_mask, devices)
        self.steps: list[tuple[tuple[int, int], dict[int, torch.Tensor]]] = []  # per forward: column -> (T, K)

    def _plan(
        self, routes_LTK: np.ndarray, attention_mask: torch.Tensor | np.ndarray | None, devices: list[torch.device]
    ) -> None:
        """Host decisions for replay, once per context: fallback layers, counts, routes on device.

        Everything here reads the host copy of the routes (and a host mask): no device value is read, and the
        routes reach each router's device by one non-blocking copy (`runtime/transfer.py`)."""
        # numpy, not torch, on the host: a torch CPU reduction over >= 32k elements wakes the intra-op thread
        # pool, which cost ~20 ms per context on a 16-core GPU host whose threads sleep while the GPU works
        fallback_LT: np.ndarray = routes_LTK[:, :, 0] < 0
        counted_LT = fallback_LT
        attended_T: np.ndarray | None = None
        if attention_mask is not None:
            attended_T = mask_array(attention_mask).reshape(-1)  # a mask on a device: its one device->host copy
        self.attended_T = attended_T  # modality routers count their own tokens per call
        if attended_T is not None and attended_T.size == fallback_LT.shape[1]:
            counted_LT = fallback_LT & attended_T  # padding is neither replayed nor fallback
            self.replayed_L = np.count_nonzero(~fallback_LT & attended_T, axis=1).tolist()
        else:
            self.replayed_L = np.count_nonzero(~fallback_LT, axis=1).tolist()
        self.fallback_L = np.count_nonzero(counted_LT, axis=1).tolist()
        has_fallback_L: list[bool] = np.asarray(fallback_LT.any(axis=1)).tolist()  # any -1 row, padding included
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy per device of the routers, not per call
        for index, (device, slot) in enumerate(zip(devices, self.slots, strict=True)):
            if device not in on_device:
                on_device[device] = to_device(routes_LTK, device)
            slot.forced_TK = on_device[device][index]
            slot.fallback = bool(has_fallback_L[index])
            slot.keep_order = self.order is ReplayOrder.ENGINE
            slot.host_reads = not self.sync_free
            slot.chosen_TK = None

    def owned_here(self) -> bool:
        """True when the current router call belongs to this context (see "Threads" in `runtime/replayer.py`).

        Read through a thread-local, so a compiled router's guard checks it per calling thread."""
        if getattr(self.local, "owner", False):
            return True
        return in_backward() and isinstance(threading.current_thread(), threading._DummyThread)

    def close(self) -> None:
        """Fold what is pending, then empty the slots (they belong to the next context)."""
        self.collect()
        self._fold_device_counts()
        for slot in self.slots:
            slot.clear()
        self.open = False

    def _fold_device_counts(self) -> None:
        """Sync-free counts kept on the devices (threshold's replaced rows, disagreement), read together in one
        copy per device at the exit (`read_together`), into the stats."""
        pending, self.replaced_pending = self.replaced_pending, []
        disagreement = self.disagreement
        rows = {} if disagreement is None else disagreement.take()
        if not pending and not rows:
            return
        values = read_together([count for _, count in pending] + list(rows.values()))
        for (layer, _), replaced in zip(pending, values[: len(pending)], strict=True):
            self._add_replaced(layer, replaced[0])
        for index, counts in zip(rows, values[len(pending) :], strict=True):
            self.stats.add_disagreement(self.replayer.sites[index].layer, counts)

    def _add_replaced(self, layer: int, replaced: int) -> None:
        self.stats.replaced_rows += replaced
        self.stats.replaced_rows_by_layer[layer] = self.stats.replaced_rows_by_layer.get(layer, 0) + replaced

    # -- steps -------------------------------------------------------------------------------------
    def begin_step(self, shape: tuple[int, int], input_ids: torch.Tensor | None = None) -> None:
        self.collect()  # compiled routers of the previous forward left their choices in the slots
        self._new_step(shape, input_ids)

    def _new_step(self, shape: tuple[int, int], input_ids: torch.Tensor | None = None) -> None:
        if self.mode is ReplayMode.REPLAY and self.batch_shape is not None and shape != self.batch_shape:
            raise BatchShapeError(
                f"replay routes are for a batch of (B, S) = {self.batch_shape} but the model is called with "
                f"{shape}; routes must be aligned with the model input"
            )
        if self.traces is not None and self.mask_BS is not None and input_ids is not None:
            check = self.token_check  # sync-free: compared on the device, read after the context
            self.stats.checked_sequences += (
                check_tokens(self.traces, self.mask_BS, input_ids) if check is None else check.add(input_ids)
            )
        self.steps.append((shape, {}))

    def forced(self, site: RouterSite, slot: RouterSlot, rows: int) -> tuple[torch.Tensor, bool] | None:
        if self.mode is ReplayMode.RECORD:
            if not in_backward():
                return None
            for _, recorded in reversed(self.steps):  # recompute: reuse this layer's recorded choice
                found = recorded.get(site.column)
                if found is not None and site.modality is not None:
                    found = take_rows(found, slot.rows_T)
                if found is not None and found.shape[0] == rows:
                    return found.to(torch.long), False
            raise RecomputeError(
                f"layer {site.layer} ({site.name}) is recomputed during backward with {rows} tokens, but no "
                "forward of this record context routed that many tokens there"
            )
        forced_TK = slot.forced_TK
        assert forced_TK is not None, "a replay context fills every slot on entry"
        if site.modality is not None:
            forced_TK = take_rows(forced_TK, slot.rows_T)
        if rows != forced_TK.shape[0]:
            raise BatchShapeError(
                f"layer {site.layer} ({site.name}) routes {rows} tokens but the replay routes hold "
                f"{forced_TK.shape[0]} (B * S = {self.batch_shape}); routes must be aligned with the input"
            )
        return forced_TK, slot.fallback

    def _attended(self, device: torch.device, rows: int) -> torch.Tensor | None:
        """The attended positions as a bool tensor on `device` (copied once per device), or None when every
        row counts (no mask, or a mask of another size)."""
        attended = self.attended_T
        if attended is None or attended.size != rows:
            return None
        if device not in self.attended_on:
            self.attended_on[device] = to_device(attended, device, torch.bool)
        return self.attended_on[device]

    def _attended_count(self, replaced_T: torch.Tensor) -> torch.Tensor:
        """The rows of `replaced_T` on attended positions, summed on its device (no host read)."""
        attended_T = self._attended(replaced_T.device, replaced_T.numel())
        return replaced_T.sum() if attended_T is None else (replaced_T & attended_T).sum()

    def collect(self) -> None:
        """Fold the choices routers left in their slots into the current step and the counters."""
        for index in range(len(self.slots)):
            self.collect_one(index)
        if not self.sync_free and self.disagreement is not None:  # a read waits for nothing: fold them now
            self._fold_device_counts()

    def collect_one(self, index: int) -> None:
        """Fold bound router `index`'s pending choice, if any: host work only (ints known since entry)."""
        slot = self.slots[index]
        chosen_TK = slot.chosen_TK
        if chosen_TK is None or not self.open:
            return
        slot.chosen_TK = None
        site, stats = self.replayer.sites[index], self.stats
        stats.router_calls += 1
        if not self.steps:
            self._new_step((1, chosen_TK.shape[0]))
        self.steps[-1][1][index] = chosen_TK.detach().to(torch.int32)  # replay: the routes used
        if self.mode is ReplayMode.RECORD:
            stats.recorded_rows += chosen_TK.shape[0] if slot.rows_T is None else int(slot.rows_T.sum())
            return
        replayed, fallbacks = (
            slot.counts if site.modality is not None else (self.replayed_L[index], self.fallback_L[index])
        )
        stats.replayed_rows += replayed
        stats.fallback_rows += fallbacks
        live_TK, slot.live_TK = slot.live_TK, None
        if live_TK is not None and self.disagreement is not None and slot.forced_TK is not None:
            if site.modality is not None:
                live_TK = scatter_rows(live_TK, slot.rows_T)  # -1 on the tokens this router did not see
            replaced_T = None if slot.replaced_T is None else slot.replaced_T.detach()
            self.disagreement.add(index, slot.forced_TK, live_TK.detach(), replaced_T, self._attended)
        if slot.replaced_T is not None:  # threshold replay (`runtime/threshold.py`)
            replaced_T, slot.replaced_T = slot.replaced_T.detach(), None
            if self.sync_free:  # counted on the device, read once at the exit
                self.replaced_pending.append((site.layer, self._attended_count(replaced_T)))
            else:
                self._add_replaced(site.layer, replaced_count(replaced_T, self.attended_T))
        if fallbacks:
            stats.fallback_rows_by_layer[site.layer] = stats.fallback_rows_by_layer.get(site.layer, 0) + fallbacks


def first_device(recorded: dict[int, torch.Tensor]) -> torch.device:
    """Where a step's routes live: the device of its first recorded column (a filled -1 column is on the CPU)."""
    return next(iter(recorded.values())).device


def router_device(site: RouterSite) -> torch.device | None:
    """Where a router computes its scores (its first parameter or buffer), or None if unknown (meta)."""
    for module in (site.router, site.scope):
        for tensor in (*module.parameters(), *module.buffers()):
            return None if tensor.device.type == "meta" else tensor.device
    return None


class Recording:
    """What a context captured. `.routes` is (B, S, L, K); `.traces(mask)` per sequence; `.stats`.

    Under `record()` these are the routers' own choices; under `replay()` the routes actually used
    (the forced ids, and the live choice on -1 rows).

    Forward calls in one context are steps: incremental decoding with a KV cache (prefill, then one
    position per step) concatenates along S. Independent micro-batches belong in separate contexts,
    or read `.steps`.
    """

    def __init__(self, session: Session, *, weights: WeightsCapture | None = None) -> None:
        replayer = session.replayer
        self._session, self.layers, self.num_experts = session, replayer.layers, replayer.num_experts
        self._weights = weights  # record(weights=True): the combine weights the experts received
        self.slots = replayer.slot_names  # router slot of each column, None when every layer has one router

    @property
    def stats(self) -> ReplayStats:
        """The Replayer's counters (cumulative; `.reset()` them between passes)."""
        return self._session.replayer.stats

    @property
    def steps(self) -> list[torch.Tensor]:
        """One (B, S_i, L, K) int tensor per forward call."""
        if self._session.owned_here():
            self._session.collect()  # compiled routers leave their last choices pending
        out = []
        sites = self._session.replayer.sites
        for (batch, positions), recorded in self._session.steps:
            for site in sites:  # a modality router that saw no token of this forward: -1 on every token
                if site.column not in recorded and site.modality is not None and recorded:
                    recorded[site.column] = torch.full(
                        (batch * positions, site.top_k), -1, dtype=torch.int32, device=first_device(recorded)
                    )
            missing = [site.layer for site in sites if site.column not in recorded]
            if missing:
                raise KernelBypassError(
                    f"layers {missing} recorded nothing in a forward: their routers never ran (a fused kernel "
                    "replaced the MoE block?) or ran outside this model's forward"
                )
            stacked = torch.stack([recorded[site.column] for site in sites], dim=1)  # (T, L, K)
            out.append(stacked.reshape(batch, positions, len(self.layers), -1))
        return out

    @property
    def indexer(self) -> torch.Tensor | None:
        """DSA models under `record()`: the indexers' (B, S, L_dsa, I) key choices (batch columns, sorted,
        -1 padded; `runtime/indexer/discovery.py`); None for models without indexers and under `replay()`."""
        recording = self._session.indexer_recording
        return None if recording is None else recording.indices

    @property
    def weights(self) -> torch.Tensor:
        """`record(weights=True)`: the (B, S, L, K) float32 combine weights the experts received, aligned with
        `.routes` (weight k of a row belongs to expert `routes[..., k]`)."""
        if self._weights is None:
            raise ReplayStateError("weights were not recorded: open the context with `replayer.record(weights=True)`")
        if self._session.owned_here():
            self._session.collect()
        return self._weights.weights([shape for shape, _ in self._session.steps])

    @property
    def routes(self) -> torch.Tensor:
        steps = self.steps
        if not steps:
            raise ReplayStateError("nothing was recorded: call the model inside `with replayer.record():`")
        if len({s.shape[0] for s in steps}) != 1:
            raise ReplayStateError(
                f"steps have different batch sizes {[s.shape[0] for s in steps]}; read .steps for independent calls"
            )
        return torch.cat(steps, dim=1)

    def traces(
        self,
        attention_mask: torch.Tensor,
        *,
        source: Source | str = Source.TRAINER,
        policy_version: int | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> list[RouteTrace]:
        """Per-sequence traces: attended positions only (left or right padding dropped).

        With the batch's `input_ids` the traces carry their token ids, so a later replay checks them.
        DSA models: each trace carries its indexer choices (`RouteTrace.indexer`)."""
        traces = routes_to_traces(
            self.routes, attention_mask, self.layers, self.num_experts, source, policy_version, input_ids, self.slots
        )
        if self._weights is not None:  # record(weights=True): each trace carries its rows' combine weights
            weights_BSLK = self.weights.cpu().numpy()
            mask_BS = mask_array(attention_mask)[:, : weights_BSLK.shape[1]]
            traces = [t.with_weights(weights_BSLK[b, mask_BS[b]]) for b, t in enumerate(traces)]
        indexer, owner = self.indexer, self._session.replayer.indexer
        if indexer is None or owner is None:
            return traces
        choices = indexer_traces(indexer, mask_array(attention_mask), owner.layers, owner.index_topk)
        return [t.with_indexer(c.slice(0, t.num_tokens)) for t, c in zip(traces, choices, strict=True)]


def guard_backward(output: Any, session: Session, site: RouterSite) -> None:
    """A gradient reaching this router's output after its replay context closed is an error."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:

            def check(grad: torch.Tensor) -> None:
                if not session.open:
                    raise ReplayStateError(
                        f"backward reached layer {site.layer} ({site.name}) after its replay context closed; "
                        "activation recompute would route naturally. Call backward inside `with replayer.replay(...)`"
                    )

            tensor.register_hook(check)
            return
