"""A record / replay context belongs to the thread that opened it (issue 11 item 3): forwards of other
threads route naturally, untouched and unrecorded, while the owner's replay and recording are intact."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from routereplay.errors import ForeignThreadError
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf

TIMEOUT_S = 120  # only a guard against a hung test; nothing is timed


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def _run_in_thread(work: Callable[[], Any]) -> Any:
    """Run `work` on a real second thread and return its result (or raise its exception here)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "the second thread did not finish"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_other_threads_route_naturally_while_a_replay_is_open() -> None:
    """Concurrency (issue 11 item 3): while thread A was inside `replay(...)`, a forward in thread B
    silently used A's routes. B now routes naturally and A's replay is unaffected."""
    from routereplay.runtime import attach

    model = tiny_qwen3()
    ids_a, mask_a = _batch(1)
    ids_b, mask_b = _batch(2)  # same shape as A's batch: only thread ownership can tell them apart
    with torch.no_grad():
        natural_b = model(input_ids=ids_b, attention_mask=mask_b).logits
    replayer = attach(model)
    forced = random_routes(2, 8, 3, 2, 8, seed=4)
    with torch.no_grad(), replayer.replay(forced):
        expected_a = model(input_ids=ids_a, attention_mask=mask_a).logits  # single-threaded reference
    replayer.stats.reset()
    with torch.no_grad(), replayer.replay(forced) as used:
        logits_b = _run_in_thread(lambda: model(input_ids=ids_b, attention_mask=mask_b).logits)
        logits_a = model(input_ids=ids_a, attention_mask=mask_a).logits
    assert torch.equal(logits_b, natural_b), "thread B must route naturally, not with A's routes"
    assert torch.equal(logits_a, expected_a), "A's replay must be unaffected"
    assert used.stats.forwards == 1 and used.stats.router_calls == 3  # B's forward is not counted
    assert used.routes.shape == (2, 8, 3, 2)
    assert not torch.equal(natural_b, _forced_logits(model, replayer, forced, ids_b, mask_b)), "control"


def _forced_logits(model: torch.nn.Module, replayer: Any, forced: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    with torch.no_grad(), replayer.replay(forced):
        return model(input_ids=ids, attention_mask=mask).logits


def test_other_threads_do_not_pollute_a_recording() -> None:
    """Concurrency (issue 11 item 3): while thread A recorded, B's forward was appended to A's recording."""
    from routereplay.runtime import attach

    model = tiny_qwen3()
    ids_a, mask_a = _batch(1)
    ids_b, mask_b = _batch(2)
    replayer = attach(model)
    with torch.no_grad(), replayer.record() as alone:
        model(input_ids=ids_a, attention_mask=mask_a)
    with torch.no_grad(), replayer.record() as rec:
        model(input_ids=ids_a, attention_mask=mask_a)
        _run_in_thread(lambda: model(input_ids=ids_b, attention_mask=mask_b))
    assert len(rec.steps) == 1, "B's forward must not become a step of A's recording"
    assert torch.equal(rec.routes, alone.routes)


def test_backward_with_checkpointing_in_the_owner_thread_still_replays() -> None:
    """Concurrency (issue 11 item 3): ownership must not break recompute, which runs during backward."""
    from routereplay.runtime import attach

    model = tiny_qwen3().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    replayer = attach(model)
    ids, mask = _batch(3)
    forced = random_routes(2, 8, 3, 2, 8, seed=6)

    def train_step() -> int:
        with replayer.replay(forced) as used:
            model(input_ids=ids, attention_mask=mask).logits.float().pow(2).mean().backward()
        return used.stats.recompute_calls

    assert _run_in_thread(train_step) == 3  # the whole context lives on another thread: it owns it


def test_a_second_thread_cannot_open_a_context_meanwhile() -> None:
    """Concurrency (issue 11 item 3): one Replayer holds one context; another thread's attempt is a named error."""
    from routereplay.runtime import attach

    replayer = attach(tiny_qwen3())
    with replayer.record():

        def open_replay() -> None:
            with replayer.replay(random_routes(2, 8, 3, 2, 8)):
                pass

        with pytest.raises(ForeignThreadError, match=r"holds a record context .* attach a copy of the model"):
            _run_in_thread(open_replay)
    with replayer.replay(random_routes(2, 8, 3, 2, 8)):  # free again once the owner left
        pass
