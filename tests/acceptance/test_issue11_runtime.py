"""Acceptance tests for issue 11, runtime replay (items 2, 3, 15, 17, 21, 23), public API only."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch

from routereplay import RouteReplayError, RouteTrace, attach
from routereplay.errors import PaddingMismatchError, TokenMismatchError

pytestmark = pytest.mark.hf

L, E, K = 3, 8, 2


def tiny_model(seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def forced_routes(B: int, S: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(B * S * L, E, generator=generator)
    return keys.argsort(dim=1)[:, :K].reshape(B, S, L, K)


# -- item 2 ---------------------------------------------------------------------------------------
def test_item2_right_padded_routes_with_left_padded_mask_refused() -> None:
    """Issue 11 item 2 (silent misroute): routes laid out for right padding, replayed with the attention
    mask of a left-padded batch, raise PaddingMismatchError instead of giving attended tokens other
    tokens' routes."""
    model = tiny_model()
    replayer = attach(model)
    routes = forced_routes(2, 6)
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


# -- item 3 ---------------------------------------------------------------------------------------
def _run_in_other_thread_while(context_factory, other) -> object:
    """Enter the context in this thread, run `other()` in a second thread meanwhile, return its result."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = other()
        except BaseException as exc:
            result["value"] = exc

    with context_factory() as rec:
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    return result["value"], rec


def test_item3_other_thread_forward_during_replay_is_untouched() -> None:
    """Issue 11 item 3 (concurrency): while thread A is inside replay(...), a forward in thread B does
    not use A's routes: it routes naturally (or raises a named error), never silently forced."""
    model = tiny_model()
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        natural = model(input_ids=ids).logits
    replayer = attach(model)
    with replayer.record() as rec:
        with torch.no_grad():
            model(input_ids=ids)
    routes = forced_routes(1, 6, seed=5)
    assert not torch.equal(routes, rec.routes), "the forced routes must differ from the natural ones"

    def other() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits

    value, _ = _run_in_other_thread_while(lambda: replayer.replay(routes), other)
    if isinstance(value, BaseException):
        assert isinstance(value, RouteReplayError), value
    else:
        assert torch.allclose(value, natural, atol=1e-6), "thread B's forward used thread A's routes"
    with replayer.replay(routes):  # A's own forward is forced
        with torch.no_grad():
            forced = model(input_ids=ids).logits
    assert not torch.allclose(forced, natural)


def test_item3_other_thread_forward_not_appended_to_recording() -> None:
    """Issue 11 item 3 (concurrency): while thread A records, thread B's forward is not appended to A's
    recording."""
    model = tiny_model()
    replayer = attach(model)
    ids_b = torch.randint(1, 128, (1, 5))

    def other() -> object:
        with torch.no_grad():
            return model(input_ids=ids_b).logits

    value, rec = _run_in_other_thread_while(replayer.record, other)
    if isinstance(value, BaseException):
        assert isinstance(value, RouteReplayError), value
    assert rec.steps == [], "thread B's forward was recorded into thread A's recording"


# -- item 15 --------------------------------------------------------------------------------------
def test_item15_meta_routes_to_replay() -> None:
    """Issue 11 item 15 (error that is not a RouteReplayError): routes on the meta device given to
    replay() raise a named RouteReplayError, not NotImplementedError."""
    model = tiny_model()
    replayer = attach(model)
    meta = torch.zeros(1, 4, L, K, dtype=torch.long, device="meta")
    with pytest.raises(RouteReplayError, match="meta"):
        with replayer.replay(meta):
            pass


# -- item 17 --------------------------------------------------------------------------------------
def _save_all_ways(model: torch.nn.Module) -> list[torch.nn.Module]:
    copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies.append(torch.load(buffer, weights_only=False))
    return copies


def test_item17_pickle_torch_save_deepcopy_while_attached_and_after_detach() -> None:
    """Issue 11 item 17 (other defect): pickle.dumps / torch.save / copy.deepcopy of a model work while a
    Replayer is attached and after detach(), and detach leaves no routereplay attribute behind."""
    model = tiny_model()
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        natural = model(input_ids=ids).logits
    names_before = {name for m in model.modules() for name in vars(m)}
    replayer = attach(model)
    for clone in _save_all_ways(model):  # while attached
        with torch.no_grad():
            assert torch.allclose(clone(input_ids=ids).logits, natural, atol=1e-6)
        attach(clone).detach()  # the copy is a plain model, attachable on its own
    routes = forced_routes(1, 6, seed=3)
    with replayer.replay(routes) as used:  # the original still replays after being copied
        with torch.no_grad():
            model(input_ids=ids)
    assert torch.equal(used.routes.sort(-1).values, routes.sort(-1).values)  # the forced sets (order="set")
    replayer.detach()
    leftovers = {name for m in model.modules() for name in vars(m)} - names_before
    assert not [n for n in leftovers if "routereplay" in n.lower() or "replayer" in n.lower()], leftovers
    for clone in _save_all_ways(model):  # after detach
        with torch.no_grad():
            assert torch.allclose(clone(input_ids=ids).logits, natural, atol=1e-6)


# -- item 21 --------------------------------------------------------------------------------------
def _recorded_traces(model, replayer, ids: torch.Tensor, mask: torch.Tensor) -> list[RouteTrace]:
    with replayer.record() as rec:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    return rec.traces(mask, input_ids=ids)


def test_item21_extra_bos_shift_refused_at_replay() -> None:
    """Issue 11 item 21 (silent misroute): traces recorded for some tokens, replayed on a trainer sequence
    with an extra BOS (every route shifted by one), raise TokenMismatchError naming the first
    differing position - both when input_ids is passed to replay() and at the forward."""
    model = tiny_model()
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


def test_item21_stripped_bos_longer_batch_refused() -> None:
    """Issue 11 item 21 (silent misroute): re-tokenised with one more token (extra BOS in front), the
    replay refuses with TokenMismatchError, not replaying shifted routes."""
    model = tiny_model()
    replayer = attach(model)
    ids = torch.randint(2, 128, (1, 5))
    traces = _recorded_traces(model, replayer, ids, torch.ones(1, 5, dtype=torch.long))
    longer = torch.cat([torch.tensor([[1]]), ids], dim=1)
    mask = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(RouteReplayError):
        with replayer.replay(traces, mask, input_ids=longer):
            with torch.no_grad():
                model(input_ids=longer, attention_mask=mask)


# -- item 23 --------------------------------------------------------------------------------------
def test_item23_replayed_rows_exclude_padding_left_padded_batch() -> None:
    """Issue 11 item 23 (misleading message): in a left-padded two-sample batch, ReplayStats.replayed_rows
    counts only the forced (attended, routed) rows; padding counts neither as replayed nor fallback."""
    model = tiny_model()
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
