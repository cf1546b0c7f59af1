"""One record or replay context of a `Replayer`: its state, what it captured, and the counters.

`Session` is the state of one open context: the thread that owns it, its steps (one per forward call,
each holding the routes every bound layer used) and, in replay, the routes it forces. `Recording` is
what `with replayer.record()` / `replayer.replay(...)` yields; `ReplayStats` counts what the routers did.
`guard_backward` makes a gradient that reaches a router after its replay context closed an error.

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens in a call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from routereplay.enums import ReplayMode, Source
from routereplay.errors import BatchShapeError, KernelBypassError, RecomputeError, ReplayStateError
from routereplay.runtime.alignment import check_tokens
from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.interception import in_backward, on_thread
from routereplay.runtime.routes import mask_array, routes_to_traces
from routereplay.trace import RouteTrace

if TYPE_CHECKING:
    from routereplay.runtime.replayer import Replayer


@dataclass(slots=True)
class ReplayStats:
    """Counters of what the routers did; `Replayer.stats`, reset with `.reset()`."""

    forwards: int = 0
    router_calls: int = 0
    recompute_calls: int = 0  # router calls made during backward (checkpoint recompute)
    recorded_rows: int = 0  # (token, layer) rows recorded
    replayed_rows: int = 0  # (token, layer) rows forced from routes, on attended positions only
    fallback_rows: int = 0  # (token, layer) rows of -1 on attended positions, served by the live router
    fallback_rows_by_layer: dict[int, int] = field(default_factory=dict)
    checked_sequences: int = 0  # sequences whose token ids were checked against the batch (traces with ids)

    def reset(self) -> None:
        for name in (
            "forwards",
            "router_calls",
            "recompute_calls",
            "recorded_rows",
            "replayed_rows",
            "fallback_rows",
            "checked_sequences",
        ):
            setattr(self, name, 0)
        self.fallback_rows_by_layer.clear()


class Session:
    """State of one record or replay context: its owner thread, steps (forward calls) and routes."""

    def __init__(
        self,
        replayer: Replayer,
        mode: ReplayMode,
        routes_BSLK: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        traces: Sequence[RouteTrace] | None = None,
    ) -> None:
        self.replayer, self.mode, self.open = replayer, mode, True
        self.thread = threading.get_ident()  # the context belongs to the thread that opened it
        self.attended_T = None if attention_mask is None else torch.as_tensor(attention_mask).reshape(-1).bool()
        self.traces = None if traces is None or all(t.token_ids is None for t in traces) else list(traces)
        self.mask_BS = None if attention_mask is None or self.traces is None else mask_array(attention_mask)
        self.routes_LTK: torch.Tensor | None = None
        self.batch_shape: tuple[int, int] | None = None
        if routes_BSLK is not None:
            batch, positions, layers, k = routes_BSLK.shape
            self.batch_shape = (batch, positions)
            self.routes_LTK = routes_BSLK.permute(2, 0, 1, 3).reshape(layers, batch * positions, k).contiguous()
        self.steps: list[tuple[tuple[int, int], dict[int, torch.Tensor]]] = []
        self._attended_on: dict[torch.device, torch.Tensor] = {}  # attended_T per device of the router calls

    def owned_here(self) -> bool:
        """True when the current router call belongs to this context (see "Threads" in `runtime/replayer.py`)."""
        return on_thread(self.thread)

    # -- steps -------------------------------------------------------------------------------------
    def begin_step(self, shape: tuple[int, int], input_ids: torch.Tensor | None = None) -> None:
        if self.mode is ReplayMode.REPLAY and self.batch_shape is not None and shape != self.batch_shape:
            raise BatchShapeError(
                f"replay routes are for a batch of (B, S) = {self.batch_shape} but the model is called with "
                f"{shape}; routes must be aligned with the model input"
            )
        if self.traces is not None and self.mask_BS is not None and input_ids is not None:
            self.replayer.stats.checked_sequences += check_tokens(self.traces, self.mask_BS, input_ids)
        self.steps.append((shape, {}))

    def forced(self, site: RouterSite, rows: int) -> torch.Tensor | None:
        index = self.replayer.layer_index[site.layer]
        if self.mode is ReplayMode.RECORD:
            if not in_backward():
                return None
            for _, recorded in reversed(self.steps):  # recompute: reuse this layer's recorded choice
                found = recorded.get(site.layer)
                if found is not None and found.shape[0] == rows:
                    return found.to(torch.long)
            raise RecomputeError(
                f"layer {site.layer} ({site.name}) is recomputed during backward with {rows} tokens, but no "
                "forward of this record context routed that many tokens there"
            )
        assert self.routes_LTK is not None
        if rows != self.routes_LTK.shape[1]:
            raise BatchShapeError(
                f"layer {site.layer} ({site.name}) routes {rows} tokens but the replay routes hold "
                f"{self.routes_LTK.shape[1]} (B * S = {self.batch_shape}); routes must be aligned with the input"
            )
        return self.routes_LTK[index]

    def sink(self, site: RouterSite, chosen_TK: torch.Tensor, fallback_T: torch.Tensor | None) -> None:
        stats = self.replayer.stats
        if in_backward():
            return
        if not self.steps:
            self.begin_step((1, chosen_TK.shape[0]))
        self.steps[-1][1][site.layer] = chosen_TK.detach().to(torch.int32)  # replay: the routes used
        if self.mode is ReplayMode.RECORD:
            stats.recorded_rows += chosen_TK.shape[0]
        else:
            rows, device = chosen_TK.shape[0], chosen_TK.device
            fallback_T = torch.zeros(rows, dtype=torch.bool, device=device) if fallback_T is None else fallback_T
            forced_T = ~fallback_T
            if self.attended_T is not None and self.attended_T.numel() == rows:
                attended_T = self._attended_on.get(device)
                if attended_T is None:
                    attended_T = self._attended_on[device] = self.attended_T.to(device)
                fallback_T, forced_T = fallback_T & attended_T, forced_T & attended_T  # padding is neither
            fallbacks, forced = torch.stack([fallback_T.sum(), forced_T.sum()]).tolist()  # one device sync
            stats.replayed_rows += forced
            stats.fallback_rows += fallbacks
            if fallbacks:
                stats.fallback_rows_by_layer[site.layer] = stats.fallback_rows_by_layer.get(site.layer, 0) + fallbacks


class Recording:
    """What a context captured. `.routes` is (B, S, L, K); `.traces(mask)` per sequence; `.stats`.

    Under `record()` these are the routers' own choices; under `replay()` the routes actually used
    (the forced ids, and the live choice on -1 rows).

    Forward calls in one context are steps: incremental decoding with a KV cache (prefill, then one
    position per step) concatenates along S. Independent micro-batches belong in separate contexts,
    or read `.steps`.
    """

    def __init__(self, session: Session, layers: tuple[int, ...], num_experts: int) -> None:
        self._session, self.layers, self.num_experts = session, layers, num_experts

    @property
    def stats(self) -> ReplayStats:
        """The Replayer's counters (cumulative; `.reset()` them between passes)."""
        return self._session.replayer.stats

    @property
    def steps(self) -> list[torch.Tensor]:
        """One (B, S_i, L, K) int tensor per forward call."""
        out = []
        for (batch, positions), recorded in self._session.steps:
            missing = [layer for layer in self.layers if layer not in recorded]
            if missing:
                raise KernelBypassError(
                    f"layers {missing} recorded nothing in a forward: their routers never ran (a fused kernel "
                    "replaced the MoE block?) or ran outside this model's forward"
                )
            stacked = torch.stack([recorded[layer] for layer in self.layers], dim=1)  # (T, L, K)
            out.append(stacked.reshape(batch, positions, len(self.layers), -1))
        return out

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

        With the batch's `input_ids` the traces carry their token ids, so a later replay checks them."""
        return routes_to_traces(
            self.routes, attention_mask, self.layers, self.num_experts, source, policy_version, input_ids
        )


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
