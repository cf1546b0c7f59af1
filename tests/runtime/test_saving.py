"""Saving and copying an attached or detached model (issue 11 item 17): pickle, torch.save / load and
deepcopy work in both states, give an unattached model that routes naturally, and detach leaves nothing."""

from __future__ import annotations

import copy
import io
import pickle
import pickletools
from collections.abc import Callable

import pytest
import torch

from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf


def _pickle(model: torch.nn.Module) -> torch.nn.Module:
    return pickle.loads(pickle.dumps(model))


def _torch_save(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "pickle": _pickle,
    "torch.save": _torch_save,
    "deepcopy": copy.deepcopy,
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("state", ["attached", "detached"])
def test_an_attached_or_detached_model_saves_and_copies(how: str, state: str) -> None:
    """Error that is not a RouteReplayError (issue 11 item 17): `pickle.dumps(model)`, `torch.save(model)`
    and `copy.deepcopy(model)` raised `TypeError: cannot pickle weakref` while attached and after
    `detach()`. The copy must carry no Replayer state: not attached, natural routing, attachable."""
    from routereplay.runtime import attach
    from routereplay.runtime.replayer import attached_replayer

    model = tiny_qwen3()
    ids, mask = _batch()
    with torch.no_grad():
        natural = model(input_ids=ids, attention_mask=mask).logits
    replayer = attach(model)
    if state == "detached":
        replayer.detach()
    clone = COPIES[how](model)
    assert attached_replayer(clone) is None, "the copy must not be attached"
    forced = random_routes(2, 7, 3, 2, 8, seed=3)
    with torch.no_grad():
        if state == "attached":
            with replayer.replay(forced):  # the original's open context does not reach the copy
                assert torch.equal(clone(input_ids=ids, attention_mask=mask).logits, natural)
        assert torch.equal(clone(input_ids=ids, attention_mask=mask).logits, natural)
        own = attach(clone)  # the copy is attachable on its own, and replays on its own
        with own.replay(forced) as used:
            clone(input_ids=ids, attention_mask=mask)
        assert used.stats.replayed_rows == 2 * 7 * 3
        own.detach()
    if state == "detached":
        assert b"routereplay" not in pickle.dumps(model), "detach must leave nothing of routereplay on the model"
        assert all("forward" not in m.__dict__ for m in model.modules())
        assert not model._forward_pre_hooks


def test_a_pickled_attached_model_carries_no_replayer_state() -> None:
    """Error that is not a RouteReplayError (issue 11 item 17): the Replayer (routes, stats, sessions)
    is never pickled with the model; the original stays attached and working."""
    from routereplay.runtime import attach
    from routereplay.runtime.replayer import Replayer, attached_replayer

    model = tiny_qwen3()
    replayer = attach(model)
    strings = {arg for _, arg, _ in pickletools.genops(pickle.dumps(model)) if isinstance(arg, str)}
    assert Replayer.__name__ not in strings and "_session" not in strings and "stats" not in strings
    assert "_ModelCallHook" in strings  # the inert stand-in of the model's pre-hook (control)
    assert attached_replayer(model) is replayer
    ids, mask = _batch()
    with torch.no_grad(), replayer.record() as rec:
        model(input_ids=ids, attention_mask=mask)
    assert rec.routes.shape == (2, 7, 3, 2)
