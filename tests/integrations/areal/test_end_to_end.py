"""End to end on AReaL 1.0.4: rollout through AReaL's own engine and routereplay's workflows, training through
AReaL's own actor calls on `RouteReplayFSDPPPOActor` under R3.

Rollout: AReaL's `RemoteSGLangEngine` (its WorkflowExecutor: `submit` / `wait`, what `rollout_batch` does)
against the SGLang-speaking server of `sglang_case.py`, whose policy is the tiny Qwen3-MoE with perturbed routers
(two weight versions); `RoutedRLVRWorkflow` episodes (one interrupted after 2 tokens, the server moving to the
next version, and resumed by AReaL's `agenerate`) and one `RoutedMultiTurnWorkflow` episode (two turns: AReaL's
feedback message between them is an observation span, loss_mask 0). The episodes form the list AReaL's trainer
holds (`actor.prepare_batch` / `rollout_batch` return it), which goes through AReaL's own `compute_logp` ->
`prox_logp` -> `compute_advantages` -> `ppo_update` (each `batched_call`: concat, split, pack, pad) on an actor
loaded from the UNPERTURBED checkpoint, so its natural routing differs from the rollout's.

Truth from the model: a probe on each MoE layer's experts module (the expert ids dispatched, per packed model
call and per experts call: forward and activation-checkpoint recompute) and on its router (the router's own
probabilities there: its natural choice, ranked by `argsort`, which replay does not intercept). Routes compare as
sets. Legend: S positions of an episode, M MoE layers, K top-k.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from areal.api.cli_args import GenerationHyperparameters
from torch import nn

from routereplay.integrations.areal import MODE_ENV, ROUTES_KEY, TOKENS_KEY, UNCHECKED_ENV
from routereplay.integrations.areal.workflows import RoutedMultiTurnWorkflow, RoutedRLVRWorkflow
from routereplay.integrations.verl import RouteGeometry
from routereplay.runtime.discovery import LAYER_PATH
from routereplay.testing.vllm_models import word_tokenizer
from tests.integrations.areal.actor_case import (
    MOE_LAYERS,
    TOP_K,
    ModelCall,
    actor_config,
    build_actor,
    by_trajectory,
    checkpoint,
    disagreement,
    dispatch_probe,
)
from tests.integrations.areal.sglang_case import (
    SGLangServer,
    areal_engine,
    chat,
    first_routing,
    model_routes,
    tiny_versions,
    unit_reward,
    zero_reward,
)

pytestmark = pytest.mark.areal
MAX_NEW = 5
PROMPTS = ("w30 w31 w32", "w40 w41 w42 w43 w44 w45")


@dataclass(slots=True)
class Rollout:
    """The trainer's batch (resumed RLVR episode first, multi-turn last) and the passes each server ran."""

    batch: list[dict[str, torch.Tensor]]
    interrupted: SGLangServer
    server: SGLangServer
    geometry: RouteGeometry


def gconfig() -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=MAX_NEW, greedy=True)


@pytest.fixture(scope="module")
def rollout() -> Rollout:
    versions = tiny_versions(3)[1:]  # the rollout policy: two router perturbations of the actor's checkpoint
    geometry = RouteGeometry.from_hf_config(versions[0].config)
    rlvr = RoutedRLVRWorkflow(
        reward_fn=unit_reward, gconfig=gconfig(), tokenizer=word_tokenizer(), route_geometry=geometry
    )
    multi = RoutedMultiTurnWorkflow(
        reward_fn=zero_reward,
        gconfig=gconfig(),
        tokenizer=word_tokenizer(),
        max_turns=2,
        turn_discount=0.9,
        route_geometry=geometry,
    )
    with SGLangServer(versions, abort_after=2) as interrupted, areal_engine(interrupted) as engine:
        engine.submit(chat("w10 w11 w12 w13"), workflow=rlvr)
        resumed = engine.wait(1, timeout=120)
    count = len(PROMPTS) + 1
    with (
        SGLangServer(versions, update_after_request=True) as server,
        areal_engine(server, consumer_batch_size=count, max_concurrent_rollouts=count) as engine,
    ):
        for prompt in PROMPTS:
            engine.submit(chat(prompt), workflow=rlvr)
        engine.submit(chat("w20 w21"), workflow=multi)
        episodes = engine.wait(count, timeout=120)
    ordered = sorted(episodes, key=lambda e: int(e["input_ids"].shape[1]))  # the multi-turn one is the longest
    batch = [*resumed, *ordered]
    assert all(e is not None for e in batch)
    return Rollout(batch, interrupted, server, geometry)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="module")
def actor(model_path: str) -> Iterator[Any]:
    actor = build_actor(actor_config(model_path))
    yield actor
    actor.routing().bind(actor.model).detach()


@pytest.fixture
def areal_mode(monkeypatch: pytest.MonkeyPatch, actor: Any) -> Iterator[Any]:
    """Sets the mode where `RouteReplayPPOTrainer` writes it: the actor config's scheduling_spec[0].env_vars."""
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    env = actor.config.scheduling_spec[0].env_vars
    yield lambda value: env.__setitem__(MODE_ENV, value)
    env.pop(MODE_ENV, None)


def expected(batch: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [e[ROUTES_KEY][0].to(torch.int64) for e in batch]


def as_sets(rows: Any) -> np.ndarray:
    return np.sort(np.asarray(rows, dtype=np.int64), axis=-1)


@contextmanager
def router_probe(model: nn.Module, calls: list[ModelCall]) -> Iterator[dict[tuple[int, int], list[torch.Tensor]]]:
    """(model call, layer) -> the router's natural sorted (T, K) choice per router call, from its probabilities."""
    natural: dict[tuple[int, int], list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        found = LAYER_PATH.findall(name)
        if not found or not type(module).__name__.endswith("Router"):
            continue

        def on_router(_m: nn.Module, _args: tuple, output: Any, layer: int = int(found[-1])) -> None:
            probs_TE = output[0].detach().float()
            chosen_TK = probs_TE.argsort(dim=-1, descending=True, stable=True)[:, :TOP_K]
            natural.setdefault((len(calls) - 1, layer), []).append(chosen_TK.sort(dim=-1).values.cpu())

        handles.append(module.register_forward_hook(on_router))
    try:
        yield natural
    finally:
        for handle in handles:
            handle.remove()


@dataclass(slots=True)
class Pass:
    calls: list[ModelCall]
    natural: dict[tuple[int, int], list[torch.Tensor]]


@contextmanager
def probed(model: nn.Module) -> Iterator[Pass]:
    with dispatch_probe(model) as calls, router_probe(model, calls) as natural:
        yield Pass(calls, natural)


def live_rows(seen: Pass, batch: list[dict[str, torch.Tensor]]) -> tuple[int, int, int]:
    """Over every (model call, experts call, layer): (unrouted positions dispatched, of them dispatched other than
    the router's natural choice, routed positions where the natural choice differs from the rollout's row)."""
    tokens = [e["input_ids"][0].to(torch.int64) for e in batch]
    live = differ = natural_other = 0
    for c, call in enumerate(seen.calls):
        for start, stop in itertools.pairwise(call.cu_seqlens.tolist()):
            segment = call.input_ids[start:stop].to(torch.int64)
            match = [i for i, t in enumerate(tokens) if t.shape == segment.shape and torch.equal(t, segment)]
            if not match:
                continue
            routes_SMK = expected(batch)[match[0]]
            unrouted_S = routes_SMK[:, 0, 0] < 0
            for m, layer in enumerate(MOE_LAYERS):
                dispatched, natural = call.experts[layer], seen.natural[(c, layer)]
                assert len(dispatched) == len(natural)
                for got_TK, free_TK in zip(dispatched, natural, strict=True):
                    got_SK = got_TK[start:stop].sort(dim=-1).values
                    free_SK = free_TK[start:stop]
                    live += int(unrouted_S.sum())
                    differ += int((got_SK[unrouted_S] != free_SK[unrouted_S]).any(-1).sum())
                    want_SK = routes_SMK[:, m].sort(dim=-1).values
                    natural_other += int((free_SK[~unrouted_S] != want_SK[~unrouted_S]).any(-1).sum())
    return live, differ, natural_other


def test_rollout_columns_are_the_servers_first_routing(rollout: Rollout) -> None:
    """Every episode's rows are the routing of the first pass that fed each token (by that pass's weights), the
    resumed request's prefix kept once from the aborted pass, -1 on each episode's last token only."""
    moe = list(rollout.geometry.moe_layers)
    for index, episode in enumerate(rollout.batch):
        tokens = episode["input_ids"][0].tolist()
        server = rollout.interrupted if index == 0 else rollout.server
        truth_SMK = first_routing(server.calls, server.versions, tokens)[:, moe]
        np.testing.assert_array_equal(as_sets(episode[ROUTES_KEY][0].numpy()), as_sets(truth_SMK))
        unrouted = np.flatnonzero((episode[ROUTES_KEY][0] < 0).all(dim=(-2, -1)).numpy()).tolist()
        assert unrouted == [len(tokens) - 1]
        assert episode[TOKENS_KEY][0].tolist() == [*tokens[:-1], -1]
    first, resumed = rollout.interrupted.calls
    assert first.aborted and resumed.start_len == len(first.tokens) - 1 and first.version != resumed.version
    loss_mask = rollout.batch[-1]["loss_mask"][0].tolist()
    turns = [key for key, _ in itertools.groupby(loss_mask)]
    assert turns == [0, 1, 0, 1], "the multi-turn episode: prompt, answer, observation span, answer"


def test_r3_dispatches_the_rollout_routes_in_areals_compute_logp_and_every_update_micro_batch(
    rollout: Rollout, actor: Any, areal_mode: Any
) -> None:
    """The trainer's step on the rollout's batch: compute_logp, compute_advantages, ppo_update (2 mini-batches,
    2 micro-batches each call). Every routed (token, MoE layer) of every experts call equals the rollout's row
    (disagreement exactly 0), the -1 rows take the router's own choice, and the actor's routers would have
    chosen otherwise at routed positions; disabled, the same batch dispatches something else."""
    batch = rollout.batch
    # control: AReaL's actor without replay (weights other than the rollout's) dispatches something else
    areal_mode("disabled")
    with probed(actor.model) as control:
        actor.compute_logp([dict(e) for e in batch])
    assert disagreement(by_trajectory(control.calls, batch), expected(batch)) > 0

    areal_mode("R3")
    data = [dict(e) for e in batch]
    with probed(actor.model) as logp:
        prox_logps = actor.compute_logp(data)
    for trajectory, prox in zip(data, prox_logps, strict=True):
        trajectory["prox_logp"] = prox
    advantages = actor.compute_advantages(data)
    with probed(actor.model) as update:
        actor.ppo_update(advantages)

    for seen, passes in ((logp, 1), (update, 2)):  # an update's forward, then its checkpoint recompute
        by_traj = by_trajectory(seen.calls, batch)
        assert disagreement(by_traj, expected(batch)) == 0
        for i, layer in itertools.product(range(len(batch)), MOE_LAYERS):
            assert len(by_traj[i][layer]) == passes, (i, layer)  # each trajectory once per pass of its micro-batch
        live, differ, natural_other = live_rows(seen, batch)
        assert live > 0 and differ == 0  # the -1 rows (each episode's last token) routed live
        assert natural_other > 0  # the actor's own routers would have chosen otherwise: replay did it


def test_the_resumed_requests_rows_are_used_once_at_their_own_positions(
    rollout: Rollout, actor: Any, areal_mode: Any
) -> None:
    """The aborted pass's rows on the prefix, the resumed pass's after it: the actor dispatches exactly those at
    each position, not the resumed pass's re-routing of the prefix (which the server also sent)."""
    first, resumed = rollout.interrupted.calls
    areal_mode("R3")
    episode = rollout.batch[0]
    with probed(actor.model) as seen:
        actor.compute_logp([dict(e) for e in rollout.batch[:2]])  # AReaL's 2 micro-batches need 2 sequences
    dispatched = by_trajectory(seen.calls, [episode])[0]
    moe = list(rollout.geometry.moe_layers)
    prefix = len(first.tokens) - 1
    truth_SAK = first_routing([first, resumed], rollout.interrupted.versions, episode["input_ids"][0].tolist())
    rerouted_SMK = model_routes(rollout.interrupted.versions[resumed.version], list(resumed.tokens))[:, moe]
    for m, layer in enumerate(MOE_LAYERS):
        (got_SK,) = dispatched[layer]
        routed = len(resumed.tokens) - 1
        np.testing.assert_array_equal(got_SK[:routed].numpy(), as_sets(truth_SAK[:routed, moe[m]]))
    prefix_rows = torch.stack([dispatched[layer][0][:prefix] for layer in MOE_LAYERS], dim=1).numpy()
    assert (as_sets(prefix_rows) != as_sets(rerouted_SMK[:prefix])).any()  # keeping the re-routing would show
    assert int(episode["input_ids"].shape[1]) == len(first.input_ids) + MAX_NEW


def plain_episodes(versions: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """AReaL's own RLVRWorkflow (no routes columns) through its RemoteSGLangEngine, four prompts."""
    from areal.workflow.rlvr import RLVRWorkflow

    workflow = RLVRWorkflow(reward_fn=unit_reward, gconfig=gconfig(), tokenizer=word_tokenizer())
    prompts = ("w50 w51", "w60 w61 w62 w63", "w70 w71 w72", "w80 w81 w82 w83 w84")
    with (
        SGLangServer(versions) as server,
        areal_engine(server, consumer_batch_size=len(prompts), max_concurrent_rollouts=len(prompts)) as engine,
    ):
        for prompt in prompts:
            engine.submit(chat(prompt), workflow=workflow)
        episodes = engine.wait(len(prompts), timeout=120)
    assert all(e is not None and ROUTES_KEY not in e for e in episodes)
    return episodes


def update_inputs(actor: Any, batch: list[dict[str, torch.Tensor]], logps: list[torch.Tensor]) -> list[dict]:
    return actor.compute_advantages([{**e, "prox_logp": lp} for e, lp in zip(batch, logps, strict=True)])


def test_r2_on_areals_plain_rlvr_episodes_replays_the_recording_where_natural_routing_drifts(
    rollout: Rollout, actor: Any, areal_mode: Any
) -> None:
    """R2 on AReaL's own RLVRWorkflow episodes: compute_logp records the actor's routing, two ppo_updates (2
    optimizer steps each) dispatch exactly that (drift 0); disabled, the same steps drift from the first pass."""
    batch = plain_episodes(rollout.server.versions)
    areal_mode("disabled")
    with probed(actor.model) as control:
        logps = actor.compute_logp(batch)
    natural = first_pass_of(control, batch)
    advantages = update_inputs(actor, batch, logps)
    drift = []
    for _ in range(2):
        with probed(actor.model) as seen:
            actor.ppo_update(advantages)
        drift.append(disagreement(by_trajectory(seen.calls, batch), natural))
    assert drift[-1] > 0, "the control must drift"

    areal_mode("R2")
    with probed(actor.model) as recording:
        logps = actor.compute_logp(batch)
    recorded = first_pass_of(recording, batch)
    advantages = update_inputs(actor, batch, logps)
    for _ in range(2):
        with probed(actor.model) as seen:
            actor.ppo_update(advantages)
        assert disagreement(by_trajectory(seen.calls, batch), recorded) == 0


def first_pass_of(seen: Pass, batch: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    from tests.integrations.areal.actor_case import first_pass

    return first_pass(by_trajectory(seen.calls, batch))


def test_the_mode_travels_from_areals_yaml_through_the_trainer_to_the_actor(
    rollout: Rollout, model_path: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPMD: AReaL's YAML loaded by its `load_expr_config` with `rollout.return_routed_experts=true`; the trainer's
    config step (`RouteReplayPPOTrainer.__init__` runs `configure` first) writes R3 into the actor's
    scheduling_spec; the actor the trainer builds reads it there (no environment variable) and replays."""
    from areal.api import FinetuneSpec
    from areal.api.alloc_mode import ModelAllocation

    from routereplay.integrations.areal import AReaLReplayMode, configure
    from routereplay.integrations.areal.trainer import RouteReplayPPOTrainer
    from tests.integrations.areal.actor_case import grpo_config

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    monkeypatch.delenv(MODE_ENV, raising=False)
    cfg = grpo_config(tmp_path, model_path, "rollout.return_routed_experts=true")
    assert configure(cfg) is AReaLReplayMode.R3
    trainer = RouteReplayPPOTrainer.__new__(RouteReplayPPOTrainer)
    trainer.config, trainer.scheduler = cfg, None
    built = trainer._create_train_engine(cfg.actor, ModelAllocation.from_str(cfg.actor.backend, name="actor"))
    built.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=len(rollout.batch)))
    try:
        assert built.router_replay_mode() is AReaLReplayMode.R3
        with probed(built.model) as seen:
            built.compute_logp([dict(e) for e in rollout.batch])
        assert disagreement(by_trajectory(seen.calls, rollout.batch), expected(rollout.batch)) == 0
    finally:
        built.routing().bind(built.model).detach()
