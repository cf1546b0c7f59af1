"""Replay refuses routes placed on the wrong tokens: padding side, short traces, token ids; and the
replay counters count attended positions only (issue 11 items 2, 21, 23)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay import RouteTrace
from routereplay.errors import ConfigError, PaddingMismatchError, TokenMismatchError
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf

LENGTHS = (10, 6)  # two sequences in a batch of S = 10 positions
WIDTH = 10


@pytest.fixture
def model() -> torch.nn.Module:
    return tiny_qwen3()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 128, (len(LENGTHS), WIDTH), generator=torch.Generator().manual_seed(seed))


def _mask(side: str) -> torch.Tensor:
    mask = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        if side == "left":
            mask[b, WIDTH - n :] = 1
        else:
            mask[b, :n] = 1
    return mask


def _engine_like_routes(side: str, seed: int = 5) -> torch.Tensor:
    """Routes laid out like an engine's for `side` padding: n - 1 routed tokens per sequence, -1 elsewhere."""
    forced = random_routes(len(LENGTHS), WIDTH, 3, 2, 8, seed=seed)
    routes = torch.full_like(forced, -1)
    for b, n in enumerate(LENGTHS):
        begin = WIDTH - n if side == "left" else 0
        routes[b, begin : begin + n - 1] = forced[b, begin : begin + n - 1]
    return routes


def _traces(ids: torch.Tensor, mask: torch.Tensor, rows: tuple[int, ...], seed: int = 7) -> list[RouteTrace]:
    """Traces of `rows[b]` routed tokens, naming the batch's attended ids."""
    traces = []
    for b, n in enumerate(rows):
        experts = random_routes(1, n, 3, 2, 8, seed=seed + b)[0].numpy()
        traces.append(RouteTrace(experts, 8, token_ids=ids[b][mask[b].bool()][:n]))
    return traces


# --- item 2: padding side ----------------------------------------------------------------------


def test_right_padded_routes_on_a_left_padded_batch_are_refused(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 2): routes laid out for right padding, replayed with a left-padded
    attention mask, gave attended tokens other tokens' routes with only a fallback count as a sign."""
    from routereplay.runtime import attach

    replayer = attach(model)
    mask = _mask("left")
    with pytest.raises(
        PaddingMismatchError,
        match=r"sequence 1: position 0 is padding .* laid out for right padding while the mask is left-padded",
    ):
        replayer.replay(_engine_like_routes("right"), attention_mask=mask).__enter__()
    with pytest.raises(PaddingMismatchError, match=r"laid out for left padding while the mask is right-padded"):
        replayer.replay(_engine_like_routes("left"), attention_mask=_mask("right")).__enter__()
    assert replayer.mode == "off"


def test_matching_layouts_and_recordings_replay(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 2), no false alarm: routes laid out like the mask (last token
    unrouted), a recording (routes on padding too) and explicit opt-out all replay."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids = _ids()
    for side in ("left", "right"):
        mask = _mask(side)
        with replayer.replay(_engine_like_routes(side), attention_mask=mask) as used:
            model(input_ids=ids, attention_mask=mask)
        assert used.stats.fallback_rows == len(LENGTHS) * 3  # the last token of each sequence, per layer
        replayer.stats.reset()
        with replayer.record() as rec:
            natural = model(input_ids=ids, attention_mask=mask).logits
        with replayer.replay(rec.routes, attention_mask=mask):
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, natural)
    with replayer.replay(_engine_like_routes("right"), attention_mask=_mask("left"), check_alignment=False):
        model(input_ids=ids, attention_mask=_mask("left"))


def test_unrouted_attended_rows_inside_a_laid_out_row_are_refused(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 2): -1 rows on attended positions other than the last token are
    not a gap engines leave; they mean the routes are shorter than the batch's sequences."""
    from routereplay.runtime import attach

    replayer = attach(model)
    routes = _engine_like_routes("right")
    routes[0, 4:6] = -1
    with pytest.raises(PaddingMismatchError, match=r"sequence 0: position 4 is an attended token .* are -1"):
        replayer.replay(routes, attention_mask=_mask("right")).__enter__()


def test_a_trace_shorter_than_its_sequence_is_refused(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 2): a trace that stops several tokens before its sequence ends
    replayed those tokens live without a word; only the last token may lack a route."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _ids(), _mask("left")
    short = _traces(ids, mask, (LENGTHS[0] - 1, LENGTHS[1] - 3))
    with pytest.raises(PaddingMismatchError, match=r"sequence 1: the trace routes tokens 0\.\.2 but .* attends 6"):
        replayer.replay(short, attention_mask=mask).__enter__()
    ok = _traces(ids, mask, (LENGTHS[0] - 1, LENGTHS[1]))
    with replayer.replay(ok, attention_mask=mask):
        model(input_ids=ids, attention_mask=mask)
    holes = ok[0].experts.copy()
    holes[2:5] = -1  # rows the trace itself says are unrouted: a documented gap, replayed live
    with replayer.replay([RouteTrace(holes, 8), ok[1]], attention_mask=mask):
        model(input_ids=ids, attention_mask=mask)


# --- item 23: counters ---------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_replayed_rows_count_attended_forced_rows_only(model: torch.nn.Module, side: str) -> None:
    """Misleading message (issue 11 item 23): `replayed_rows` counted padding as replayed (36 reported
    against 26 forced in a left-padded two-sample batch), overstating every coverage figure."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _ids(), _mask(side)
    traces = _traces(ids, mask, (LENGTHS[0] - 1, LENGTHS[1] - 1))
    with replayer.replay(traces, attention_mask=mask) as used:
        model(input_ids=ids, attention_mask=mask)
    forced = sum(int(t.routed_mask.sum()) for t in traces)
    assert used.stats.replayed_rows == forced == (9 + 5) * 3
    assert used.stats.fallback_rows == len(LENGTHS) * 3
    assert used.stats.replayed_rows + used.stats.fallback_rows == int(mask.sum()) * 3


# --- item 21: token ids ----------------------------------------------------------------------------


def _engine_traces(ids: torch.Tensor, mask: torch.Tensor) -> list[RouteTrace]:
    return _traces(ids, mask, tuple(n - 1 for n in LENGTHS))


def test_an_extra_bos_in_the_batch_is_refused(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 21): a trainer sequence with an extra BOS shifted every route by
    one position with no error; the replay now names the sequence, the first position and the shift."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _ids(), _mask("right")
    traces = _engine_traces(ids, mask)
    shifted = ids.clone()
    shifted[1, 1:] = ids[1, :-1]
    shifted[1, 0] = 0  # a BOS the engine never saw; sequence 1 is still 6 attended tokens after cutting one
    shifted[1, LENGTHS[1] :] = ids[1, LENGTHS[1] :]
    with pytest.raises(TokenMismatchError, match=r"sequence 1: token 0 .*shifted right by one.*extra token in front"):
        replayer.replay(traces, attention_mask=mask, input_ids=shifted).__enter__()
    with pytest.raises(TokenMismatchError, match=r"sequence 1: token 0 .*shifted right by one"):
        with replayer.replay(traces, attention_mask=mask):  # no ids given: the forward's input_ids are checked
            model(input_ids=shifted, attention_mask=mask)
    with replayer.replay(traces, attention_mask=mask, input_ids=ids) as used:
        model(input_ids=ids, attention_mask=mask)
    assert used.stats.checked_sequences == 2 * len(LENGTHS)  # at entry, and at the forward


def test_a_stripped_bos_and_a_changed_token_are_refused(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 21): a stripped BOS (or any re-tokenisation) replayed silently."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _ids(), _mask("left")
    traces = _engine_traces(ids, mask)
    stripped = ids.clone()
    stripped[0, :-1] = ids[0, 1:]  # the trainer lost the first token: everything moves left by one
    with pytest.raises(TokenMismatchError, match=r"sequence 0: token 0 .*shifted left by one.*stripped BOS"):
        replayer.replay(traces, attention_mask=mask, input_ids=stripped).__enter__()
    changed = ids.clone()
    changed[1, WIDTH - 3] = (ids[1, WIDTH - 3] + 1) % 128
    with pytest.raises(
        TokenMismatchError,
        match=r"sequence 1: token 3 .* is id \d+ in the batch but the trace routed id \d+.*other tokens",
    ):
        replayer.replay(traces, attention_mask=mask, input_ids=changed).__enter__()
    unknown = [t.with_token_ids(np.where(np.arange(t.num_tokens) == 3, -1, t.token_ids)) for t in traces]
    with replayer.replay(unknown, attention_mask=mask, input_ids=changed):  # -1 = id unknown: not compared
        pass
    with pytest.raises(ConfigError, match="a routes tensor carries none"):
        replayer.replay(_engine_like_routes("left"), attention_mask=mask, input_ids=ids).__enter__()


def test_recorded_traces_carry_their_token_ids(model: torch.nn.Module) -> None:
    """Silent misroute (issue 11 item 21): R2 traces taken with the batch's ids are checked on replay."""
    from routereplay.runtime import attach

    replayer = attach(model)
    ids, mask = _ids(), _mask("left")
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    traces = rec.traces(mask, input_ids=ids)
    assert [t.token_ids.tolist() for t in traces] == [ids[b][mask[b].bool()].tolist() for b in range(2)]
    with replayer.replay(traces, attention_mask=mask):
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again[mask.bool()], natural[mask.bool()])
    with pytest.raises(TokenMismatchError, match="sequence 0"), replayer.replay(traces, attention_mask=mask):
        model(input_ids=ids.roll(1, dims=1), attention_mask=mask)


def test_grpo_scoring_checks_token_ids_by_default() -> None:
    """Silent misroute (issue 11 item 21): our own R3 scoring (GRPO's old-log-prob pass and updates) now
    checks the batch's ids against the engine's by default; an extra BOS is refused."""
    from routereplay.engines.hf import HFEngine, SamplingParams
    from routereplay.rl.scoring import score
    from routereplay.runtime import attach

    model = tiny_qwen3()
    rollouts = HFEngine(model).generate([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=3, seed=2))
    assert all(r.trace is not None and r.trace.token_ids is not None for r in rollouts)
    assert rollouts[0].trace.token_ids.tolist() == rollouts[0].token_ids[:-1]
    replayer = attach(model)
    score(model, rollouts, pad_token_id=0, replayer=replayer, replay=True)
    assert replayer.stats.checked_sequences >= 2
    rollouts[1].prompt_ids.insert(0, 1)  # the trainer's sequence gains a BOS; the engine's routes do not
    rollouts[1].response_ids.pop()  # same length, so only the ids can tell
    with pytest.raises(TokenMismatchError, match=r"sequence 1: token 0 .*shifted right by one"):
        score(model, rollouts, pad_token_id=0, replayer=replayer, replay=True)
