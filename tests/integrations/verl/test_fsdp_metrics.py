"""verl's FSDP engine with routereplay reports `router_replay/...` metrics in verl's own metric output: the
update's `train_batch` metrics, reduced by verl's `reduce_metrics` and logged by verl's `Tracking` (console).

The disagreement rate of the first MoE layer (layer 0 is dense, so its input is the natural one) equals a probe:
the share of routed rows where the experts the trainer dispatches in a natural pass differ from the rollout's.
"""

from __future__ import annotations

import pytest

from tests.integrations.verl import fsdp_case as case

pytestmark = pytest.mark.verl


def test_an_r3_update_reports_disagreement_through_verls_own_metrics_and_tracking(
    cpu_engine_module: None, unchecked_verl_routes: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from verl.utils.metric import reduce_metrics
    from verl.utils.tracking import Tracking

    from routereplay.integrations.verl.micro_batch import rollout_routes

    model = case.tiny_model(0)
    seqs = case.sequences(0)
    routes = case.rollout_routes(case.rollout_model(model), seqs)
    data = case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=len(seqs))
    want_NPK = rollout_routes(data["routed_experts"], data["input_ids"])
    routed = ~case.last_token_mask(data)
    rows = case.token_rows(data, True)
    first = case.MOE_LAYERS[0]
    with case.dispatched(model) as seen:
        case.build_engine(model, "disabled").infer_batch(data)
    natural_NK, rollout_NK = rows(seen[first][0])[routed], want_NPK[routed, first]
    expected = float((case.sorted_rows(natural_NK) != case.sorted_rows(rollout_NK)).any(-1).float().mean())
    assert 0 < expected < 1, "the rollout model must disagree with the trainer on some rows"

    engine = case.build_engine(model, "R3")
    output = engine.train_batch(
        case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=len(seqs)), case.log_prob_loss
    )
    metrics = reduce_metrics(output["metrics"])  # what verl's trainer does with a worker's metrics
    assert metrics[f"router_replay/disagree_rate/layer_{first}"] == pytest.approx(expected)
    assert metrics["router_replay/compared_rows"] == metrics["router_replay/replayed_rows"] == int(routed.sum()) * 2
    assert metrics["router_replay/forced_disagree_rows"] == metrics["router_replay/disagree_rows"] > 0
    assert metrics["router_replay/unchecked_samples"] == len(seqs)  # verl's own routed_experts, opted out
    Tracking(project_name="routereplay", experiment_name="metrics", default_backend="console").log(metrics, step=1)
    assert "router_replay/disagree_rate" in capsys.readouterr().out

    output = engine.infer_batch(data)  # the old-log-prob pass: no update metrics
    assert not any(name.startswith("router_replay/") for name in (output.get("metrics") or {}))
