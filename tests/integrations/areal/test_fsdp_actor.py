"""routereplay R3 / R2 in AReaL 1.0.4's own FSDP actor (`FSDPPPOActor.compute_logp` / `ppo_update`), on CPU.

One actor per module (AReaL's `create_process_group` + `initialize`, gloo, world size 1; `actor_case.py`); each
test sets the mode in the environment (`ROUTEREPLAY_AREAL_ROUTER_REPLAY`) and AReaL's micro-batching on the
actor's own config. The truth is the dispatch probe: the expert ids each MoE layer's experts received, per packed
model call (forward and activation-checkpoint recompute), matched to trajectories by their tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from routereplay.errors import (
    BatchFieldError,
    ConfigError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    MissingRoutesError,
    PartialRowError,
    TokenMismatchError,
    UncheckedRoutesError,
)
from tests.distributed.launch import REPO_ROOT, free_port
from tests.integrations.areal.actor_case import (
    MOE_LAYERS,
    ROUTES_KEY,
    TOKENS_KEY,
    actor_config,
    build_actor,
    by_trajectory,
    checkpoint,
    disagreement,
    dispatch_probe,
    episodes,
    first_pass,
    joined_calls,
    random_routes,
    with_routes,
)

pytestmark = pytest.mark.areal
MODE_ENV = "ROUTEREPLAY_AREAL_ROUTER_REPLAY"
UNCHECKED_ENV = "ROUTEREPLAY_AREAL_UNCHECKED_ROUTES"


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    actor = build_actor(actor_config(path))
    yield actor
    actor.routing().bind(actor.model).detach()


@pytest.fixture
def mode(monkeypatch: pytest.MonkeyPatch, actor: Any) -> Iterator[Any]:
    """Sets the mode per test; AReaL's micro-batching back to the module's (2 micro-batches, no pad-to-max)."""
    from areal.api.cli_args import MicroBatchSpec

    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    yield lambda value: monkeypatch.setenv(MODE_ENV, value)
    actor.config.mb_spec = MicroBatchSpec(n_mbs=2)
    actor.config.pad_to_maximum = False


def logp_pass(actor: Any, data: list[dict]) -> tuple[list[torch.Tensor], Any]:
    with dispatch_probe(actor.model) as calls:
        logps = actor.compute_logp(data)
    return logps, calls


def update_inputs(actor: Any, data: list[dict], logps: list[torch.Tensor]) -> list[dict]:
    with_prox = [{**d, "prox_logp": lp} for d, lp in zip(data, logps, strict=True)]
    return actor.compute_advantages(with_prox)


def update_pass(actor: Any, adv: list[dict]) -> Any:
    with dispatch_probe(actor.model) as calls:
        actor.ppo_update(adv)
    return calls


def exported() -> dict[str, float]:
    from areal.utils import stats_tracker

    return {k: v for k, v in stats_tracker.export_all().items() if "router_replay/" in k}


def routed_rows(routes: list[torch.Tensor]) -> int:
    return sum(int((r[:, 0, 0] >= 0).sum()) for r in routes) * len(MOE_LAYERS)


def test_r3_dispatches_the_rollout_routes_in_compute_logp_and_every_update_micro_batch(actor: Any, mode: Any) -> None:
    batch = episodes()
    routes = random_routes(batch)
    mode("disabled")
    _, calls = logp_pass(actor, with_routes(batch, routes))
    assert disagreement(by_trajectory(calls, batch), routes) > 0  # natural routing is not the random routes
    exported()

    mode("R3")
    data = with_routes(batch, routes)
    logps, calls = logp_pass(actor, data)
    assert len(calls) == 2 and disagreement(by_trajectory(calls, batch), routes) == 0
    adv = update_inputs(actor, data, logps)
    before = [p.detach().full_tensor().clone() for p in actor.model.parameters()]
    for _ in range(2):
        calls = update_pass(actor, adv)
        assert len(calls) == 4  # 2 PPO mini-batches x 2 micro-batches
        seen = by_trajectory(calls, batch)
        assert all(len(seen[i][1]) == 2 for i in seen)  # its forward and its checkpoint recompute, both replayed
        assert disagreement(seen, routes) == 0
    assert any(
        not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, actor.model.parameters(), strict=True)
    )

    metrics = exported()
    finals = len(batch) * len(MOE_LAYERS)  # each final token: no rollout route, routed live
    assert metrics["ppo_actor/compute_logp/router_replay/replayed_rows"] == routed_rows(routes)
    assert metrics["ppo_actor/compute_logp/router_replay/fallback_rows"] == finals
    assert metrics["ppo_actor/update/router_replay/replayed_rows"] == 2 * routed_rows(routes)
    assert metrics["ppo_actor/update/router_replay/fallback_rows"] == 2 * finals
    assert metrics["ppo_actor/update/router_replay/recompute_calls"] > 0
    assert metrics["ppo_actor/update/router_replay/disagree_rows"] > 0  # random routes: the live router disagrees
    assert metrics["ppo_actor/update/router_replay/unchecked_samples"] == 0
    assert 0 < metrics["ppo_actor/update/router_replay/disagree_rate/layer_1"] <= 1


def test_r2_replays_what_compute_logp_recorded_where_natural_routing_drifts(actor: Any, mode: Any) -> None:
    batch = episodes(seed=1)
    mode("disabled")
    logps, calls = logp_pass(actor, batch)
    natural = first_pass(by_trajectory(calls, batch))
    adv = update_inputs(actor, batch, logps)
    drift = [disagreement(by_trajectory(update_pass(actor, adv), batch), natural) for _ in range(2)]
    assert drift[-1] > 0, "the control must drift (lr too small?)"

    mode("R2")
    for _ in range(2):  # a compute_logp after updates starts a new recording
        logps, calls = logp_pass(actor, batch)
        recorded = first_pass(by_trajectory(calls, batch))
        adv = update_inputs(actor, batch, logps)
        for _ in range(2):
            seen = by_trajectory(update_pass(actor, adv), batch)
            assert disagreement(seen, recorded) == 0
    assert actor.routereplay_stats()["recorded_samples"] == len(batch)
    metrics = exported()
    rows = sum(int(e["input_ids"].shape[1]) for e in batch) * len(MOE_LAYERS)
    assert metrics["ppo_actor/compute_logp/router_replay/recorded_rows"] == 2 * rows
    assert metrics["ppo_actor/update/router_replay/replayed_rows"] == 4 * rows
    assert metrics["ppo_actor/update/router_replay/fallback_rows"] == 0


def test_r2_update_without_compute_logp_on_its_batch_is_refused(actor: Any, mode: Any) -> None:
    mode("R2")
    batch = episodes(seed=2)
    logps, _ = logp_pass(actor, batch)
    adv = update_inputs(actor, batch, logps)
    other = update_inputs(actor, episodes(seed=3), logps)
    with pytest.raises(MissingRoutesError, match="was not in the compute_logp call that recorded"):
        update_pass(actor, other)
    update_pass(actor, adv)
    actor.compute_logp(episodes(seed=3))  # after an update: a new recording, of another batch only
    with pytest.raises(MissingRoutesError, match="was not in the compute_logp call"):
        update_pass(actor, adv)


@pytest.mark.parametrize(
    "layout",
    [{"n_mbs": 1}, {"n_mbs": 4}, {"n_mbs": 1, "max_tokens_per_mb": 20, "pad_to_maximum": True}],
    ids=["one_micro_batch", "four_micro_batches", "pad_to_maximum"],
)
def test_r3_micro_batch_layouts_dispatch_the_same_routes_and_log_probs(actor: Any, mode: Any, layout: dict) -> None:
    from areal.api.cli_args import MicroBatchSpec

    batch = episodes(seed=4)
    routes = random_routes(batch, seed=6)
    mode("R3")
    reference, _ = logp_pass(actor, with_routes(batch, routes))  # 2 micro-batches
    spec = {k: v for k, v in layout.items() if k != "pad_to_maximum"}
    actor.config.mb_spec = MicroBatchSpec(**spec)
    actor.config.pad_to_maximum = bool(layout.get("pad_to_maximum", False))
    logps, calls = logp_pass(actor, with_routes(batch, routes))
    if layout.get("pad_to_maximum"):  # AReaL packed by max_tokens_per_mb and padded each micro-batch to it
        assert len(calls) >= 2 and all(int(c.input_ids.numel()) == 20 for c in calls)
    else:
        assert len(calls) == spec["n_mbs"]
    assert disagreement(by_trajectory(calls, batch), routes) == 0
    for a, b in zip(reference, logps, strict=True):  # the final position's label wraps into the packed neighbour
        torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=1e-4, atol=1e-5)


def test_r3_plain_padded_hf_forward_dispatches_what_the_packed_actor_does(
    actor: Any, mode: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same routes replayed by routereplay on a plain right-padded HF batch (no AReaL) dispatch the same sets
    as AReaL's packed micro-batches."""
    import transformers

    import routereplay

    batch = episodes(seed=5)
    routes = random_routes(batch, seed=7)
    mode("R3")
    _, calls = logp_pass(actor, with_routes(batch, routes))
    packed = first_pass(by_trajectory(calls, batch))

    model = transformers.AutoModelForCausalLM.from_pretrained(actor.config.path, dtype=torch.float32).eval()
    width = max(int(e["input_ids"].shape[1]) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros(len(batch), width, dtype=torch.int64)
    padded = torch.full((len(batch), width, len(MOE_LAYERS), 2), -1, dtype=torch.int64)
    for b, (episode, rows) in enumerate(zip(batch, routes, strict=True)):
        n = int(episode["input_ids"].shape[1])
        ids[b, :n], mask[b, :n], padded[b, :n] = episode["input_ids"][0], 1, rows
    from tests.runtime.models import experts_inputs

    with experts_inputs(model) as seen, torch.no_grad(), routereplay.attach(model).replay(padded, attention_mask=mask):
        model(input_ids=ids, attention_mask=mask)
    for m, layer in enumerate(MOE_LAYERS):
        flat = seen[layer][0].sort(dim=-1).values.reshape(len(batch), width, 2)
        for b, episode in enumerate(batch):
            n = int(episode["input_ids"].shape[1])
            routed = routes[b][:, 0, 0] >= 0
            assert torch.equal(flat[b, :n][routed], packed[b][:, m][routed])


def test_token_check_refuses_rows_rotated_against_input_ids_before_the_model_runs(actor: Any, mode: Any) -> None:
    mode("R3")
    batch = episodes(seed=6)
    routes = random_routes(batch)
    data = with_routes(batch, routes)
    data[2] = {**data[2], ROUTES_KEY: data[2][ROUTES_KEY].roll(1, dims=1), TOKENS_KEY: data[2][TOKENS_KEY].roll(1, 1)}
    with pytest.raises(TokenMismatchError, match=r"trajectory 2 row 0, position 1: .* rows shifted by one"):
        logp_pass(actor, data)


def test_token_check_refuses_equal_length_trajectories_swapped_and_the_opt_out_replays_them_counted(
    actor: Any, mode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mode("R3")
    batch = episodes(seed=7)
    routes = random_routes(batch)
    assert batch[0]["input_ids"].shape == batch[1]["input_ids"].shape
    data = with_routes(batch, routes)
    for key in (ROUTES_KEY, TOKENS_KEY):
        data[0][key], data[1][key] = data[1][key], data[0][key]
    logps = [torch.zeros(e["input_ids"].shape) for e in batch]
    adv = update_inputs(actor, data, logps)
    before = [p.detach().full_tensor().clone() for p in actor.model.parameters()]
    with dispatch_probe(actor.model) as calls, pytest.raises(TokenMismatchError, match="trajectory 0 row 0"):
        actor.ppo_update(adv)
    assert not calls  # refused before AReaL's first mini-batch: no forward, no step
    assert all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, actor.model.parameters(), strict=True))

    exported()
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    swapped = [routes[1], routes[0], *routes[2:]]
    _, calls = logp_pass(actor, data)
    assert disagreement(by_trajectory(calls, batch), swapped) == 0  # replayed as given: onto the wrong tokens
    assert exported()["ppo_actor/compute_logp/router_replay/unchecked_samples"] == len(batch)
    assert actor.routereplay_stats()["unchecked_samples"] >= len(batch)


def test_r3_without_the_token_column_is_refused_unless_opted_out(
    actor: Any, mode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mode("R3")
    batch = episodes(seed=8)
    routes = random_routes(batch)
    data = with_routes(batch, routes, tokens=False)
    with pytest.raises(UncheckedRoutesError, match=f"without '{TOKENS_KEY}'.*{UNCHECKED_ENV}=1"):
        logp_pass(actor, data)
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    _, calls = logp_pass(actor, data)
    assert disagreement(by_trajectory(calls, batch), routes) == 0


def test_r3_without_the_routes_column_names_areals_key(actor: Any, mode: Any) -> None:
    mode("R3")
    with dispatch_probe(actor.model) as calls, pytest.raises(MissingRoutesError, match="rollout.return_routed_experts"):
        actor.compute_logp(episodes())
    assert not calls


def _hostile(kind: str, data: list[dict]) -> None:
    routes = data[3][ROUTES_KEY].clone()
    if kind == "id_out_of_range":
        routes[0, 1, 0, 0] = 16
    elif kind == "duplicate_id":
        routes[0, 0, 1, 1] = routes[0, 0, 1, 0]
    elif kind == "partial_row":
        routes[0, 0, 0, 1] = -1
    elif kind == "float_dtype":
        routes = routes.float()
    elif kind == "all_layers":
        routes = torch.cat([routes[:, :, :1], routes], dim=2)
    elif kind == "token_sentinel":
        data[3][TOKENS_KEY] = data[3][TOKENS_KEY].clone()
        data[3][TOKENS_KEY][0, 0] = -1
    data[3][ROUTES_KEY] = routes


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("id_out_of_range", ExpertIdRangeError, "trajectory 3 .*expert id 16 is outside"),
        ("duplicate_id", DuplicateExpertError, "trajectory 3 .*names an expert twice"),
        ("partial_row", PartialRowError, "trajectory 3 .*mixes -1"),
        ("float_dtype", DtypeError, "trajectory 3: 'routereplay_routes' has dtype torch.float32"),
        ("all_layers", LayerCountError, "3 layer columns, the model has 2 MoE layers"),
        ("token_sentinel", BatchFieldError, "position 0: 'routereplay_route_tokens' is -1 where the route row is"),
    ],
)
def test_hostile_route_columns_are_refused_by_name_before_the_model_runs(
    actor: Any, mode: Any, kind: str, error: type, match: str
) -> None:
    mode("R3")
    batch = episodes(seed=9)
    data = with_routes(batch, random_routes(batch))
    _hostile(kind, data)
    with dispatch_probe(actor.model) as calls, pytest.raises(error, match=match):
        actor.compute_logp(data)
    assert not calls


def test_r2_refuses_rollout_routes_on_the_batch(actor: Any, mode: Any) -> None:
    mode("R2")
    batch = episodes()
    with pytest.raises(ConfigError, match="R2 with the rollout's routes on the batch"):
        actor.compute_logp(with_routes(batch, random_routes(batch)))


def test_route_columns_reaching_the_engine_outside_compute_logp_and_ppo_update_are_refused(
    actor: Any, mode: Any
) -> None:
    mode("R3")
    batch = episodes()
    with pytest.raises(ConfigError, match="outside compute_logp / ppo_update"):
        actor.forward(with_routes(batch, random_routes(batch)))


def test_disabled_drops_the_columns_before_the_hf_model(actor: Any, mode: Any) -> None:
    mode("disabled")
    batch = episodes()
    seen: list[set[str]] = []
    handle = actor.model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(set(kw)), with_kwargs=True)
    try:
        actor.compute_logp(with_routes(batch, random_routes(batch)))
    finally:
        handle.remove()
    assert seen and not any({ROUTES_KEY, TOKENS_KEY, "routereplay_route_row"} & keys for keys in seen)


@pytest.mark.parametrize("unset", [None, ""], ids=["absent", "empty"])
def test_routes_on_a_batch_while_no_mode_was_chosen_are_refused_not_dropped(
    actor: Any, mode: Any, monkeypatch: pytest.MonkeyPatch, unset: str | None
) -> None:
    if unset is None:
        monkeypatch.delenv(MODE_ENV, raising=False)
    else:
        mode(unset)
    assert not any(MODE_ENV in spec.env_vars for spec in actor.config.scheduling_spec)
    batch = episodes()
    routed = with_routes(batch, random_routes(batch))
    fix = f"{MODE_ENV} is not set.*RouteReplayPPOTrainer.*{MODE_ENV}=disabled"
    with dispatch_probe(actor.model) as calls:
        with pytest.raises(ConfigError, match=fix):
            actor.compute_logp(routed)
        with pytest.raises(ConfigError, match=fix):
            actor.ppo_update(routed)
        with pytest.raises(ConfigError, match=fix):
            actor.forward(routed)
    assert not calls  # refused before the model ran
    actor.compute_logp(batch)  # a batch without routes runs as AReaL's actor


def run_ranks(scenario: str, folder: Path, timeout_s: float = 300.0) -> None:
    """Two processes, one gloo rank each, running `actor_case.<scenario>(folder)` (env:// as torchrun sets it)."""
    port, procs = str(free_port()), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}  # fmt: skip
        env.pop("ROUTEREPLAY_AREAL_ROUTER_REPLAY", None)
        code = f"from tests.integrations.areal.actor_case import {scenario}; {scenario}({str(folder)!r})"
        log = open(folder / f"rank{rank}.log", "w")  # closed with the process below
        procs.append((subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))  # fmt: skip
    try:
        for proc, _ in procs:
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
    finally:
        for proc, log in procs:
            proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        if proc.returncode != 0:
            tail = (folder / f"rank{rank}.log").read_text().splitlines()[-30:]
            pytest.fail(f"{scenario} rank {rank} exited {proc.returncode}:\n" + "\n".join(tail))


def test_ulysses_sp_two_gloo_ranks_dispatch_their_slices_of_the_routes_r3_and_r2(tmp_path: Path) -> None:
    """AReaL's own Ulysses input path (`_prepare_mb_inputs`: `ulysses_pad_and_slice_inputs`,
    `ulysses_prepare_inputs`) with `backend=fsdp:d1c2` on 2 gloo ranks: each rank's experts dispatch its slice of
    the routes (R3), and R2 replays the recording gathered over the SP group. On CPU the attention is sdpa on each
    rank's slice (AReaL's Ulysses attention patches flash-attention only), which changes logits, not the layout."""
    checkpoint(tmp_path / "model")
    run_ranks("sp_rank", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["sp_size"] for r in ranks] == [2, 2]
    assert all(all(r["slices"]) for r in ranks)  # packed_layout.ulysses_slice == AReaL's ulysses_pad_and_slice_inputs
    batch, routes = episodes(), ranks[0]["routes"]

    def seen(name: str) -> dict:
        return by_trajectory(joined_calls([r[name] for r in ranks]), batch)

    assert disagreement(seen("compute_logp_r3"), routes) == 0
    assert disagreement(seen("update_r3"), routes) == 0
    recorded = first_pass(seen("compute_logp_r2"))
    assert disagreement(seen("update_r2"), recorded) == 0


def test_r2_recordings_are_shared_over_the_dp_group(tmp_path: Path) -> None:
    """`backend=fsdp:d2` on 2 gloo ranks: each rank records its own batch, then updates on the other rank's; the
    update dispatches what the other rank's compute_logp recorded (only the all-gathered recording has it)."""
    checkpoint(tmp_path / "model")
    run_ranks("dp_rank", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in range(2):
        other = 1 - rank
        batch = episodes(seed=other)
        recorded = first_pass(by_trajectory(ranks[other]["logp"], batch))
        assert disagreement(by_trajectory(ranks[rank]["update"], batch), recorded) == 0
