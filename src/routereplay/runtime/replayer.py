"""`attach(model) -> Replayer`: record and replay the routing of an HF transformers MoE model.

The Replayer binds each router by module identity and global layer number and wraps its scope's
forward with an instance attribute; nothing global is patched, `detach()` restores the model exactly:

    replayer = routereplay.attach(model)
    with replayer.record() as rec:          # R2 old-log-prob pass, or the built-in engine
        model(input_ids, attention_mask=mask)
    routes_BSLK, traces = rec.routes, rec.traces(mask)
    with replayer.replay(routes_BSLK):      # update step: forward AND backward inside
        loss = loss_fn(model(input_ids, attention_mask=mask)); loss.backward()

Recompute safety: a router call made during backward (an activation-checkpoint recompute) reuses
the routes of its own forward, in replay (same forced routes) and in record (the recorded choice,
not a fresh top-k that near-ties could flip). A backward after a replay context closed raises
`ReplayStateError` rather than recompute natural routes. State lives on the Replayer and its sessions.

Threads: a context belongs to the thread that opened it; other threads' forwards route naturally,
untouched and unrecorded. Backward recomputes count as the owner's on its thread or on an autograd
engine thread (CUDA backward). A second thread opening a context gets `ForeignThreadError`.

Columns: a layer with several routers (JetMoE, Ernie-4.5-VL) has a column per router, `(layer, slot)`
(`.columns`); modality routers replay each token in the router that runs for it
(`runtime/modality.py`). DSA models' indexers are recorded and replayed with the routers
(`Recording.indexer`, `replay(indexer=...)`, `runtime/indexer/replayer.py`).

Alignment: `replay(...)` refuses routes placed on the wrong tokens (`runtime/alignment.py`): a
routes tensor whose -1 padding disagrees with the attention mask, a trace that stops short of its
sequence (`PaddingMismatchError`), and a batch whose token ids differ from the traces' `token_ids`
(`TokenMismatchError`, checked at entry with `input_ids=` and at every forward that passes them).

Saving and copying: hooks and wrapped forwards pickle and deep-copy as inert stand-ins, so
`torch.save(model)` / `copy.deepcopy(model)` give an unattached copy (`runtime/attachment.py`).
Contexts, `Recording` and `ReplayStats` are `runtime/session.py`; a router call holds no host sync,
and `torch.compile`d MoE blocks trace it without a graph break (`runtime/interception.py`).

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens in a call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from routereplay.enums import ReplayMode, ReplayOrder
from routereplay.errors import (
    AlreadyAttachedError,
    ConfigError,
    ForeignThreadError,
    KernelBypassError,
    NoRoutersError,
    ReplayStateError,
    UnsupportedRouterError,
)
from routereplay.runtime.alignment import check_padding, check_tokens, refuse_meta
from routereplay.runtime.attachment import _ModelCallHook as _ModelCallHook  # pickles of earlier releases
from routereplay.runtime.attachment import _unwrapped as _unwrapped  # name these two here
from routereplay.runtime.attachment import attached_replayer, bind, unbind
from routereplay.runtime.binding import JITTER_ATTRS, AuxLossRouting, Binding, JitterPolicy
from routereplay.runtime.call_inputs import attributes, call_ids, call_shape, refuse_kernels
from routereplay.runtime.disagreement import DisagreementCounter
from routereplay.runtime.discovery import RouterSite, discover
from routereplay.runtime.family_interceptors import interceptor_for
from routereplay.runtime.gate_weights import WeightsCapture, WeightsGrad, WeightsReplay, experts_sites, replay_weights
from routereplay.runtime.gate_weights import weights_grad as weights_grad_of
from routereplay.runtime.indexer.choices import replay_choices
from routereplay.runtime.indexer.discovery import discover_indexers, unbound_indexers
from routereplay.runtime.indexer.replayer import IndexerReplayer
from routereplay.runtime.interception import RouterSlot, in_backward, on_thread
from routereplay.runtime.modality import MODALITY_BLOCKS, checked_counts, rows_of, scatter_rows, token_types
from routereplay.runtime.routes import (
    check_routes,
    mask_array,
    refuse_unordered,
    replay_order,
    replay_routes,
    traces_to_routes,
)
from routereplay.runtime.session import Recording, ReplayStats, Session, guard_backward
from routereplay.runtime.threshold import check_margin, refuse_threshold
from routereplay.trace.route_trace import RouteTrace


class Replayer:
    """Record / replay controller bound to one model's routers (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        strict: bool = True,
        aux_loss_routing: AuxLossRouting | str = AuxLossRouting.NATURAL,
        jitter: JitterPolicy | str = JitterPolicy.MODEL,
        sync_free: bool | None = None,
        count_disagreement: bool = True,
    ) -> None:
        if attached_replayer(model) is not None:
            raise AlreadyAttachedError("this model already has a Replayer attached; call .detach() on it first")
        try:
            self.aux_loss_routing = AuxLossRouting(aux_loss_routing)
        except ValueError:
            raise ConfigError(
                f"aux_loss_routing={aux_loss_routing!r}: only 'natural' is supported - HF computes the load-balancing "
                "loss from router logits outside the router, with its own top-k, so it always sees natural routing"
            ) from None
        try:
            self.jitter = JitterPolicy(jitter)
        except ValueError:
            raise ConfigError(f"jitter={jitter!r}: use 'model' (the model's own jitter) or 'off'") from None
        if not isinstance(strict, bool):
            raise ConfigError(f"strict={strict!r}: pass True (refuse unreplayable routers) or False")
        if sync_free is not None and not isinstance(sync_free, bool):
            raise ConfigError(f"sync_free={sync_free!r}: pass None (decided by the routers' device), True or False")
        self.sync_free = sync_free  # None: sync-free when the routers are off the CPU (`runtime/transfer.py`)
        self.count_disagreement = check_flag(count_disagreement, "count_disagreement")  # replay's default
        refuse_kernels(model)
        sites, refused = discover(model)
        if not sites and not refused:
            raise NoRoutersError(
                f"{type(model).__name__} has no top-k router module (classes ending in Router/Gate/TopkRouter); "
                "is it an MoE model?"
            )
        blocking = [r for r in refused if not r.natural_ok]
        if (
            not sites
            and refused
            and all(r.reason.startswith(("MTP layer", "layer ")) and r.natural_ok for r in refused)
        ):
            raise UnsupportedRouterError(
                f"{type(model).__name__} holds only MTP (draft) routers ({refused[0].name}, ...), which replay leaves "
                "natural: their layers are numbered from 0 again and would take the decoder's routes. Attach the "
                "main model (its decoder layers are the ones traces cover), not its MTP module"
            )
        if not sites and refused:
            blocking = refused
        if blocking and (strict or not sites):
            details = "; ".join(f"{r.name} ({r.family}): {r.reason}" for r in blocking[:4])
            raise UnsupportedRouterError(
                f"{len(blocking)} router(s) cannot be replayed faithfully: {details}"
                + ("; pass strict=False to bind the others and leave these natural" if sites else "")
            )
        self.model, self.sites, self.refused = model, sites, refused
        for column, site in enumerate(sites):
            site.column = column
        self.layers: tuple[int, ...] = tuple(s.layer for s in sites)  # global layer of each column (may repeat)
        self.slot_names = tuple(s.slot for s in sites) if any(s.slot for s in sites) else None
        self.columns = tuple(zip(self.layers, self.slot_names or ("",) * len(sites), strict=True))
        self.bindings = tuple(
            Binding(s.layer, s.name, s.family, s.top_k, s.num_choices, s.slot, str(s.modality or "")) for s in sites
        )
        self.top_k = sites[0].top_k
        self.num_experts = max(s.num_choices for s in sites)
        self._stats = ReplayStats()
        self.slots = tuple(RouterSlot() for _ in sites)  # what each router call reads and leaves (see Session)
        self.mode = ReplayMode.OFF
        self._session: Session | None = None
        self._pending_replay: int | None = None  # thread of a replayed forward whose backward may still run
        self._saved_jitter: list[tuple[nn.Module, str, float]] = []
        self._handles = bind(self)
        # DSA models: the sparse-attention indexers, recorded and replayed in the same contexts
        self.indexer = IndexerReplayer(model) if discover_indexers(model) else None

    @property
    def stats(self) -> ReplayStats:
        """The counters (cumulative; `.reset()` them between passes), with every router call folded in."""
        session = self._session
        if session is not None and session.owned_here():
            session.collect()  # compiled routers leave their choices for the host to count
        return self._stats

    # -- contexts ----------------------------------------------------------------------------------
    @contextmanager
    def record(self, *, weights: bool = False) -> Iterator[Recording]:
        """Routers run naturally; their choices are kept, aligned with the input.

        `weights=True` also keeps the combine weights the experts receive (`Recording.weights`, and
        `RouteTrace.weights` in `.traces(...)`); see `runtime/gate_weights/`.
        The context belongs to the calling thread: other threads' forwards are neither recorded nor touched."""
        if not isinstance(weights, bool):
            raise ConfigError(f"record(weights={weights!r}): pass True to keep the combine weights, or False")
        experts = experts_sites(self.sites, "recording weights") if weights else None
        session = self._enter(ReplayMode.RECORD, None)
        capture = (
            None if experts is None else WeightsCapture(experts, session.owned_here, lambda: len(session.steps) - 1)
        )
        try:
            yield Recording(session, weights=capture)
        finally:
            try:
                self._exit(session)
            finally:
                if capture is not None:
                    capture.close()

    @contextmanager
    def replay(
        self,
        routes: torch.Tensor | np.ndarray | Sequence[RouteTrace],
        attention_mask: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        check_alignment: bool = True,
        order: ReplayOrder | str = ReplayOrder.SET,
        indexer: torch.Tensor | None = None,
        weights: torch.Tensor | np.ndarray | bool | None = None,
        weights_grad: WeightsGrad | str = WeightsGrad.FROZEN,
        threshold: float | None = None,
        count_disagreement: bool | None = None,
    ) -> Iterator[Recording]:
        """Force routes: a (B, S, L, K) int tensor or numpy array aligned with the input, or RouteTraces + mask.

        -1 rows fall back to the live router for that token only (counted in `stats.fallback_rows`;
        with an attention_mask, padding positions count neither as fallback nor as replayed rows).
        Run forward AND backward inside the context. The context value's `.routes` are the routes used.
        The context belongs to the calling thread: other threads' forwards route naturally meanwhile.

        Alignment checks (`check_alignment=True`, the default; see `runtime/alignment.py`):
        - a routes tensor with an attention_mask: -1 padding that disagrees with the mask (routes laid
          out for the other padding side) is a `PaddingMismatchError`;
        - RouteTraces: a trace must route its sequence up to the last token (which may lack a route);
        - RouteTraces carrying `token_ids`: the batch's ids must match, checked here when `input_ids`
          is given and again at every forward called with `input_ids` (`TokenMismatchError`, which
          names a one-position shift such as an extra or stripped BOS).
        `check_alignment=False` replays a layout you built on purpose as given.

        `order` is the top-k order forced into the model's combine (it changes bf16 accumulation):
        `"set"` (default) forces each row's expert set in the order the live router gives that set
        (its own order when the set is its choice), so set-codec routes replay bit-exact;
        `"engine"` forces the routes' own order (ordered codec, engines returning unsorted top-k).
        RouteTraces that kept only the set (`ordered=False`) are refused under `"engine"`.

        DSA models (DeepSeek-V3.2, GLM-5): the indexers' key choices are forced too, from the traces'
        `indexer` (`IndexerTrace`) or from `indexer=` (a (B, S, L_dsa, I) int tensor of batch columns,
        -1 rows = the live indexer); without either the indexers run live and are recorded
        (`Recording.indexer`). Forced choices are the keys attention attends (`runtime/indexer/discovery.py`).

        `weights` (off by default; `runtime/gate_weights/`): the engine's combine weights, a (B, S, L, K)
        float tensor aligned like the routes, or True to take them from the RouteTraces (`RouteTrace.weights`),
        replace the gate weights the experts receive on those rows (matched by expert id, so set and engine
        order both work; -1 rows keep the live weights). `weights_grad`: "frozen" (no router gradient from
        those rows) or "live" (the live weights' gradient). Families whose experts take no weights argument
        are refused (`WeightsUnsupportedError`). `threshold` (off by default; `runtime/threshold.py`): keep a
        forced row only where every forced id's selection score is within `threshold` of the live top-k's
        K-th score, else the live choice; counted in `stats.replaced_rows` / `stats.replace_rate`.
        `count_disagreement` (None: the Replayer's, True unless `attach(count_disagreement=False)`): count the
        replayed rows whose set differs from the trainer's live choice (`stats.disagree_rows`, per layer, tokens
        per expert; `runtime/disagreement.py`), on the device, read when the context closes.
        """
        order = replay_order(order)
        if not isinstance(check_alignment, bool):
            raise ConfigError(f"check_alignment={check_alignment!r}: pass True (the default) or False")
        refuse_meta(attention_mask, "attention_mask")
        refuse_meta(input_ids, "input_ids")
        mask_BS = None if attention_mask is None else mask_array(attention_mask)  # on a device: one copy to host
        given = replay_routes(routes)
        traces = None if isinstance(given, torch.Tensor) else given
        indexer = replay_choices(self.indexer, type(self.model).__name__, traces, attention_mask, indexer)
        if traces is not None:
            if mask_BS is None:
                raise ConfigError("replaying RouteTraces needs the batch's attention_mask to place them")
            if order is ReplayOrder.ENGINE:
                refuse_unordered(traces)
            if check_alignment and input_ids is not None:
                self.stats.checked_sequences += check_tokens(traces, mask_BS, input_ids)
            routes_BSLK = traces_to_routes(
                traces, mask_BS, self.layers, self.top_k, check_alignment=check_alignment, slots=self.slot_names
            )
        else:
            routes_BSLK = cast(torch.Tensor, given)
        if traces is None and input_ids is not None:
            raise ConfigError(
                "input_ids is checked against the token_ids of RouteTraces, and a routes tensor carries none: pass "
                "the traces with attention_mask (Recording.traces(mask, input_ids=ids) keeps them), or drop input_ids"
            )
        self._check_uniform_top_k()
        # the host copy of the routes: every check and count reads it, never the device (`runtime/transfer.py`)
        checked = check_routes(routes_BSLK, self.layers, self.top_k, self.num_experts, self.slot_names)
        if check_alignment and traces is None and mask_BS is not None:
            check_padding(checked, mask_BS)
        margin, grad = check_margin(threshold), weights_grad_of(weights_grad)
        counting = (
            self.count_disagreement
            if count_disagreement is None
            else check_flag(count_disagreement, "count_disagreement")
        )
        if margin is not None:
            refuse_threshold(self.sites)
        forced_weights = replay_weights(self.sites, torch.from_numpy(checked), weights, traces, mask_BS)
        session = self._enter(
            ReplayMode.REPLAY, checked, mask_BS, traces if check_alignment else None, order, routes_BSLK.device
        )
        for slot in self.slots:
            slot.threshold, slot.count_disagreement = margin, counting
        if counting:
            session.disagreement = DisagreementCounter(self.sites)
        forcing = (
            None
            if forced_weights is None
            else WeightsReplay(*forced_weights, grad, session.owned_here, host_reads=not session.sync_free)
        )
        if self.indexer is not None and indexer is not None:
            try:
                self.indexer.begin_replay(indexer, attention_mask=attention_mask)
            except BaseException:
                self._exit(session)
                if forcing is not None:
                    forcing.close()
                raise
            session.indexer_replayed = True
        try:
            yield Recording(session)
        finally:
            try:
                self._exit(session)
            finally:
                if forcing is not None:
                    forcing.close()
        if session.token_check is not None:  # sync-free: the forwards' token ids, read once the step is over
            session.token_check.finish()

    def detach(self) -> None:
        """Unbind every router and remove every hook: the model is exactly as before `attach`."""
        if self._session is not None:
            raise ReplayStateError("detach() inside a record/replay context; leave the context first")
        unbind(self, self._handles)
        if self.indexer is not None:
            self.indexer.detach()

    def describe(self) -> str:
        lines = [
            f"{len(self.sites)} routers bound (top-{self.top_k} of {self.num_experts}), layers {list(self.layers)}"
        ]
        lines += [
            f"  layer {b.layer}{f' [{b.slot}]' if b.slot else ''}: {b.name} ({b.family}"
            + (f", {b.modality} tokens)" if b.modality else ")")
            for b in self.bindings
        ]
        lines += [
            f"  {'left natural' if r.natural_ok else 'refused'} {r.name} ({r.family}): {r.reason}" for r in self.refused
        ]
        lines += [f"  live indexer {name}: {why}" for name, why in unbound_indexers(self.model)]
        return "\n".join(lines)

    # -- internals ---------------------------------------------------------------------------------
    def _enter(
        self,
        mode: ReplayMode,
        routes: np.ndarray | None,
        attention_mask: np.ndarray | None = None,
        traces: Sequence[RouteTrace] | None = None,
        order: ReplayOrder = ReplayOrder.SET,
        routes_device: torch.device | None = None,
    ) -> Session:
        current = self._session
        if current is not None and current.thread != threading.get_ident():
            raise ForeignThreadError(
                f"thread {current.thread} holds a {current.mode} context on this Replayer, and a context belongs to "
                f"the thread that opened it; thread {threading.get_ident()} cannot open a {mode} context until it "
                "closes. Its forwards meanwhile route naturally; to replay in parallel, attach a copy of the model "
                "per thread"
            )
        if current is not None:
            raise ReplayStateError(f"already inside a {self.mode} context; contexts do not nest")
        self._session = Session(self, mode, routes, attention_mask, traces, order, routes_device)
        if self.indexer is not None and mode is ReplayMode.RECORD:
            self._session.indexer_recording = self.indexer.begin_record()
        self.mode = mode
        if self.jitter is JitterPolicy.OFF:  # jitter acts in the block, before the router: off for the context
            for module in {
                id(m): m for s in self.sites for m in (s.router, s.scope, s.block) if m is not None
            }.values():
                for name in JITTER_ATTRS:
                    value = getattr(module, name, None)
                    if isinstance(value, float) and value:
                        self._saved_jitter.append((module, name, value))
                        setattr(module, name, 0.0)
        return self._session

    def _exit(self, session: Session) -> None:
        if self.indexer is not None and (session.indexer_recording is not None or session.indexer_replayed):
            self.indexer.end()
        for module, name, value in self._saved_jitter:
            setattr(module, name, value)
        self._saved_jitter.clear()
        session.close()
        self._session = None
        self.mode = ReplayMode.OFF

    def _check_uniform_top_k(self) -> None:
        if len({s.top_k for s in self.sites}) != 1:
            raise ConfigError(f"routers use different top-k per layer {[s.top_k for s in self.sites]}; not supported")

    def _on_model_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if in_backward():
            return
        session = self._session
        if session is None:
            if self._pending_replay == threading.get_ident():
                self._pending_replay = None
            return
        if not session.owned_here():
            return  # another thread's forward: routes naturally, untouched and unrecorded
        self._stats.forwards += 1
        if session.mode is ReplayMode.REPLAY and torch.is_grad_enabled():
            self._pending_replay = session.thread  # reentrant checkpointing runs the layers under no_grad
        shape = call_shape(args, kwargs)
        if shape is not None:
            session.begin_step(shape, call_ids(args, kwargs))

    def _on_split(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A modality block is called: pick the tokens each of its routers sees (see `runtime/modality.py`)."""
        session = self._session
        if session is None or not session.owned_here():
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        tokens = int(hidden.shape[0] * hidden.shape[1]) if isinstance(hidden, torch.Tensor) else 0
        for site, slot in zip(self.sites, self.slots, strict=True):
            if site.splitter is not block or site.modality is None:
                continue
            split = MODALITY_BLOCKS[type(block).__name__]
            slot.rows_T = rows_of(site.modality, token_types(split, args, kwargs), tokens)
            if session.mode is ReplayMode.REPLAY and slot.forced_TK is not None and not in_backward():
                where = f"layer {site.layer} ({site.name})"
                slot.counts = checked_counts(slot.forced_TK, slot.rows_T, session.attended_T, where, site.modality)

    def _route(
        self,
        site: RouterSite,
        slot: RouterSlot,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        session = self._session
        if session is not None and session.owned_here():
            return self._call(session, site, slot, original, args, kwargs)
        pending = self._pending_replay
        if session is None and pending is not None and in_backward() and on_thread(pending):
            raise ReplayStateError(
                f"layer {site.layer} is recomputed during a backward that runs after its replay context "
                "closed; it would route naturally. Run backward inside `with replayer.replay(...)`"
            )
        return original(*args, **kwargs)  # no context, or another thread's: natural

    def _call(
        self,
        session: Session,
        site: RouterSite,
        slot: RouterSlot,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        # no host sync and no counting on this path: it may be traced by torch.compile (see Session)
        backward = in_backward()  # False while dynamo traces
        if backward:
            self._stats.router_calls += 1
            self._stats.recompute_calls += 1
        interceptor = interceptor_for(site, slot, session.forced)
        overrides = dict(site.replay_overrides) if session.mode is ReplayMode.REPLAY else {}
        with attributes(site.router, overrides), interceptor:
            output = original(*args, **kwargs)
        if interceptor.hits == 0 and site.modality is not None and slot.rows_T is not None and not slot.rows_T.any():
            interceptor.last = torch.empty((0, site.top_k), dtype=torch.long)  # no token of its modality here
        elif interceptor.hits == 0:
            raise KernelBypassError(
                f"layer {site.layer} ({site.name}) ran without a visible top-{site.top_k} over {site.num_choices} "
                "choices: a fused or hub kernel (or a changed router) bypassed replay; disable kernels"
            )
        assert interceptor.last is not None
        if not backward:  # a recompute's choice is its forward's: neither recorded nor counted again
            slot.chosen_TK = interceptor.last if site.modality is None else scatter_rows(interceptor.last, slot.rows_T)
            if not torch.compiler.is_compiling():  # eager: count now; compiled: at the next forward or exit
                session.collect_one(site.column)
        if session.mode is ReplayMode.REPLAY and torch.is_grad_enabled() and not backward:
            self._pending_replay = session.thread
            guard_backward(output, session, site)
        return output


def check_flag(value: object, name: str) -> bool:
    """`value` when it is a bool, else `ConfigError` naming the option."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: pass True or False")
    return value


def attach(
    model: nn.Module,
    *,
    strict: bool = True,
    aux_loss_routing: str = "natural",
    jitter: JitterPolicy | str = "model",
    sync_free: bool | None = None,
    count_disagreement: bool = True,
) -> Replayer:
    """Bind every router (and DSA indexer) of an HF transformers MoE model for record / replay (`Replayer`).

    `sync_free`: None (default) reads no device value in a replayed step when the routers are off the CPU;
    True does so on CPU too (the CPU's value-reading fast paths off: for tests), False never (`runtime/transfer.py`).
    `count_disagreement`: `replay`'s default for counting disagreement (`runtime/disagreement.py`)."""
    return Replayer(
        model,
        strict=strict,
        aux_loss_routing=aux_loss_routing,
        jitter=jitter,
        sync_free=sync_free,
        count_disagreement=count_disagreement,
    )


__all__ = ["AuxLossRouting", "Binding", "JitterPolicy", "Recording", "ReplayStats", "Replayer", "attach"]
