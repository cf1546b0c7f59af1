"""The FSDP engine checks verl's dense `routed_experts` that carry no token digest, and every form's geometry.

- R3 with verl's own agent-loop `routed_experts` (no digest, no token ids) is refused before any forward
  unless the worker opted out with `ROUTEREPLAY_VERL_UNCHECKED_ROUTES=1`; opted out, the samples are
  counted and logged once per `forward_backward_batch`.
- R2: verl's trainer brings compute_log_prob's recording back as `routed_experts` only, so the engine keeps
  a token digest -> routes digest map of what it recorded: recorded routes on swapped equal-length samples
  are refused, samples this rank never recorded are counted as unverified and replayed.
- The model's geometry reaches the readers: a dense layer's column holding expert ids, another top-k, or a
  compact header of another experts count are refused by name before any forward.

Built like verl's CPU tests build engines (`fsdp_case.py`); a probe on every experts module says what the
model computed with. Legend: N = tokens of the batch, K = top-k.
"""

from __future__ import annotations

import logging

import pytest
import torch

from routereplay.errors import (
    BatchGeometryError,
    ConfigError,
    DenseLayerRouteError,
    TokenMismatchError,
    UncheckedRoutesError,
)
from routereplay.integrations.verl.route_checks import UNCHECKED_ENV
from tests.integrations.verl import fsdp_case as case

pytestmark = pytest.mark.verl

LOGGER = "routereplay.integrations.verl"


def _rollout() -> tuple[torch.nn.Module, list, list[torch.Tensor]]:
    model, seqs = case.tiny_model(), case.sequences()
    return model, seqs, case.rollout_routes(case.rollout_model(model), seqs)


def _no_forward(seen: dict[int, list[torch.Tensor]]) -> bool:
    return all(not calls for calls in seen.values())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_r3_refuses_verls_own_routed_experts_unless_opted_out(
    cpu_engine_module: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    for run in (engine.infer_batch, lambda data: engine.train_batch(data, case.log_prob_loss)):
        data = case.verl_batch(seqs, routes, remove_padding=True)
        with case.dispatched(model) as seen, pytest.raises(UncheckedRoutesError) as refusal:
            run(data)
        assert _no_forward(seen), "refused before any forward"
        message = str(refusal.value)
        assert "router_replay.mode=R3" in message and "no 'routereplay_routes_digest' column" in message  # what
        assert "external_lib" in message and "RouteCheckedAgentLoop" in message  # how: routereplay's agent loops
        assert "form='compact' | 'dense'" in message  # or its batch forms
        assert f'runtime_env.env_vars.{UNCHECKED_ENV}="1"' in message  # or the opt-out, as verl passes it

    monkeypatch.setenv(UNCHECKED_ENV, "maybe")
    with pytest.raises(ConfigError, match=f"{UNCHECKED_ENV}='maybe': set it to 1"):
        engine.infer_batch(case.verl_batch(seqs, routes, remove_padding=True))


def test_r3_opt_out_replays_counts_and_logs_once_per_pass(
    cpu_engine_module: None, unchecked_verl_routes: None, caplog: pytest.LogCaptureFixture
) -> None:
    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    engine.infer_batch(case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=2))  # 2 micro-batches
    assert engine.routing().counts.total_unchecked == len(seqs)
    (line,) = _warnings(caplog)
    assert f"{len(seqs)} samples replayed from verl's own routed_experts without a token check" in line
    caplog.clear()
    engine.train_batch(case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=1), case.log_prob_loss)
    assert len(_warnings(caplog)) == 1, "one line per forward_backward_batch, not per micro-batch"
    assert engine.routing().counts.total_unchecked == 2 * len(seqs)

    caplog.clear()
    traces = case.rollout_traces(case.rollout_model(model), seqs)  # routereplay's forms: checked, nothing logged
    for form in ("compact", "dense"):
        engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True, traces=traces, traces_form=form))
    assert _warnings(caplog) == [] and engine.routing().counts.total_unchecked == 2 * len(seqs)


def _swapped(seqs: list) -> list:
    assert sum(map(torch.numel, seqs[0])) == sum(map(torch.numel, seqs[1])), "equal lengths: a swap keeps shapes"
    return [seqs[1], seqs[0], *seqs[2:]]


def test_r2_refuses_recorded_routes_on_swapped_samples_and_replays_its_own_exactly(
    cpu_engine_module: None, caplog: pytest.LogCaptureFixture
) -> None:
    model, seqs, _ = _rollout()
    engine = case.build_engine(model, "R2")
    recorded = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))["model_output"]["routed_experts"]

    update = case.verl_batch(_swapped(seqs), None, remove_padding=True, micro_batch_size=len(seqs))
    update["routed_experts"] = recorded  # verl's trainer unions the recording onto a batch whose samples moved
    with case.dispatched(model) as seen, pytest.raises(TokenMismatchError, match="R2: sample 0 of an update"):
        engine.train_batch(update, case.log_prob_loss)
    assert _no_forward(seen), "refused before any forward"

    caplog.set_level(logging.WARNING, logger=LOGGER)
    update = case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=len(seqs))
    update["routed_experts"] = recorded
    with case.dispatched(model) as seen:
        engine.train_batch(update, case.log_prob_loss)
    for i, m in enumerate(case.MOE_LAYERS):
        got_NK = case.sorted_rows(case.token_rows(update, True)(seen[m][0]))
        assert torch.equal(got_NK, case.sorted_rows(recorded.values()[:, i].to(torch.int64))), f"layer {m}"
    assert engine.routing().counts.total_unverified == 0 and _warnings(caplog) == []


def test_r2_samples_this_rank_did_not_record_are_counted_not_refused(
    cpu_engine_module: None, caplog: pytest.LogCaptureFixture
) -> None:
    model, seqs, _ = _rollout()
    recorder = case.build_engine(model, "R2")  # another DP rank recorded these samples
    recorded = recorder.infer_batch(case.verl_batch(seqs, None, remove_padding=True))["model_output"]["routed_experts"]
    recorder.routing().close_and_detach()

    engine = case.build_engine(model, "R2")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    update = case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=2)
    update["routed_experts"] = recorded
    with case.dispatched(model) as seen:
        engine.train_batch(update, case.log_prob_loss)
    assert engine.routing().counts.total_unverified == len(seqs)
    (line,) = _warnings(caplog)
    assert f"R2: {len(seqs)} samples replayed routes this rank did not record" in line
    rows = case.token_rows(case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=len(seqs)), True)
    got_NK = case.sorted_rows(rows(torch.cat(seen[case.MOE_LAYERS[0]])))
    assert torch.equal(got_NK, case.sorted_rows(recorded.values()[:, 0].to(torch.int64)))


def test_r2_recording_map_is_cleared_by_the_next_recording_pass(cpu_engine_module: None) -> None:
    model, seqs, _ = _rollout()
    engine = case.build_engine(model, "R2")
    first = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))["model_output"]["routed_experts"]
    engine.infer_batch(case.verl_batch(case.sequences(seed=1), None, remove_padding=True))  # the next step's pass
    assert len(engine.routing().recorded.routes_by_tokens) == len(seqs), "one pass of this rank's samples, bounded"
    update = case.verl_batch(_swapped(seqs), None, remove_padding=True, micro_batch_size=len(seqs))
    update["routed_experts"] = first
    engine.train_batch(update, case.log_prob_loss)  # forgotten: unverified, counted (not a stale refusal)
    assert engine.routing().counts.total_unverified == len(seqs)


def test_the_models_geometry_reaches_the_readers(cpu_engine_module: None, unchecked_verl_routes: None) -> None:
    from routereplay.integrations.verl.fsdp_engine import model_geometry
    from routereplay.trace.route_trace import RouteTrace

    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    engine.infer_batch(case.verl_batch(seqs, routes, remove_padding=True))
    geometry = engine.routing().geometry
    assert geometry == model_geometry(model, engine.routing().replayer)
    assert (geometry.num_layers, geometry.moe_layers, geometry.top_k) == (3, case.MOE_LAYERS, case.TOP_K)

    dense_ids = [r.clone() for r in routes]
    dense_ids[2][3, 0] = torch.tensor([4, 9])  # expert ids in dense layer 0's column: not this model's layer axis
    with case.dispatched(model) as seen, pytest.raises(DenseLayerRouteError, match="dense layer 0 .* expert ids"):
        engine.infer_batch(case.verl_batch(seqs, dense_ids, remove_padding=True, micro_batch_size=len(seqs)))
    assert _no_forward(seen)

    top3 = [torch.cat([r, r[..., :1]], dim=-1) for r in routes]  # another model's top-3
    data = case.verl_batch(seqs, None, remove_padding=True)
    data["routed_experts"] = torch.nested.as_nested_tensor(
        [torch.cat([r, r[-1:]]).to(torch.int16) for r in top3], layout=torch.jagged
    )
    with pytest.raises(BatchGeometryError, match="of top-3 for a model with 3 layers"):
        engine.infer_batch(data)

    traces = case.rollout_traces(case.rollout_model(model), seqs)
    wide = [
        RouteTrace(experts=t.experts, num_experts=32, layers=t.layers, start=t.start, token_ids=t.token_ids)
        for t in traces
    ]  # a header of another model (32 experts): its ids all fit in 16, so it would replay silently
    with case.dispatched(model) as seen, pytest.raises(BatchGeometryError):
        engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True, traces=wide))
    assert _no_forward(seen)
