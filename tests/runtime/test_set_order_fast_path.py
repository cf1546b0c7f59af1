"""Set order's fast path (`runtime/set_order.py`) gives exactly what the top-k-based rule gave.

`order="set"` used to run a live top-k per router call to give each forced set the live order. On
CPU, when no row's forced scores tie, the interceptor now orders the rows by a gather and (unless
already in order) one K-wide sort, with no top-k. These tests hold it to the previous interceptor
(`reference_select`, kept here verbatim) bit for bit: ids in the same order, the same values, the
same logits and gradients, on random and adversarial inputs (ties, NaN, -1 rows, the live set in
its order and sorted, other sets, K = 1 and K = C, bf16 and fp32, unsorted or smallest top-k calls,
another dimension), and count the live top-k calls to show which path ran.

Legend: T = tokens, K = top-k, C = choices (experts), B = batch, S = sequence, L = layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from routereplay.runtime import interception
from routereplay.runtime.discovery import RouterSite
from routereplay.runtime.interception import TOPK_FUNCTIONS, RouterSlot, TopKInterceptor
from routereplay.runtime.set_order import in_live_order, untied_live_order

C = 8
T = 64


# -- the interceptor before the fast path, verbatim: the reference ----------------------------------
def _reference_in_live_order(forced_TK: torch.Tensor, live_TK: torch.Tensor, values_TK: torch.Tensor) -> torch.Tensor:
    same_T1 = (forced_TK.sort(dim=-1).values == live_TK.sort(dim=-1).values).all(dim=-1, keepdim=True)
    by_value_TK = torch.sort(values_TK, dim=-1, descending=True, stable=True).indices
    return torch.where(same_T1, live_TK, forced_TK.gather(-1, by_value_TK))


def _rows_last(indices: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    if dim != indices.dim() - 1:
        indices = indices.movedim(dim, -1)
    return indices.reshape(-1, k)


def reference_select(
    self: TopKInterceptor,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    scores: torch.Tensor,
    k: int,
    dim: int,
) -> Any:
    """`TopKInterceptor.select` as it was: a live top-k, a gather and K-wide sorts in set order."""
    rows = scores.numel() // scores.shape[dim]
    forced = self.forced(self.site, self.slot, rows)
    if forced is None and not torch.is_grad_enabled():
        result = func(*args, **kwargs)
        self.hits += 1
        self.last = self.ids_of(_rows_last(result[1], dim, k))
        return result
    if forced is None:
        with torch.no_grad():
            chosen_TK = self.ids_of(_rows_last(func(*args, **kwargs)[1], dim, k))
    else:
        forced_TK, fallback = forced
        chosen_TK = forced_TK if forced_TK.device == scores.device else forced_TK.to(scores.device)
        keep_order = self.keeps_order()
        if fallback or not keep_order:
            with torch.no_grad():
                live_TK = self.ids_of(_rows_last(func(*args, **kwargs)[1], dim, k))
                if fallback:
                    chosen_TK = torch.where(chosen_TK[:, :1] < 0, live_TK, chosen_TK)
                if not keep_order:
                    values_TK = _rows_last(scores, dim, scores.shape[dim]).gather(-1, self.positions_of(chosen_TK))
                    chosen_TK = _reference_in_live_order(chosen_TK, live_TK, values_TK)
    lead = scores.shape[:dim] + scores.shape[dim + 1 :]
    indices = self.positions_of(chosen_TK).reshape(*lead, k)
    if dim != scores.dim() - 1:
        indices = indices.movedim(-1, dim)
    values = scores.gather(dim, indices)
    self.hits += 1
    self.last = chosen_TK
    return torch.return_types.topk((values, indices))


# -- helpers ------------------------------------------------------------------------------------------
class _TopKCounter(TorchFunctionMode):
    """Counts the top-k calls made beneath it (an interceptor's live top-k included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.calls += func in TOPK_FUNCTIONS
        return func(*args, **(kwargs or {}))


def _site(k: int) -> RouterSite:
    router = nn.Linear(1, 1)
    return RouterSite(name="gate", router=router, scope=router, layer=0, top_k=k, num_choices=C, family="Test")


def _select(
    scores: torch.Tensor, forced_TK: torch.Tensor, *, reference: bool, keep_order: bool = False, **topk: Any
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, indices, live top-k calls) of the intercepted selection `torch.topk(scores, K, **topk)`."""
    k = forced_TK.shape[-1]
    fallback = bool((forced_TK[:, 0] < 0).any())
    slot = RouterSlot(forced_TK=forced_TK, fallback=fallback, keep_order=keep_order)
    interceptor = TopKInterceptor(_site(k), slot, lambda _site, _slot, _rows: (forced_TK, fallback))
    if reference:
        interceptor.select = reference_select.__get__(interceptor)  # type: ignore[method-assign]
    with _TopKCounter() as counter, interceptor:
        values, indices = torch.topk(scores, k, **topk)
    return values, indices, counter.calls


def _assert_same(scores: torch.Tensor, forced_TK: torch.Tensor, **kwargs: Any) -> int:
    """Assert the fast and the reference interceptor agree bit for bit; the fast one's top-k calls."""
    values, indices, calls = _select(scores, forced_TK, reference=False, **kwargs)
    expected_values, expected_indices, _ = _select(scores, forced_TK, reference=True, **kwargs)
    assert torch.equal(indices, expected_indices), "the forced ids must come in the reference's order"
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8)), "values must be bit-identical"
    return calls


def _scores(dtype: torch.dtype, seed: int, *, levels: int = 0) -> torch.Tensor:
    """Router probabilities (T, C); `levels` > 0 rounds them to that many levels (ties in every row)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, C, generator=generator).softmax(-1)
    if levels:
        scores = (scores * levels).round() / levels
    return scores.to(dtype)


def _random_sets(k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(T, C, generator=generator).argsort(dim=-1)[:, :k]


def _live(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(scores, k).indices


def _forced_kinds(scores: torch.Tensor, k: int, seed: int) -> dict[str, torch.Tensor]:
    live_TK = _live(scores, k)
    other_TK = _random_sets(k, seed)
    half_T1 = (torch.arange(T) % 2 == 0)[:, None]
    return {
        "live order": live_TK,
        "live set sorted": live_TK.sort(dim=-1).values,
        "live set reversed": live_TK.flip(-1),
        "other sets": other_TK,
        "other sets sorted": other_TK.sort(dim=-1).values,
        "half live": torch.where(half_T1, live_TK.sort(dim=-1).values, other_TK),
    }


DTYPES = [torch.float32, torch.bfloat16]
KS = [1, 2, 4, C]


# -- the interceptor on random and adversarial scores ---------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_untied_rows_take_the_fast_path_and_match_the_reference(dtype: torch.dtype, k: int) -> None:
    """Guards against the fast path giving another order than the top-k rule where no scores tie."""
    for seed in range(3):
        scores = _scores(dtype, seed)
        untied = bool((scores.sort(dim=-1).values.diff(dim=-1) != 0).all())
        for kind, forced_TK in _forced_kinds(scores, k, seed + 10).items():
            calls = _assert_same(scores, forced_TK)
            if untied:
                assert calls == 0, f"{kind}: untied rows need no live top-k"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_tied_scores_take_the_top_k_and_match_the_reference(dtype: torch.dtype, k: int) -> None:
    """Guards against ties (whose live order only the top-k knows) being ordered by the fast path."""
    for seed in range(3):
        scores = _scores(dtype, seed, levels=4)  # most rows hold ties
        for kind, forced_TK in _forced_kinds(scores, k, seed + 10).items():
            calls = _assert_same(scores, forced_TK)
            if k > 1 and kind.startswith("live"):
                assert calls == 1, f"{kind}: tied live sets take the live top-k's order"


@pytest.mark.parametrize("k", [2, 4])
def test_one_tied_row_sends_the_call_to_the_top_k(k: int) -> None:
    """Guards against deciding per row from a check that only holds for the whole call."""
    scores = _scores(torch.float32, 0)
    live_TK = _live(scores, k)
    scores[5, live_TK[5, 1]] = scores[5, live_TK[5, 0]]  # row 5: its two best tie
    assert _assert_same(scores, _live(scores, k).sort(dim=-1).values) == 1


@pytest.mark.parametrize("special", [float("nan"), float("-inf"), 0.0, -0.0])
def test_nan_inf_and_signed_zero_scores_match_the_reference(special: float) -> None:
    """Guards against NaN (which compares false) or -0.0 == 0.0 slipping past the tie check."""
    scores = _scores(torch.float32, 1)
    scores[::3, :3] = special
    scores[1::3, 2] = -0.0
    for forced_TK in _forced_kinds(scores, 4, 7).values():
        _assert_same(scores, forced_TK)


def test_boundary_ties_match_the_reference() -> None:
    """Guards against a forced set that ties the live set at its K-th score (the top-k picks either)."""
    scores = _scores(torch.float32, 2)
    live_TK = _live(scores, 3)
    runner_up_T = _live(scores, 4)[:, 3]
    scores[torch.arange(T), runner_up_T] = scores.gather(-1, live_TK[:, 2:]).squeeze(-1)
    swapped_TK = torch.cat([live_TK[:, :2], runner_up_T[:, None]], dim=-1)
    for forced_TK in (swapped_TK, swapped_TK.sort(dim=-1).values, live_TK.sort(dim=-1).values):
        _assert_same(scores, forced_TK)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fallback_rows_match_the_reference(dtype: torch.dtype) -> None:
    """Guards against -1 rows: they run the live top-k, and the other rows keep the reference's order."""
    scores = _scores(dtype, 3)
    for forced_TK in _forced_kinds(scores, 4, 5).values():
        forced_TK = forced_TK.clone()
        forced_TK[::4] = -1
        assert _assert_same(scores, forced_TK) == 1
        assert _assert_same(scores, forced_TK, keep_order=True) == 1


@pytest.mark.parametrize("topk", [{"sorted": False}, {"largest": False}, {"dim": 0}])
def test_other_top_k_calls_match_the_reference(topk: dict[str, Any]) -> None:
    """Guards against the fast path on an unsorted or smallest-first top-k (whose live order is not by
    score descending), and on a selection along another dimension."""
    scores = _scores(torch.float32, 4)
    forced_TK = _forced_kinds(scores, 4, 6)["half live"]
    if topk.get("dim") == 0:
        assert _assert_same(scores.t().contiguous(), forced_TK, dim=0) == 0
    else:
        assert _assert_same(scores, forced_TK, **topk) == 1


def test_engine_order_matches_the_reference() -> None:
    """Guards against the refactor changing `order="engine"` (no top-k, the given order)."""
    scores = _scores(torch.float32, 5)
    for forced_TK in _forced_kinds(scores, 4, 8).values():
        assert _assert_same(scores, forced_TK, keep_order=True) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_untied_live_order_equals_in_live_order(dtype: torch.dtype) -> None:
    """The two functions of `set_order.py` side by side: equal wherever the fast one decides."""
    for seed in range(5):
        scores = _scores(dtype, seed, levels=64 if seed % 2 else 0)
        live_TK = _live(scores, 4)
        for forced_TK in _forced_kinds(scores, 4, seed).values():
            values_TK = scores.gather(-1, forced_TK)
            fast_TK = untied_live_order(forced_TK, values_TK)
            if fast_TK is not None:
                assert torch.equal(fast_TK, in_live_order(forced_TK, live_TK, values_TK))


# -- whole models: logits and gradients -----------------------------------------------------------------
@contextmanager
def _reference_interceptor() -> Iterator[None]:
    fast = interception.TopKInterceptor.select
    interception.TopKInterceptor.select = reference_select  # type: ignore[method-assign]
    try:
        yield
    finally:
        interception.TopKInterceptor.select = fast  # type: ignore[method-assign]


def _step(model: nn.Module, replayer: Any, routes: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    with replayer.replay(routes) as used:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        logits.float().logsumexp(-1).mean().backward()
    grads = tuple(p.grad.clone() for p in model.parameters() if p.grad is not None)
    return (logits.detach(), used.routes, *grads)


@pytest.mark.hf
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "doge"])
def test_replayed_steps_match_the_reference_bit_for_bit(model_type: str, dtype: torch.dtype) -> None:
    """Guards against any difference in a training step (logits, routes, every gradient) between the
    fast set order and the reference, from natural, sorted, random and -1 routes."""
    hf_tiny = pytest.importorskip("routereplay.testing.hf.models", reason="needs transformers")
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type, dtype=dtype).eval()  # no dropout: both runs see the same
    replayer = attach(model)
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 12), generator=torch.Generator().manual_seed(1))
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    natural = rec.routes.long()
    shuffled = natural.flatten(0, 2)[torch.randperm(natural.flatten(0, 2).shape[0], generator=torch.Generator())]
    with_fallback = natural.sort(dim=-1).values.clone()
    with_fallback[:, ::3] = -1
    for routes in (natural, natural.sort(dim=-1).values, shuffled.reshape(natural.shape), with_fallback):
        fast = _step(model, replayer, routes, ids)
        with _reference_interceptor():
            expected = _step(model, replayer, routes, ids)
        for got, want in zip(fast, expected, strict=True):
            assert torch.equal(got, want), "a replayed step must not change with the fast path"
