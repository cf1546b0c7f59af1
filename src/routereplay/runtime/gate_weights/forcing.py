"""Putting given combine weights into the experts' call (replay), and reading the ones they receive (record).

Both are forward pre-hooks on each bound router's experts module (`runtime/gate_weights/experts.py`),
installed for one context and removed when it closes; calls from other threads, and a context's
backward recomputes for capture, pass through untouched.

Replay (`WeightsReplay`). A weight belongs to an (row, expert id) pair: for each of the K ids the
experts receive (the forced ids, in set or engine order), the given weight of the same id in that
row's route is taken. A row takes the given weights only where its K ids are exactly its route's set
(a -1 route row, or a row a threshold gave back to the live router, keeps the live weights). Gradient
to the router on those rows (`WeightsGrad`):
- `"frozen"`: the given weights as constants, so those rows send no gradient to the router (as
  prime-rl #3523 "Total Router Recall");
- `"live"`: value = given weights, gradient = the live weights' (`w_given + (w_live - w_live.detach())`),
  the gradient plain replay gives.
Every call is checked against the router's own rows: when the live rows of a call (2 or more) all
sum to one value (a normalising router, its scaling included), the given rows must sum to it too
(`WeightsSumError`); on CPU at once, on other devices and under `torch.compile` at the context's
exit (no host sync and no graph break in a step).

Capture (`WeightsCapture`): the (T, K) weights each experts call received, per forward step, as
float32, aligned with the routes recorded in the same step (the experts receive the router's ids in
the router's order).

Legend: B = batch rows, S = positions, L = bound layers, K = top-k, T = B * S tokens in a call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from routereplay.enums import StrEnum
from routereplay.errors import BatchShapeError, ConfigError, ReplayStateError, WeightsSumError
from routereplay.runtime.gate_weights.checks import SUM_RTOL
from routereplay.runtime.gate_weights.experts import ExpertsSite
from routereplay.runtime.interception import in_backward
from routereplay.runtime.transfer import to_device


class WeightsGrad(StrEnum):
    """The router's gradient on rows whose weights are replayed."""

    FROZEN = "frozen"  # no gradient to the router from those rows
    LIVE = "live"  # the live weights' gradient (value: the given weights)


def weights_grad(value: WeightsGrad | str) -> WeightsGrad:
    try:
        return WeightsGrad(value)
    except ValueError:
        raise ConfigError(
            f"weights_grad={value!r}: use 'frozen' (no router gradient on replayed rows) or 'live' (the live "
            "weights' gradient)"
        ) from None


def mapped_weights(
    index_TK: torch.Tensor, ids_TK: torch.Tensor, given_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The given weight of each received id (matched by id in its row), and which rows hold their route's set."""
    match_TKK = index_TK[:, :, None] == ids_TK[:, None, :]
    mapped_TK = (match_TKK * given_TK[:, None, :]).sum(-1)  # one match: exact (x * 1 + zeros)
    rows_T1 = match_TKK.any(-1).all(-1, keepdim=True) & (ids_TK[:, :1] >= 0)
    return mapped_TK, rows_T1


class WeightsReplay:
    """The given weights of one replay context, put into every experts call of its routers."""

    def __init__(
        self,
        experts: Sequence[ExpertsSite],
        routes_BSLK: torch.Tensor,
        weights_BSLK: torch.Tensor,
        grad: WeightsGrad,
        owned: Callable[[], bool],
        *,
        host_reads: bool = True,
    ) -> None:
        layers = routes_BSLK.shape[2]
        self.host_reads = host_reads  # False in a sync-free context: the sum checks wait for the exit
        self.routes_LTK = routes_BSLK.permute(2, 0, 1, 3).reshape(layers, -1, routes_BSLK.shape[3]).long()
        self.weights_LTK = weights_BSLK.permute(2, 0, 1, 3).reshape(layers, -1, weights_BSLK.shape[3])
        self.grad, self.owned = grad, owned
        self.pending: list[tuple[ExpertsSite, torch.Tensor]] = []  # sum checks left for the exit (not CPU)
        self.replaced_calls = 0
        self.handles: list[RemovableHandle] = []
        self.on_device: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        for site in experts:
            self.handles.append(site.experts.register_forward_pre_hook(self._hook(site), with_kwargs=True))

    def _hook(self, site: ExpertsSite) -> Callable[..., Any]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self.owned():
                return None
            index_TK, live_TK = site.arguments(args, kwargs)
            return site.with_weights(args, kwargs, self.replaced(site, index_TK, live_TK))

        return hook

    def replaced(self, site: ExpertsSite, index_TK: torch.Tensor, live_TK: torch.Tensor) -> torch.Tensor:
        column = site.site.column
        key = (column, live_TK.device)
        if key not in self.on_device:
            self.on_device[key] = (  # from the host copies, pinned and non-blocking: no host sync (`transfer`)
                to_device(self.routes_LTK[column].numpy(), live_TK.device),
                to_device(self.weights_LTK[column].numpy(), live_TK.device, torch.float32),
            )
        ids_TK, given_TK = self.on_device[key]
        if ids_TK.shape[0] != index_TK.shape[0]:
            raise BatchShapeError(
                f"layer {site.site.layer}: the experts receive {index_TK.shape[0]} tokens but the replayed weights "
                f"hold {ids_TK.shape[0]}; weights must be aligned with the input like the routes"
            )
        mapped_TK, rows_T1 = mapped_weights(index_TK, ids_TK, given_TK)
        if not in_backward():
            self._check_sums(site, live_TK, mapped_TK, rows_T1)
        mapped_TK = mapped_TK.to(live_TK.dtype)
        if self.grad is WeightsGrad.LIVE:
            mapped_TK = mapped_TK + (live_TK - live_TK.detach())
        self.replaced_calls += 1
        return torch.where(rows_T1, mapped_TK, live_TK)

    def _check_sums(
        self, site: ExpertsSite, live_TK: torch.Tensor, mapped_TK: torch.Tensor, rows_T1: torch.Tensor
    ) -> None:
        if live_TK.shape[0] < 2:
            return
        with torch.no_grad():
            live_T = live_TK.float().sum(-1)
            level = live_T.mean()
            constant = (live_T.max() - live_T.min()) <= SUM_RTOL * level.abs()
            off_T = rows_T1[:, 0] & ((mapped_TK.sum(-1) - level).abs() > SUM_RTOL * level.abs())
            bad = constant & off_T.any()
        if self.host_reads and bad.device.type == "cpu" and not torch.compiler.is_compiling():
            self._raise_if(site, bad)
        else:
            self.pending.append((site, bad))

    def close(self) -> None:
        """Remove the hooks, then run the sum checks left for the exit."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        pending, self.pending = self.pending, []
        if not pending:
            return
        first = pending[0][1]
        if not bool(torch.stack([bad.to(first.device) for _, bad in pending]).any()):  # one host read for all
            return
        for site, bad in pending:
            self._raise_if(site, bad)

    @staticmethod
    def _raise_if(site: ExpertsSite, bad: torch.Tensor) -> None:
        if bool(bad):
            raise WeightsSumError(
                f"layer {site.site.layer} ({site.site.family}): the router's own weights all sum to one value, but "
                "some given rows do not: pass the weights the engine's experts received (normalised, scaled)"
            )


class WeightsCapture:
    """The (T, K) weights each experts call of a record context received, per forward step."""

    def __init__(self, experts: Sequence[ExpertsSite], owned: Callable[[], bool], step: Callable[[], int]) -> None:
        self.owned, self.step = owned, step
        self.columns = len(experts)
        self.steps: dict[int, dict[int, torch.Tensor]] = {}
        self.handles = [site.experts.register_forward_pre_hook(self._hook(site), with_kwargs=True) for site in experts]

    def _hook(self, site: ExpertsSite) -> Callable[..., Any]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.owned() or in_backward():
                return
            _, weights_TK = site.arguments(args, kwargs)
            self.steps.setdefault(self.step(), {})[site.site.column] = weights_TK.detach().float()

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def weights(self, shapes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """(B, S, L, K) float32: every step's weights concatenated along S (`shapes`: each step's (B, S_i))."""
        out = []
        for index, (batch, positions) in enumerate(shapes):
            recorded = self.steps.get(index, {})
            if len(recorded) != self.columns:
                raise ReplayStateError(
                    f"forward step {index} recorded the weights of {len(recorded)} of {self.columns} layers: an "
                    "experts module ran outside its MoE block's forward, or not at all"
                )
            stacked = torch.stack([recorded[c] for c in range(self.columns)], dim=1)
            out.append(stacked.reshape(batch, positions, self.columns, -1))
        if not out:
            raise ReplayStateError(
                "no weights were recorded: call the model inside `with replayer.record(weights=True):`"
            )
        return torch.cat(out, dim=1)


__all__ = ["WeightsCapture", "WeightsGrad", "WeightsReplay", "mapped_weights", "weights_grad"]
