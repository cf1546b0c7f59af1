"""An attached model through the public API: another thread's forward is neither forced nor recorded,
meta-device routes are refused by name, and the model pickles, saves and deep-copies while attached and
after detach (which leaves nothing behind)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from routereplay import RouteReplayError, attach
from tests.runtime.models import random_routes, tiny_qwen3
from tests.runtime.test_thread_ownership import _run_in_thread

pytestmark = pytest.mark.hf

L, E, K = 3, 8, 2


def _run_in_other_thread_while(context_factory, other) -> tuple[object, object]:
    """Enter the context in this thread, run `other()` in a second thread meanwhile: (its result or the
    RouteReplayError it raised, the context's value)."""

    def guarded() -> object:
        try:
            return other()
        except RouteReplayError as error:
            return error

    with context_factory() as rec:
        value = _run_in_thread(guarded)
    return value, rec


def test_another_threads_forward_during_a_replay_routes_naturally() -> None:
    """While thread A is inside replay(...), a forward in thread B does
    not use A's routes: it routes naturally (or raises a named error), never silently forced."""
    model = tiny_qwen3()
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        natural = model(input_ids=ids).logits
    replayer = attach(model)
    with replayer.record() as rec:
        with torch.no_grad():
            model(input_ids=ids)
    routes = random_routes(1, 6, L, K, E, seed=5)
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


def test_another_threads_forward_is_not_recorded() -> None:
    """While thread A records, thread B's forward is not appended to A's
    recording."""
    model = tiny_qwen3()
    replayer = attach(model)
    ids_b = torch.randint(1, 128, (1, 5))

    def other() -> object:
        with torch.no_grad():
            return model(input_ids=ids_b).logits

    value, rec = _run_in_other_thread_while(replayer.record, other)
    if isinstance(value, BaseException):
        assert isinstance(value, RouteReplayError), value
    assert rec.steps == [], "thread B's forward was recorded into thread A's recording"


def test_meta_device_routes_are_refused_by_replay() -> None:
    """Routes on the meta device given to
    replay() raise a named RouteReplayError, not NotImplementedError."""
    model = tiny_qwen3()
    replayer = attach(model)
    meta = torch.zeros(1, 4, L, K, dtype=torch.long, device="meta")
    with pytest.raises(RouteReplayError, match="meta"):
        with replayer.replay(meta):
            pass


def _save_all_ways(model: torch.nn.Module) -> list[torch.nn.Module]:
    copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies.append(torch.load(buffer, weights_only=False))
    return copies


def test_the_model_pickles_saves_and_copies_while_attached_and_after_detach() -> None:
    """`pickle.dumps` / torch.save / copy.deepcopy of a model work while a
    Replayer is attached and after detach(), and detach leaves no routereplay attribute behind."""
    model = tiny_qwen3()
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        natural = model(input_ids=ids).logits
    names_before = {name for m in model.modules() for name in vars(m)}
    replayer = attach(model)
    for clone in _save_all_ways(model):  # while attached
        with torch.no_grad():
            assert torch.allclose(clone(input_ids=ids).logits, natural, atol=1e-6)
        attach(clone).detach()  # the copy is a plain model, attachable on its own
    routes = random_routes(1, 6, L, K, E, seed=3)
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
