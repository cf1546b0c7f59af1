"""Disagreement in `ReplayStats` equals a probe outside our counters: each MoE block's input is kept during the
replay, the block is run again naturally on it after the context (no replay: the router's natural choice, read
from the ids its experts module receives), and the experts' ids during the replay are what was dispatched.

engine rows that differ from the natural set = `disagree_rows`; dispatched rows that differ = `forced_disagree_rows`
(threshold replay gives the rest back); tokens per expert = bincounts of the engine's and the natural ids.

Legend: B = batch, S = positions, T = B * S, K = top-k, E = experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import routereplay
from routereplay.errors import ConfigError
from routereplay.runtime.discovery import LAYER_PATH
from routereplay.testing.hf.models import tiny_model
from tests.runtime.models import engine_record, experts_inputs, perturbed_routers


@contextmanager
def block_inputs(model: nn.Module) -> Iterator[dict[int, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]]:
    """Each MoE block's (module, args, kwargs) of its last call, by global layer (a block: the parent of an
    `*Experts` module)."""
    seen: dict[int, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or not type(experts).__name__.endswith("Experts"):
            continue
        layer = int(LAYER_PATH.findall(name)[-1])

        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int = layer) -> None:
            seen[layer] = (m, tuple(a.detach().clone() for a in args), dict(kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def natural_choice(blocks: dict[int, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]], model: nn.Module) -> dict:
    """The ids each block's experts receive when the block runs naturally on its replayed input (no context)."""
    with torch.no_grad(), experts_inputs(model) as seen:
        for module, args, kwargs in blocks.values():
            module(*args, **kwargs)
    return {layer: calls[-1] for layer, calls in seen.items()}


def differs(a_TK: torch.Tensor, b_TK: torch.Tensor) -> torch.Tensor:
    return torch.tensor([set(a.tolist()) != set(b.tolist()) for a, b in zip(a_TK, b_TK, strict=True)])


def bincount(ids_TK: torch.Tensor, rows_T: torch.Tensor, experts: int) -> list[int]:
    return torch.bincount(ids_TK[rows_T].reshape(-1), minlength=experts).tolist()


FAMILIES = {"qwen3_moe": 0.05, "deepseek_v3": 0.3}  # router noise of the "engine" (a few rows in ten disagree)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("order", ["set", "engine"])
@pytest.mark.parametrize("threshold", [None, 0.0])
def test_disagreement_equals_a_probe_on_the_experts(family: str, order: str, threshold: float | None) -> None:
    trainer = tiny_model(family)
    engine = perturbed_routers(trainer, noise=FAMILIES[family], seed=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: neither compared nor counted
    routes = engine_record(engine, ids, mask).routes.clone()
    routes[1, 4] = -1  # a fallback row: the live router's, not compared
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), block_inputs(trainer) as blocks:
        with replayer.replay(routes, mask, order=order, threshold=threshold, check_alignment=False):
            with experts_inputs(trainer) as dispatched:
                trainer(input_ids=ids, attention_mask=mask)
    natural = natural_choice(blocks, trainer)
    stats = replayer.stats
    expected: dict[str, dict[int, Any]] = {"disagree": {}, "forced": {}, "compared": {}, "engine": {}, "live": {}}
    for column, site in enumerate(replayer.sites):
        forced_TK = routes[:, :, column].reshape(-1, site.top_k).long()
        natural_TK, used_TK = natural[site.layer], dispatched[site.layer][0]
        rows_T = mask.reshape(-1).bool() & (forced_TK[:, 0] >= 0)
        expected["disagree"][site.layer] = int((differs(forced_TK, natural_TK) & rows_T).sum())
        expected["forced"][site.layer] = int((differs(used_TK, natural_TK) & rows_T).sum())
        expected["compared"][site.layer] = int(rows_T.sum())
        expected["engine"][site.layer] = bincount(forced_TK, rows_T, site.num_choices)
        expected["live"][site.layer] = bincount(natural_TK, rows_T, site.num_choices)
    assert stats.disagree_rows_by_layer == expected["disagree"]
    assert stats.forced_disagree_rows_by_layer == expected["forced"]
    assert stats.compared_rows_by_layer == expected["compared"]
    assert stats.engine_tokens_by_layer == expected["engine"]
    assert stats.live_tokens_by_layer == expected["live"]
    assert stats.compared_rows == stats.replayed_rows  # every layer of these families is counted
    assert 0 < stats.disagree_rows < stats.compared_rows, "the engine should disagree on some rows, not all"
    assert stats.disagree_rate == pytest.approx(stats.disagree_rows / stats.compared_rows)
    assert stats.disagree_rows == stats.forced_disagree_rows + stats.replaced_rows
    if threshold is None:
        assert stats.forced_disagree_rows == stats.disagree_rows
    else:  # margin 0 keeps only rows tied with the live top-k: every disagreeing row is given back
        assert stats.forced_disagree_rows == 0 and stats.replaced_rows == stats.disagree_rows


def test_counting_off_counts_nothing_and_replays_the_same() -> None:
    trainer = tiny_model("qwen3_moe")
    engine = perturbed_routers(trainer, noise=0.05, seed=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    routes = engine_record(engine, ids).routes
    outputs = {}
    for counting in (True, False):
        replayer = routereplay.attach(trainer, count_disagreement=counting)
        with torch.no_grad(), replayer.replay(routes):
            outputs[counting] = trainer(input_ids=ids).logits
        stats = replayer.stats
        assert (stats.compared_rows > 0) is counting and (stats.disagree_rows > 0) is counting
        assert bool(stats.engine_tokens_by_layer) is counting
        replayer.detach()
    assert torch.equal(outputs[True], outputs[False])  # counting never changes what is replayed


def test_disagreement_is_counted_once_under_checkpoint_recompute() -> None:
    trainer = tiny_model("qwen3_moe")
    engine = perturbed_routers(trainer, noise=0.05, seed=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    routes = engine_record(engine, ids).routes
    replayer = routereplay.attach(trainer)
    with torch.no_grad(), replayer.replay(routes):
        trainer(input_ids=ids)
    once = replayer.stats.disagree_rows_by_layer.copy()
    replayer.stats.reset()
    trainer.train()
    trainer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    with replayer.replay(routes):
        trainer(input_ids=ids).logits.sum().backward()
    assert replayer.stats.recompute_calls > 0
    assert replayer.stats.disagree_rows_by_layer == once


def test_a_per_call_override_and_bad_values() -> None:
    trainer = tiny_model("qwen3_moe")
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    routes = engine_record(perturbed_routers(trainer, noise=0.05, seed=2), ids).routes
    replayer = routereplay.attach(trainer, count_disagreement=False)
    with torch.no_grad(), replayer.replay(routes, count_disagreement=True):
        trainer(input_ids=ids)
    assert replayer.stats.compared_rows == 5 * len(replayer.layers)
    with pytest.raises(ConfigError, match="count_disagreement='yes': pass True or False"):
        with replayer.replay(routes, count_disagreement="yes"):  # type: ignore[arg-type]
            pass
    replayer.detach()
    with pytest.raises(ConfigError, match="count_disagreement=1"):
        routereplay.attach(trainer, count_disagreement=1)  # type: ignore[arg-type]


def test_metrics_use_one_naming_scheme_with_a_rate_per_layer() -> None:
    stats = routereplay.ReplayStats(replayed_rows=10)
    stats.add_disagreement(3, [2, 1, 10, 1, 1, 0, 0])
    stats.add_disagreement(3, [1, 1, 10, 0, 0, 1, 1])
    metrics = stats.as_metrics()
    assert metrics["router_replay/disagree_rate/layer_3"] == pytest.approx(3 / 20)
    assert metrics["router_replay/forced_disagree_rows"] == 2.0
    assert stats.engine_tokens_by_layer == {3: [1, 1]} and stats.live_tokens_by_layer == {3: [1, 1]}
    assert all(name.startswith("router_replay/") for name in metrics)
    stats.reset()
    assert stats.as_metrics(per_layer=True) == {**stats.as_metrics(per_layer=False)}
    assert stats.disagree_rate == 0.0


@pytest.mark.parametrize("threshold", [None, 0.0])
def test_sync_free_counts_what_the_cpu_path_counts(threshold: float | None) -> None:
    """Sync-free (the device path, read once at the exit) and the CPU path (read per forward) count the same."""
    trainer = tiny_model("qwen3_moe")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    routes = engine_record(perturbed_routers(trainer, noise=0.05, seed=2), ids).routes.numpy()
    found = []
    for sync_free in (False, True):
        replayer = routereplay.attach(trainer, sync_free=sync_free)
        with replayer.replay(routes, threshold=threshold):
            trainer(input_ids=ids).logits.logsumexp(-1).mean().backward()
            trainer(input_ids=ids)  # two forwards: added up on the device
        stats = replayer.stats
        found.append((stats.disagree_rows_by_layer, stats.forced_disagree_rows_by_layer, stats.live_tokens_by_layer))
        replayer.detach()
    assert found[0] == found[1] and sum(found[0][0].values()) > 0
