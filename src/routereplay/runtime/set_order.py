"""Set order: a replayed row's forced SET in the order the live router gives it, and its fast path.

`replay(order="set")` (the default) forces each row's set of ids, in the live router's order.
The rule (`in_live_order`): the live top-k runs; a row whose forced set is the live set takes the
live ids exactly, ties included (in the top-k's own tie order, which only the top-k knows); any
other row takes its forced ids by live score descending, with a stable sort (equal scores keep the
given order). That costs one live top-k over all C choices, one gather, one (T, K, K) comparison
(the set test: no sort) and one K-wide sort per router call, with no branch on a value.

Fast path (`untied_live_order`). When the selection top-k is sorted and takes the largest (the
defaults) and no row's forced values hold a tie or a NaN, the rule gives every row its forced
ids by live score descending, with no top-k: a live top-k over distinct values returns them
strictly descending, so a row whose set is the live set gets the same order either way. So one
gather of K scores per row and one check decide. A row already strictly descending keeps its
given order: routes stored in the live order (a record, an ordered codec) cost no sort. Otherwise
one stable K-wide sort orders them, and the same check runs on its result. If any row holds a tie,
the call runs the rule as above (`None` says so), so results are the same bit for bit.

The check reads one flag on the host, so the fast path runs only where that costs no wait: on CPU
(no asynchronous device), over plain tensors, not while dynamo or the JIT traces (no graph break, no
branch baked into a trace), and not when the context runs sync-free (`Replayer(sync_free=True)`, the
default for routers off the CPU; `RouterSlot.host_reads` is False then). On a GPU, and compiled, the
rule runs without a branch, as a fixed few kernels per router call and no host sync.

Legend: T = tokens in this router call, K = top-k.
"""

from __future__ import annotations

from typing import Any

import torch


def in_live_order(forced_TK: torch.Tensor, live_TK: torch.Tensor, values_TK: torch.Tensor) -> torch.Tensor:
    """Each row's forced ids in the live router's order: the live row where the sets agree, else by value.

    `values_TK` are the live scores at the forced ids; the sort is stable, so equal scores keep the
    given order. Ids within a row are distinct (`check_routes`), so a row whose every live id is among
    its forced ids holds the live set: a (T, K, K) comparison decides it with no sort, no branch."""
    same_T1 = (live_TK.unsqueeze(-1) == forced_TK.unsqueeze(-2)).any(dim=-1).all(dim=-1, keepdim=True)
    by_value_TK = torch.sort(values_TK, dim=-1, descending=True, stable=True).indices
    return torch.where(same_T1, live_TK, forced_TK.gather(-1, by_value_TK))


def selects_sorted_largest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when a `torch.topk` / `Tensor.topk` call returns the largest values, sorted descending."""
    largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
    is_sorted = args[4] if len(args) > 4 else kwargs.get("sorted", True)
    return bool(largest) and bool(is_sorted)


def untied_order_applies(scores: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `untied_live_order` may decide this selection top-k call (see the module docstring):
    a sorted top-k of the largest, over a plain CPU tensor (no fake or wrapper subclass), not traced."""
    if scores.device.type != "cpu" or type(scores) is not torch.Tensor:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return selects_sorted_largest(args, kwargs)


def strictly_descending(values_TK: torch.Tensor) -> bool:
    """True when every row's values strictly decrease (so they are distinct, and none is NaN)."""
    return bool((values_TK[:, :-1] > values_TK[:, 1:]).all())


def untied_live_order(forced_TK: torch.Tensor, values_TK: torch.Tensor) -> torch.Tensor | None:
    """The forced ids by live score descending, when no row's scores tie (else None: run `in_live_order`).

    `values_TK` are the live scores at `forced_TK`. With distinct scores this equals `in_live_order`
    for a sorted top-k of the largest: a row whose set is the live set is in that top-k's order."""
    if strictly_descending(values_TK):
        return forced_TK
    sorted_TK, by_value_TK = torch.sort(values_TK, dim=-1, descending=True, stable=True)
    if strictly_descending(sorted_TK):
        return forced_TK.gather(-1, by_value_TK)
    return None


__all__ = [
    "in_live_order",
    "selects_sorted_largest",
    "strictly_descending",
    "untied_live_order",
    "untied_order_applies",
]
