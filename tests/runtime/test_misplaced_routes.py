"""Replay through the public API refuses routes that sit on the wrong tokens (left vs right padding, a
BOS added or stripped), and its counters count attended rows only, padding neither replayed nor fallback."""

from __future__ import annotations

import pytest
import torch

from routereplay import RouteReplayError, RouteTrace, attach
from routereplay.errors import PaddingMismatchError, TokenMismatchError
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf

L, E, K = 3, 8, 2


def _recorded_traces(model, replayer, ids: torch.Tensor, mask: torch.Tensor) -> list[RouteTrace]:
    with replayer.record() as rec:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    return rec.traces(mask, input_ids=ids)


def test_right_padded_routes_under_a_left_padded_mask_are_refused() -> None:
    """Routes laid out for right padding, replayed with the attention
    mask of a left-padded batch, raise PaddingMismatchError instead of giving attended tokens other
    tokens' routes."""
    model = tiny_qwen3()
    replayer = attach(model)
    routes = random_routes(2, 6, L, K, E)
    routes[1, 4:] = -1  # sample 1 has 4 tokens, laid out for RIGHT padding
    left_mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    ids = torch.randint(1, 128, (2, 6))
    with pytest.raises(PaddingMismatchError, match="(?i)padding|mask"):
        with replayer.replay(routes, left_mask):
            model(input_ids=ids, attention_mask=left_mask)
    right_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    with replayer.replay(routes, right_mask) as used:  # the layout it was built for is accepted
        model(input_ids=ids, attention_mask=right_mask)
    assert torch.equal(used.routes[0].sort(-1).values, routes[0].sort(-1).values)  # the forced sets (order="set")
    assert torch.equal(used.routes[1, :4].sort(-1).values, routes[1, :4].sort(-1).values)


def test_routes_shifted_by_an_extra_bos_are_refused() -> None:
    """Traces recorded for some tokens, replayed on a trainer sequence
    with an extra BOS (every route shifted by one), raise TokenMismatchError naming the first
    differing position - both when input_ids is passed to replay() and at the forward."""
    model = tiny_qwen3()
    replayer = attach(model)
    ids = torch.randint(2, 128, (1, 6))
    traces = _recorded_traces(model, replayer, ids, torch.ones(1, 6, dtype=torch.long))
    shifted = torch.cat([torch.tensor([[1]]), ids[:, :-1]], dim=1)  # BOS added, last token dropped: same length
    mask = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(TokenMismatchError, match="position"):
        with replayer.replay(traces, mask, input_ids=shifted):
            pass
    with pytest.raises(TokenMismatchError, match="position"):  # ids at hand at the forward: checked there too
        with replayer.replay(traces, mask):
            with torch.no_grad():
                model(input_ids=shifted, attention_mask=mask)
    with replayer.replay(traces, mask, input_ids=ids) as used:  # the right tokens replay
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert used.stats.checked_sequences >= 1


def test_a_batch_one_token_longer_than_its_traces_is_refused() -> None:
    """Re-tokenised with one more token (extra BOS in front), the
    replay refuses with TokenMismatchError, not replaying shifted routes."""
    model = tiny_qwen3()
    replayer = attach(model)
    ids = torch.randint(2, 128, (1, 5))
    traces = _recorded_traces(model, replayer, ids, torch.ones(1, 5, dtype=torch.long))
    longer = torch.cat([torch.tensor([[1]]), ids], dim=1)
    mask = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(RouteReplayError):
        with replayer.replay(traces, mask, input_ids=longer):
            with torch.no_grad():
                model(input_ids=longer, attention_mask=mask)


def test_replayed_rows_exclude_the_padding_of_a_left_padded_batch() -> None:
    """In a left-padded two-sample batch, ReplayStats.replayed_rows
    counts only the forced (attended, routed) rows; padding counts neither as replayed nor fallback."""
    model = tiny_qwen3()
    replayer = attach(model)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    ids = torch.randint(2, 128, (2, 6))
    traces = _recorded_traces(model, replayer, ids, mask)
    experts = traces[1].experts.copy()
    experts[-1] = -1  # one token of sample 1 falls back to the live router
    traces[1] = RouteTrace(experts, traces[1].num_experts, traces[1].layers, traces[1].start)
    routed = sum(int((t.experts[:, :, 0] >= 0).sum()) for t in traces)
    unrouted = sum(int((t.experts[:, :, 0] < 0).sum()) for t in traces)
    replayer.stats.reset()
    with replayer.replay(traces, mask):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert replayer.stats.replayed_rows == routed
    assert replayer.stats.fallback_rows == unrouted
    assert replayer.stats.replayed_rows + replayer.stats.fallback_rows == int(mask.sum()) * L
