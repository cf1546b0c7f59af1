"""Intercepting the one selection `torch.topk` of a router while its forward runs.

While a bound router's scope runs under record or replay, a `TorchFunctionMode` watches torch
calls. The selection top-k is the call with `k == top_k` over a dimension of `num_choices` entries
(group-level top-k calls have other sizes and pass through). Record keeps its indices. Replay
returns `(input.gather(dim, forced), forced)` instead: every step after it (gathering unbiased
scores, renormalising, scaling, dispatch) is the model's own code. So the weights are exactly what
the router computes for the forced experts, and gradients reach the gate. Rows of -1 take the live
choice for that token only.

Legend: T = tokens in this router call, K = top-k, C = choices (experts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from routereplay.runtime.discovery import RouterSite

TOPK_FUNCTIONS = frozenset({torch.topk, torch.Tensor.topk})

# (site, rows T) -> forced ids (T, K) long with -1 rows, or None to run the live top-k
ForcedLookup = Callable[[RouterSite, int], "torch.Tensor | None"]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where checkpoint recomputes happen)."""
    return bool(torch._C._current_graph_task_id() != -1)


def on_thread(owner: int) -> bool:
    """True when the running code belongs to thread `owner`: it runs on that thread, or it is a backward
    running on an autograd engine thread (not a Python thread: CUDA backward runs there, for its caller)."""
    if threading.get_ident() == owner:
        return True
    return in_backward() and isinstance(threading.current_thread(), threading._DummyThread)


class TopKInterceptor(TorchFunctionMode):
    """Active for one call of one router scope; keeps the choice of the selection top-k it saw."""

    def __init__(self, site: RouterSite, forced: ForcedLookup) -> None:
        super().__init__()
        self.site, self.forced = site, forced
        self.hits = 0
        self.last: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (ids (T, K), fallback rows (T,))

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in TOPK_FUNCTIONS:
            return func(*args, **kwargs)
        scores = args[0]
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        dim = dim % scores.dim()
        site = self.site
        if k != site.top_k or scores.shape[dim] != site.num_choices:
            return func(*args, **kwargs)
        rows = scores.numel() // site.num_choices
        forced_TK = self.forced(site, rows)
        fallback_T: torch.Tensor | None = None
        if forced_TK is None and not torch.is_grad_enabled():
            # record without autograd (rollout engines, old-log-prob passes): nothing is saved for a
            # recompute, so the live top-k is returned as is; its values are the gathered scores
            result = func(*args, **kwargs)
            self.hits += 1
            self.last = (_rows_last(result[1], dim, k), None)
            return result
        if forced_TK is None:  # record: the live choice
            with torch.no_grad():
                chosen_TK = _rows_last(func(*args, **kwargs)[1], dim, k)
        else:
            chosen_TK = forced_TK.to(scores.device)
            fallback_T = chosen_TK[:, 0] < 0
            if bool(fallback_T.any()):  # -1 rows: the live router decides for those tokens only
                with torch.no_grad():
                    live_TK = _rows_last(func(*args, **kwargs)[1], dim, k)
                chosen_TK = torch.where(fallback_T[:, None], live_TK, chosen_TK)
        # one code path for every mode: selection without autograd, values by gather. A checkpoint
        # recompute (which replays) then saves exactly the tensors its forward (maybe a record) saved.
        lead = scores.shape[:dim] + scores.shape[dim + 1 :]
        indices = chosen_TK.reshape(*lead, k)
        if dim != scores.dim() - 1:
            indices = indices.movedim(-1, dim)
        values = scores.gather(dim, indices)
        self.hits += 1
        self.last = (chosen_TK, fallback_T)  # when several calls match (a one-group group score), the last selects
        return torch.return_types.topk((values, indices))


def _rows_last(indices: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """Top-k indices as (T, K), whatever dimension they were taken over."""
    if dim != indices.dim() - 1:
        indices = indices.movedim(dim, -1)
    return indices.reshape(-1, k)


__all__ = ["TopKInterceptor", "in_backward", "on_thread"]
