"""routereplay R2 / R3 through SkyRL 0.4.0's own trainer loop (`trainer_case.py`): SkyRL's default config with
`trainer.recompute_old_logprobs_per_minibatch=true` and four policy mini-batches per train batch, `install`,
`build_models`, and one step from `generate` through `train_critic_and_policy`, on a tiny Qwen2-MoE whose layers
0 and 2 are dense. The truth is a probe on the policy model's experts modules: the expert ids each MoE layer's
experts receive, per call (one call per trajectory: SkyRL's default micro-batch is one sample; SkyRL's default
gradient checkpointing re-runs each update's forward in its backward).

The token check is on by default through routereplay's trainer (the documented entrypoint builds it): rows
rotated within a trajectory, or two equal-length trajectories swapped, in the batch SkyRL built are refused
before anything replays; SkyRL's own trainer (no digest column) is refused unless the worker opts out, and then
every unchecked sample is counted in SkyRL's metrics. Legend: S padded positions, N tokens of a trajectory,
K top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import TokenMismatchError, UncheckedRoutesError
from tests.integrations.skyrl import trainer_case as case
from tests.integrations.skyrl.worker_case import WORKER_MARKS

pytestmark = WORKER_MARKS

MODE_ENV = "ROUTEREPLAY_SKYRL_ROUTER_REPLAY"
UNCHECKED_ENV = "ROUTEREPLAY_SKYRL_UNCHECKED_ROUTES"
TRAJECTORIES = case.PROMPTS * case.SAMPLES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("skyrl")
    return case.save_checkpoint(tmp_path_factory.mktemp("qwen2_moe"))


@pytest.fixture
def loop(world: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The CPU stand-ins for SkyRL's trainer loop, and neither worker switch set."""
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    with case.cpu_stand_ins(monkeypatch):
        yield monkeypatch


def generator(routes: str | None = None) -> case.TinyGenerator:
    from routereplay.testing.vllm_models import word_tokenizer

    return case.TinyGenerator(word_tokenizer(64), routes=routes)


def probed_step(trainer: Any, **kwargs: Any) -> tuple[dict[int, list[torch.Tensor]], dict[str, float]]:
    """One SkyRL step with the probe on the policy model's experts: the (S, K) ids of every call, per MoE layer."""
    from tests.runtime.models import experts_inputs

    with experts_inputs(case.policy_worker(trainer).model.model) as calls:
        status = case.train_step(trainer, **kwargs)
    return calls, status


def token_rows(call_SK: torch.Tensor, tokens: int) -> torch.Tensor:
    """The (N, K) sorted rows of a call's attended positions (SkyRL left-pads: the last N of S)."""
    return call_SK[call_SK.shape[0] - tokens :].sort(-1).values


def passes(calls: list[torch.Tensor], lengths: list[int]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Per trajectory, its old-log-prob pass row set and its update's (forward, checkpoint recompute) row sets.

    SkyRL forwards each mini-batch in order, micro-batches of one trajectory, then updates them in the same order,
    each update forward followed by its recompute in backward."""
    n = len(lengths)
    assert len(calls) == 3 * n, f"{len(calls)} experts calls: expected {n} forwards and {n} updates (+ recompute)"
    forward = [token_rows(calls[i], lengths[i]) for i in range(n)]
    update = [[token_rows(calls[n + 2 * i + j], lengths[i]) for j in (0, 1)] for i in range(n)]
    return forward, update


def lengths_of(gen: case.TinyGenerator) -> list[int]:
    output = gen.outputs[-1]
    return [len(p) + len(r) for p, r in zip(output["prompt_token_ids"], output["response_ids"], strict=True)]


@pytest.mark.parametrize("recompute", [True, False], ids=["per-mini-batch-default", "full-batch"])
def test_r2_replays_what_skyrls_old_log_prob_pass_recorded_in_every_update(
    loop: pytest.MonkeyPatch, checkpoint: Path, recompute: bool
) -> None:
    """SkyRL's default forwards the old-log-prob pass once per policy mini-batch (4 here, as 1024 / 256): every
    forward adds to one recording, and every update replays it (the forward of each update and its recompute)."""
    loop.setenv(MODE_ENV, "R2")
    overrides = () if recompute else ("trainer.recompute_old_logprobs_per_minibatch=false",)
    cfg = case.skyrl_config(checkpoint, *overrides)
    assert cfg.trainer.recompute_old_logprobs_per_minibatch is recompute  # True: SkyRL's own default
    gen = generator()
    trainer = case.build_trainer(cfg, gen)
    boundaries: list[tuple[int, int]] = []
    calls, _ = probed_step(
        trainer, tamper=lambda batch: boundaries.extend(batch.metadata["policy_mini_batch_boundaries"])
    )
    assert [end - start for start, end in boundaries] == [case.SAMPLES] * case.PROMPTS  # 4 mini-batches
    lengths = lengths_of(gen)
    for layer in case.MOE_LAYERS:
        forward, update = passes(calls[layer], lengths)
        for i, (recorded, replayed) in enumerate(zip(forward, update, strict=True)):
            for seen in replayed:
                off = int((seen != recorded).any(-1).sum())
                assert off == 0, f"layer {layer}, trajectory {i}: {off} tokens routed off the recorded routes"
    stats = case.policy_worker(trainer).routereplay_stats()
    assert stats["recorded_samples"] == TRAJECTORIES
    assert stats["fallback_rows"] == 0 and stats["replayed_rows"] == sum(lengths) * len(case.MOE_LAYERS)  # updates
    assert trainer.all_metrics["policy/router_replay/fallback_rows"] == 0.0


def test_without_r2_skyrls_updates_route_off_the_old_log_prob_pass(loop: pytest.MonkeyPatch, checkpoint: Path) -> None:
    """What R2 prevents, on the same step: SkyRL's worker unchanged, the later mini-batches' updates route some
    tokens otherwise than their old-log-prob pass did (each optimizer step moves the routers)."""
    gen = generator()
    trainer = case.build_trainer(case.skyrl_config(checkpoint), gen)
    calls, _ = probed_step(trainer)
    lengths = lengths_of(gen)
    moved = [0] * TRAJECTORIES
    for layer in case.MOE_LAYERS:
        forward, update = passes(calls[layer], lengths)
        for i, (rows, seen) in enumerate(zip(forward, update, strict=True)):
            moved[i] += int((seen[0] != rows).any(-1).sum())
    assert moved[: case.SAMPLES] == [0] * case.SAMPLES  # the first mini-batch updates before any optimizer step
    assert sum(moved[case.SAMPLES :]) > 0, moved


@pytest.mark.parametrize("routes", ["skyrl", "routereplay"], ids=["RoutedExpertTrace", "RolloutRoutes"])
def test_r3_replays_the_rollout_routes_in_every_pass_and_checks_their_tokens(
    loop: pytest.MonkeyPatch, checkpoint: Path, routes: str
) -> None:
    """R3 on SkyRL's defaults: every captured row replayed in the old-log-prob pass and each update (forward and
    recompute), each trajectory's final token live; every trajectory checked against the digest column."""
    gen = generator(routes)
    trainer = case.build_trainer(case.skyrl_config(checkpoint, *case.R3_OVERRIDES), gen)
    calls, _ = probed_step(trainer)
    output = gen.outputs[-1]
    lengths = lengths_of(gen)
    for layer in case.MOE_LAYERS:
        forward, update = passes(calls[layer], lengths)
        for i, rows_CLK in enumerate(output["rollout_expert_indices"]):
            want_CK = torch.from_numpy(np.sort(rows_CLK[:, layer].astype(np.int64), axis=-1))
            for seen in (forward[i], *update[i]):
                assert torch.equal(seen[: len(want_CK)], want_CK), f"layer {layer}, trajectory {i}"
    stats = case.policy_worker(trainer).routereplay_stats()
    assert stats["checked_samples"] == 2 * TRAJECTORIES and stats["unchecked_samples"] == 0
    assert stats["fallback_rows"] == 2 * TRAJECTORIES * len(case.MOE_LAYERS)  # the final tokens, both passes
    assert trainer.all_metrics["policy/router_replay/unchecked_samples"] == 0.0
    # disagreement in SkyRL's own metrics (docs/metrics.md): every replayed row compared, one rate per MoE layer
    metrics = trainer.all_metrics
    assert metrics["policy/router_replay/compared_rows"] == metrics["policy/router_replay/replayed_rows"] > 0
    assert metrics["policy/router_replay/forced_disagree_rows"] == metrics["policy/router_replay/disagree_rows"]
    for layer in case.MOE_LAYERS:
        assert 0.0 <= metrics[f"policy/router_replay/disagree_rate/layer_{layer}"] <= 1.0


def rotate_rows(batch: Any, trajectory: int) -> None:
    """Trajectory `trajectory`'s captured rows rotated by one token inside SkyRL's packed field."""
    packed, padding = batch["rollout_expert_indices"], batch["router_padding_mask"]
    start = int(packed.cu_seqlens[trajectory])
    captured = int((~padding[trajectory]).sum())
    packed.values[start : start + captured] = packed.values[start : start + captured].roll(1, dims=0).clone()


def swap_rows(batch: Any, first: int, second: int) -> None:
    """Two equal-length trajectories' rows swapped inside SkyRL's packed field (their tokens stay)."""
    packed = batch["rollout_expert_indices"]
    (a0, a1), (b0, b1) = ((int(packed.cu_seqlens[t]), int(packed.cu_seqlens[t + 1])) for t in (first, second))
    assert a1 - a0 == b1 - b0
    rows_a, rows_b = packed.values[a0:a1].clone(), packed.values[b0:b1].clone()
    packed.values[a0:a1], packed.values[b0:b1] = rows_b, rows_a


@pytest.mark.parametrize(
    ("tamper", "refused", "forwarded"),
    [(lambda batch: rotate_rows(batch, 2), 0, 2), (lambda batch: swap_rows(batch, 0, 1), 0, 0)],
    ids=["rotated-within-a-trajectory", "equal-length-trajectories-swapped"],
)
def test_rows_moved_apart_from_their_tokens_in_skyrls_batch_are_refused_by_default(
    loop: pytest.MonkeyPatch, checkpoint: Path, tamper: Any, refused: int, forwarded: int
) -> None:
    """routereplay's trainer (the entrypoint's) adds the digest column from the generator's output; rows moved in
    the batch SkyRL built are refused at the first pass that would replay them, before the model sees them. SkyRL
    forwards mini-batch by mini-batch: trajectory 2 is the first (index 0) of the second mini-batch, whose
    predecessor (trajectories 0 and 1) ran; swapped trajectories 0 and 1 stop the first."""
    from tests.runtime.models import experts_inputs

    trainer = case.build_trainer(case.skyrl_config(checkpoint, *case.R3_OVERRIDES), generator("skyrl"))
    with experts_inputs(case.policy_worker(trainer).model.model) as calls:
        with pytest.raises(TokenMismatchError, match=f"trajectory {refused}: its packed route rows and its tokens"):
            case.train_step(trainer, tamper=tamper)
    assert all(len(calls.get(layer, [])) == forwarded for layer in case.MOE_LAYERS)  # nothing of the moved rows ran
    assert case.policy_worker(trainer).routereplay_stats()["checked_samples"] == forwarded


def test_skyrls_own_trainer_batch_is_refused_unless_the_worker_opts_out_and_then_counted(
    loop: pytest.MonkeyPatch, checkpoint: Path
) -> None:
    """SkyRL's `RayPPOTrainer` adds no digest column: R3 refuses its batch by name; with the worker's opt-out it
    replays (as SkyRL's Megatron path does) and counts every unchecked trajectory, in SkyRL's own metrics too."""
    trainer = case.build_trainer(
        case.skyrl_config(checkpoint, *case.R3_OVERRIDES), generator("skyrl"), routereplay_trainer=False
    )
    refusal = f"without the 'routereplay_route_digests' column.*{UNCHECKED_ENV}=1"
    with pytest.raises(UncheckedRoutesError, match=refusal):
        case.train_step(trainer)
    loop.setenv(UNCHECKED_ENV, "1")
    case.train_step(trainer)
    stats = case.policy_worker(trainer).routereplay_stats()
    assert stats["unchecked_samples"] == 2 * TRAJECTORIES and stats["checked_samples"] == 0  # forward + update
    assert trainer.all_metrics["policy/router_replay/unchecked_samples"] == 1.0  # per one-sample micro-batch
