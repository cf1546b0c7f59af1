"""router_replay.mode=R2 with the rollout's routes on the batch is refused by name, as verl refuses it.

R2 records the trainer's routing in compute_log_prob and replays it in the updates; rollout routes
(`enable_rollout_routing_replay=True`, or routereplay's compact column) would silently turn R2 into
R3. verl 0.9.1 refuses the combination in `ray_trainer.py` only when compute_log_prob returns
recorded routes beside the rollout's, which a replaying pass never does. The engine, built like
verl's CPU tests build it (`fsdp_case.py`), refuses every form of it before any forward runs: the
probe on the experts modules sees no call.
"""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import ConfigError
from tests.integrations.verl import fsdp_case as case

pytestmark = pytest.mark.verl

R2_WITH_R3 = r"router_replay.mode=R2 with the rollout's routes on the batch .*enable_rollout_routing_replay=False"


def _case() -> tuple[torch.nn.Module, list, list[torch.Tensor], list]:
    model, seqs = case.tiny_model(), case.sequences()
    rollout = case.rollout_model(model)
    return model, seqs, case.rollout_routes(rollout, seqs), case.rollout_traces(rollout, seqs)


def _batches(seqs: list, routes: list[torch.Tensor], traces: list) -> dict[str, object]:
    """The rollout's routes in every form they reach verl's batch."""
    return {
        "verl zero-filled routed_experts": case.verl_batch(seqs, routes, remove_padding=True),
        "dense -1 routed_experts": case.verl_batch(seqs, None, remove_padding=True, traces=traces, traces_form="dense"),
        "compact column": case.verl_batch(seqs, None, remove_padding=True, traces=traces),
    }


def test_r2_compute_log_prob_refuses_rollout_routes_in_every_form(cpu_engine_module: None) -> None:
    model, seqs, routes, traces = _case()
    engine = case.build_engine(model, "R2")
    for form, data in _batches(seqs, routes, traces).items():
        with case.dispatched(model) as seen, pytest.raises(ConfigError, match=R2_WITH_R3) as refusal:
            engine.infer_batch(data)  # compute_log_prob: R2 must record here, not replay the rollout's routes
        assert all(not calls for calls in seen.values()), f"{form}: refused before any forward"
        assert "compute_log_prob" in str(refusal.value) or "column" in str(refusal.value), form


def test_r2_update_refuses_rollout_routes_but_replays_what_compute_log_prob_recorded(cpu_engine_module: None) -> None:
    model, seqs, routes, traces = _case()
    engine = case.build_engine(model, "R2")
    for form, data in _batches(seqs, routes, traces).items():  # an update without a recording pass (bypass mode)
        with case.dispatched(model) as seen, pytest.raises(ConfigError, match=R2_WITH_R3):
            engine.train_batch(data, case.log_prob_loss)
        assert all(not calls for calls in seen.values()), f"{form}: refused before any forward"

    recorded = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))["model_output"]["routed_experts"]
    update = case.verl_batch(seqs, None, remove_padding=True, traces=traces)
    update["routed_experts"] = recorded  # verl's trainer unions the recording into a batch that kept the column
    with pytest.raises(ConfigError, match="'routereplay_routes' column"):
        engine.train_batch(update, case.log_prob_loss)
    update = case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=len(seqs))
    update["routed_experts"] = recorded
    with case.dispatched(model) as seen:
        engine.train_batch(update, case.log_prob_loss)
    got_NK = case.sorted_rows(case.token_rows(update, True)(seen[case.MOE_LAYERS[0]][0]))
    assert torch.equal(got_NK, case.sorted_rows(recorded.values()[:, 0].to(torch.int64)))
