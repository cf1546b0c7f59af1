"""Interceptors of the families that do not select by one top-k over the experts: PhiMoE, Doge.

Like `TopKInterceptor` (`runtime/interception.py`), each replaces only the op whose indices become
the experts, returning the forced ids with the values the op's input holds there; every step after
it is the model's own code, so the weights are what the model's rule gives for the forced experts
and gradients reach the gate. Record keeps the live indices of the same op, and -1 rows take the
live choice. No host sync: every decision is a gather or a `torch.where`.

PhiMoE sparsemixer (`SparseMixerInterceptor`). `sparsemixer` picks expert 1 from the logits and
expert 2 from the logits with expert 1 masked to -inf; each weight is a softmax over the experts
whose relative distance to a threshold (`(threshold - s) / max(|s|, threshold) <= 2 * jitter_eps`)
keeps them. The op that chooses, by mode (`router.training`, what sparsemixer is given):
- eval: `logits.max(dim=-1, keepdim=True)`, twice. Its value is also the threshold, so replay makes
  the threshold the forced expert's logit: the forced expert always keeps a positive weight (its
  softmax over itself and the experts above or near it) and its gradient.
- training: the Gumbel draw `(masked - log(Exp(1))).max(dim=-1)`, twice (no keepdim). The threshold
  maxes and the Heun-mask maxes (keepdim) pass through: the threshold stays the max logit, as the
  model's training rule has it, and a forced expert beyond the threshold gets weight 0 (the model
  could never sample it). The noise is still drawn; the forced expert wins regardless.
So a selection is a `max` over the experts whose `keepdim` is `not training`; a call sees two.
The pick order is semantic (pick 1 is masked for pick 2, and each has its own threshold), so the
forced pair is ordered before pick 1: `order="engine"` as given; `order="set"` as the live rule would,
by logit descending (the raw logits: in training those of the first threshold max, not the Gumbel
scores). In eval that is the live order when the set is the live pair (ties too: the live pick 1
goes first whenever it is forced); in training the live picks are random draws, so a replayed pair
goes by logit whatever order it was sampled in (replay it with `order="engine"` from an ordered codec
to keep the draw's order).

Doge product keys (`ProductKeyInterceptor`). `DogeCDMoE` sorts each half of its gate logits
(`topk(keys)` over (2, T, keys): orders x and y), then takes the top-k of the keys x keys grid
x_sorted[a] + y_sorted[b], at positions a * keys + b. Expert = order_x[a] * keys + order_y[b].
The key sort passes through and its orders are kept; the grid top-k is the plain selection with
positions translated: live positions -> ids for the record, forced ids -> positions through the
inverse orders for replay, so the model's gather of its index grid yields the forced ids and its
softmax runs over their summed logits. In set order a row is ordered by the grid value at its forced
positions, descending (the live grid order when the set is the live one).

Legend: T = tokens in this router call, K = top-k, C = choices (experts), N = keys per half.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from routereplay.errors import KernelBypassError
from routereplay.runtime.discovery import RouterSite, Selection
from routereplay.runtime.interception import (
    TOPK_FUNCTIONS,
    ForcedLookup,
    RouterSlot,
    TopKInterceptor,
    topk_arguments,
)

MAX_FUNCTIONS = frozenset({torch.max, torch.Tensor.max})


class SparseMixerInterceptor(TopKInterceptor):
    """PhiMoE: forces sparsemixer's two picks (the threshold maxes in eval, the Gumbel maxes in training)."""

    def __init__(self, site: RouterSite, slot: RouterSlot, forced: ForcedLookup) -> None:
        super().__init__(site, slot, forced)
        self.picked_T: list[torch.Tensor] = []  # ids of each pick of this call, in order
        self.choice: tuple[torch.Tensor, bool] | None = None  # forced ids (T, 2), looked up at the first pick
        self.logits: torch.Tensor | None = None  # training: the input of the first threshold max (the logits)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in MAX_FUNCTIONS:
            return func(*args, **kwargs)
        scores = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if not isinstance(dim, int) or dim % scores.dim() != scores.dim() - 1:
            return func(*args, **kwargs)  # a full reduction, an elementwise max, or another dimension
        if scores.shape[-1] != self.site.num_choices:
            return func(*args, **kwargs)
        if keepdim == self.site.router.training:  # a threshold or Heun-mask max in training
            if not self.picked_T and self.logits is None:
                self.logits = scores  # the first threshold max: its input is the logits
            return func(*args, **kwargs)
        return self.pick(func, args, kwargs, scores, keepdim)

    def pick(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], scores: torch.Tensor, keepdim: bool
    ) -> Any:
        """One of the two picks: the live index (record) or the forced one, with the value there."""
        index = len(self.picked_T)
        if index >= self.site.top_k:
            raise KernelBypassError(
                f"layer {self.site.layer} ({self.site.name}) made a pick beyond sparsemixer's "
                f"{self.site.top_k}: the router's code changed; pin transformers or report it"
            )
        rows = scores.numel() // scores.shape[-1]
        live_T: torch.Tensor | None = None
        if index == 0:
            self.choice = self.forced(self.site, self.slot, rows)
            if self.choice is not None and not self.keeps_order():
                forced_TK, fallback = self.choice
                with torch.no_grad():
                    if not self.site.router.training:
                        live_T = func(*args, **kwargs)[1].reshape(rows)
                    self.choice = self.by_logit(forced_TK.to(scores.device), scores, live_T), fallback
        if self.choice is None:  # record (or a record's recompute, which is forced)
            with torch.no_grad():
                chosen_T = func(*args, **kwargs)[1].reshape(rows)
        else:
            forced_TK, fallback = self.choice
            if forced_TK.device != scores.device:
                forced_TK = forced_TK.to(scores.device)
            chosen_T = forced_TK[:, index]
            if fallback:  # -1 rows: the live pick, made after the live (or forced) first pick as usual
                if live_T is None:
                    with torch.no_grad():
                        live_T = func(*args, **kwargs)[1].reshape(rows)
                chosen_T = torch.where(forced_TK[:, 0] < 0, live_T, chosen_T)
        indices = chosen_T.reshape(*scores.shape[:-1], 1)
        values = scores.gather(-1, indices)
        if not keepdim:
            indices, values = indices.squeeze(-1), values.squeeze(-1)
        self.picked_T.append(chosen_T)
        if len(self.picked_T) == self.site.top_k:
            self.hits += 1
            self.last = torch.stack(self.picked_T, dim=1)
        return torch.return_types.max((values, indices))

    def by_logit(self, forced_TK: torch.Tensor, scores: torch.Tensor, live_T: torch.Tensor | None) -> torch.Tensor:
        """Set order: each forced pair by logit descending (stable), the live first pick first (eval).

        `scores` are pick 1's input: the logits in eval; in training the Gumbel scores, so the logits
        come from the threshold max seen before. `live_T` is the live pick 1 (eval), else None."""
        if self.site.router.training:
            if self.logits is None:
                raise KernelBypassError(
                    f"layer {self.site.layer} ({self.site.name}) made its first training pick without the threshold "
                    "max over its logits first: the router's code changed; pin transformers or report it"
                )
            scores = self.logits
        logits_TK = scores.reshape(-1, scores.shape[-1]).gather(-1, forced_TK.clamp(min=0))  # -1 rows: any id
        swap_T1 = logits_TK[:, 1:] > logits_TK[:, :1]  # sparsemixer makes two picks: K = 2
        if live_T is not None:
            first_T1, second_T1, live_T1 = forced_TK[:, :1], forced_TK[:, 1:], live_T[:, None]
            swap_T1 = (second_T1 == live_T1) | ((first_T1 != live_T1) & swap_T1)
        return torch.where(swap_T1, forced_TK.flip(-1), forced_TK)


class ProductKeyInterceptor(TopKInterceptor):
    """Doge: keeps the key sort of each half, and translates the grid top-k's positions to expert ids."""

    def __init__(self, site: RouterSite, slot: RouterSlot, forced: ForcedLookup) -> None:
        super().__init__(site, slot, forced)
        self.keys = math.isqrt(site.num_choices)  # N; discovery binds num_choices = N * N
        self.order_2TN: torch.Tensor | None = None  # key ids of each half, sorted by the block's topk

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in TOPK_FUNCTIONS:
            logits, k, dim = topk_arguments(args, kwargs)
            if k == self.keys and dim == logits.dim() - 1 and logits.shape[dim] == self.keys and logits.shape[0] == 2:
                result = func(*args, **kwargs)  # the key sort: the model's own, kept to translate positions
                self.order_2TN = result[1].reshape(2, -1, self.keys)
                return result
        return super().__torch_function__(func, types, args, kwargs)

    def _order(self) -> torch.Tensor:
        if self.order_2TN is None:
            raise KernelBypassError(
                f"layer {self.site.layer} ({self.site.name}) ran its grid top-{self.site.top_k} without sorting "
                f"its {self.keys} keys per half first: the block's code changed; pin transformers or report it"
            )
        return self.order_2TN

    def ids_of(self, positions_TK: torch.Tensor) -> torch.Tensor:
        order_2TN, keys = self._order(), self.keys
        x_TK = order_2TN[0].gather(-1, torch.div(positions_TK, keys, rounding_mode="floor"))
        y_TK = order_2TN[1].gather(-1, positions_TK % keys)
        return x_TK * keys + y_TK

    def positions_of(self, ids_TK: torch.Tensor) -> torch.Tensor:
        order_2TN, keys = self._order(), self.keys
        ranks = torch.arange(keys, device=order_2TN.device).expand_as(order_2TN)
        rank_2TN = torch.empty_like(order_2TN).scatter_(-1, order_2TN, ranks)  # key id -> place in its sort
        a_TK = rank_2TN[0].gather(-1, torch.div(ids_TK, keys, rounding_mode="floor"))
        b_TK = rank_2TN[1].gather(-1, ids_TK % keys)
        return a_TK * keys + b_TK


def interceptor_for(site: RouterSite, slot: RouterSlot, forced: ForcedLookup) -> TopKInterceptor:
    """The interceptor of `site`'s selection rule, for one call of its scope."""
    if site.selection is Selection.SPARSEMIXER:
        return SparseMixerInterceptor(site, slot, forced)
    if site.selection is Selection.PRODUCT_KEYS:
        return ProductKeyInterceptor(site, slot, forced)
    return TopKInterceptor(site, slot, forced)


__all__ = ["ProductKeyInterceptor", "SparseMixerInterceptor", "interceptor_for"]
