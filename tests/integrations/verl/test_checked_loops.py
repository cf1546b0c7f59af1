"""verl's own agent loops hand the trainer checked routes: the "turn it on" lines and nothing else.

Issue 38 item 3: with verl's own agent loop, R3 stopped at the first step (`UncheckedRoutesError`: verl's zero-
filled `routed_experts` carries no token ids) unless the user wrote an agent loop. Here verl 0.9.1's real rollout
half runs on CPU (`agent_loop_case`: verl's generated config with `external_lib=...fsdp_engine`, its
`AgentLoopWorker`, its registry, its single-turn and tool loops, its hermes parser and function tool; only the
LLM server's `generate` is faked), and the batch it builds goes through verl's `to_tensordict` /
`left_right_2_no_padding` to routereplay's FSDP engine in R3 with the token check on (no opt-out).

The truth is outside routereplay: the rollout model's routes of each final sequence (one forward of the whole
sequence: every call prefilled the tokens before it) and a probe on each experts module of the trainer.

Legend: N tokens of a sample, L MoE layers, K top-k.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.integrations.verl import ROUTES_KEY, traces_of
from tests.integrations.verl import agent_loop_case as case
from tests.integrations.verl import fsdp_case
from tests.integrations.verl.rollout_case import engine_routes

pytestmark = pytest.mark.verl

SAMPLES = [("single_turn_agent", "w20 w21"), ("tool_agent", f"{case.ASK_TOOL} w22 w23")]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """verl's rollout of SAMPLES: its AgentLoopWorker built from the config, the batch from generate_sequences."""
    pytest.importorskip("verl")
    folder = tmp_path_factory.mktemp("agent-loops")
    trainer = fsdp_case.tiny_model()
    server = case.ScriptedServer(fsdp_case.rollout_model(trainer))
    case.write_model_folder(folder, trainer)
    worker = case.agent_loop_worker(case.trainer_config(folder, case.write_tool_file(folder)), server)
    data = asyncio.run(worker.generate_sequences(case.prompts(SAMPLES)))
    return {"worker": worker, "server": server, "data": data, "trainer": trainer}


def _tokens(data: Any, b: int) -> list[int]:
    return data.batch["input_ids"][b][data.batch["attention_mask"][b].bool()].tolist()


def _trainer_batch(data: Any) -> Any:
    """What verl's trainer hands compute_log_prob (`_compute_old_log_prob`), with the worker's micro-batch args."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        batch,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=256,
        micro_batch_size_per_gpu=len(data),
        use_fused_kernels=False,
        temperature=1.0,
        calculate_entropy=False,
    )
    return batch


def test_verls_registry_names_the_checked_loops_after_the_turn_it_on_line(rollout: dict[str, Any]) -> None:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    module = "routereplay.integrations.verl.checked_loops"
    assert _agent_loop_registry["single_turn_agent"]["_target_"] == f"{module}.RouteCheckedSingleTurnAgentLoop"
    assert _agent_loop_registry["tool_agent"]["_target_"] == f"{module}.RouteCheckedToolAgentLoop"
    calls = rollout["server"].calls
    assert len(calls) == 3 and calls[1][1][:1] == [case.CALL_START], "the tool loop called the tool, then answered"


def test_verls_own_agent_loops_give_checked_r3_with_no_user_code(
    rollout: dict[str, Any], cpu_engine_module: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch verl's loops build carries a codec blob per sample (token ids inside) and no zero-filled
    `routed_experts`; every token an engine call fed (the tool response between the two turns included) carries
    the rollout model's route; the engine replays them in R3 with the token check on: the experts modules get
    exactly those experts, and only each sample's last token (never fed back) routes live."""
    from routereplay.integrations.verl.route_checks import UNCHECKED_ENV

    monkeypatch.delenv(UNCHECKED_ENV, raising=False)  # the token check stays on
    data, trainer = rollout["data"], rollout["trainer"]
    rollout_model = rollout["server"].model
    assert "routed_experts" not in data.batch.keys(), "verl's loops built verl's zero-filled tensor"
    traces = traces_of(data.non_tensor_batch[ROUTES_KEY])
    want = []
    for b, trace in enumerate(traces):
        tokens = _tokens(data, b)
        assert trace.token_ids.tolist() == tokens[:-1], f"sample {b}: the blob names the batch's tokens"
        truth_NLK = engine_routes(rollout_model, tokens)[:, list(fsdp_case.MOE_LAYERS)].astype(np.int64)
        assert np.array_equal(np.sort(trace.experts, -1), np.sort(truth_NLK, -1)), f"sample {b}: the rollout's routes"
        assert {s.policy_version for s in trace.segments} == {3}, "the weights version the server reported"
        want.append(torch.cat([torch.from_numpy(np.sort(truth_NLK, -1)), torch.full((1, 2, 2), -1)]))
    want_NLK = torch.cat(want)
    routed_N = want_NLK[:, 0, 0] >= 0
    assert int((~routed_N).sum()) == len(SAMPLES), "only each sample's last token has no route"

    batch = _trainer_batch(data)
    engine = fsdp_case.build_engine(trainer, "R3")
    with fsdp_case.dispatched(trainer) as seen:
        engine.infer_batch(batch)  # the old-log-prob pass
    rows = fsdp_case.token_rows(batch, remove_padding=True)
    for i, layer in enumerate(fsdp_case.MOE_LAYERS):
        got_NK = fsdp_case.sorted_rows(rows(seen[layer][0]))
        assert torch.equal(got_NK[routed_N], want_NLK[routed_N, i]), f"layer {layer}: the rollout's experts"
    assert engine.routing().replayer.stats.fallback_rows == len(SAMPLES) * len(fsdp_case.MOE_LAYERS)
    assert engine.routing().counts.total_unchecked == 0, "nothing replayed without the token check"

    engine.routing().close_and_detach()
    with fsdp_case.dispatched(trainer) as seen:
        fsdp_case.build_engine(trainer, "disabled").infer_batch(batch)
    natural_NK = fsdp_case.sorted_rows(rows(seen[fsdp_case.MOE_LAYERS[0]][0]))
    assert not torch.equal(natural_NK[routed_N], want_NLK[routed_N, 0]), "the rollout must route differently"


def test_with_r3_off_verls_loops_build_verls_own_batch(rollout: dict[str, Any]) -> None:
    """No call returns routes (enable_rollout_routing_replay off): no routereplay column, nothing else changed."""
    server, worker = rollout["server"], rollout["worker"]
    server.with_routes = False
    try:
        data = asyncio.run(worker.generate_sequences(case.prompts(SAMPLES)))
    finally:
        server.with_routes = True
    assert ROUTES_KEY not in data.non_tensor_batch and "routed_experts" not in data.batch.keys()
    assert torch.equal(data.batch["input_ids"], rollout["data"].batch["input_ids"])


def test_a_loop_a_user_registered_under_verls_name_is_left_alone(
    rollout: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from verl.experimental.agent_loop import agent_loop

    from routereplay.integrations.verl.checked_loops import register_checked_agent_loops

    monkeypatch.setitem(agent_loop._agent_loop_registry, "tool_agent", {"_target_": "my_project.loops.MyToolLoop"})
    with caplog.at_level(logging.WARNING, logger="routereplay.integrations.verl"):
        targets = register_checked_agent_loops()
    assert targets["tool_agent"] == "my_project.loops.MyToolLoop"
    assert targets["single_turn_agent"].endswith("RouteCheckedSingleTurnAgentLoop")
    assert "'tool_agent' is registered to my_project.loops.MyToolLoop" in caplog.text
    assert "RouteCheckedAgentLoop" in caplog.text, "the warning names the fix"
