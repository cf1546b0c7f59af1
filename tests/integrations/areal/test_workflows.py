"""routereplay's AReaL workflows on AReaL 1.0.4's own engine, workflows and packing, against an SGLang-speaking server.

The server (`sglang_case.py`) generates with a tiny Qwen3-MoE and returns the routes a probe on its routers
records; the truth for an episode is, per position, the routing of the first pass that fed that token, by that
pass's weights version (`first_routing`). Routes are compared as sets (sorted rows).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from typing import Any

import numpy as np
import pytest
import torch
from areal.api import ModelRequest
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.engine.sglang_remote import SGLangBackend
from areal.engine.vllm_remote import RemotevLLMEngine
from areal.utils.data import concat_padded_tensors, pack_tensor_dict

from routereplay.errors import ConfigError, DuplicatedPrefixError, MissingRoutesError
from routereplay.integrations.areal import ROUTES_KEY, TOKENS_KEY, EpisodeRoutes, check_columns
from routereplay.integrations.areal.backend import RoutedSGLangBackend
from routereplay.integrations.areal.workflows import REFUSED_METRIC, RoutedMultiTurnWorkflow, RoutedRLVRWorkflow
from routereplay.integrations.verl import RouteGeometry
from routereplay.testing.vllm_models import word_tokenizer
from tests.integrations.areal.sglang_case import (
    SGLangServer,
    areal_engine,
    chat,
    first_routing,
    tiny_versions,
    unit_reward,
    zero_reward,
)

MAX_NEW = 6


@pytest.fixture(scope="module")
def versions() -> list[Any]:
    return tiny_versions(3)


@pytest.fixture(scope="module")
def geometry(versions: list[Any]) -> RouteGeometry:
    return RouteGeometry.from_hf_config(versions[0].config)


def gconfig() -> GenerationHyperparameters:
    return GenerationHyperparameters(max_new_tokens=MAX_NEW, greedy=True)


def rlvr(geometry: RouteGeometry) -> RoutedRLVRWorkflow:
    return RoutedRLVRWorkflow(
        reward_fn=unit_reward, gconfig=gconfig(), tokenizer=word_tokenizer(), route_geometry=geometry
    )


def as_sets(rows: Any) -> np.ndarray:
    return np.sort(np.asarray(rows, dtype=np.int64), axis=-1)


def assert_truth(episode: dict[str, Any], server: SGLangServer, geometry: RouteGeometry, index: int = 0) -> None:
    """The episode's columns (row `index` of a batch) are the model's own first routing of its tokens, -1 where
    no pass fed the token, and the token column is input_ids exactly where a row is routed."""
    length = int(episode["attention_mask"][index].sum())
    tokens = episode["input_ids"][index, :length].tolist()
    truth_SMK = first_routing(server.calls, server.versions, tokens)[:, list(geometry.moe_layers)]
    routes_SMK = episode[ROUTES_KEY][index, :length].numpy()
    np.testing.assert_array_equal(as_sets(routes_SMK), as_sets(truth_SMK))
    routed_S = truth_SMK[:, 0, 0] >= 0
    expected_S = np.where(routed_S, tokens, -1)
    np.testing.assert_array_equal(episode[TOKENS_KEY][index, :length].numpy(), expected_S)


def test_rlvr_episode_carries_the_models_own_routing(versions: list[Any], geometry: RouteGeometry) -> None:
    with SGLangServer(versions) as server, areal_engine(server) as engine:
        episode = asyncio.run(rlvr(geometry).arun_episode(engine, chat("w10 w11 w12 w13")))
    assert episode[ROUTES_KEY].shape == (1, episode["input_ids"].shape[1], 2, 2)
    assert episode[ROUTES_KEY].dtype == torch.int16 and episode[TOKENS_KEY].dtype == torch.int32
    assert len(server.calls) == 1
    assert_truth(episode, server, geometry)
    assert (episode[ROUTES_KEY][0, -1] == -1).all()  # the last token was never fed back
    assert (episode[ROUTES_KEY][0, :-1] >= 0).all()


@pytest.mark.parametrize("honour_start", [True, False], ids=["server-honours-start-len", "server-ignores-it"])
def test_interrupted_request_keeps_each_row_once(
    versions: list[Any], geometry: RouteGeometry, honour_start: bool
) -> None:
    """Aborted after 3 tokens (a weight update: the server moves to version 1), resumed by AReaL's agenerate: the
    resumed pass is sent routed_experts_start_len = the rows held, and every position keeps the row of the pass
    that first routed it, whether or not the server honours the field."""
    with SGLangServer(versions, abort_after=3, honour_start=honour_start) as server, areal_engine(server) as engine:
        episode = asyncio.run(rlvr(geometry).arun_episode(engine, chat("w10 w11 w12 w13")))
    first, resumed = server.calls
    assert first.aborted and not resumed.aborted and (first.version, resumed.version) == (0, 1)
    assert resumed.start_len == len(first.tokens) - 1
    assert resumed.first_row == (resumed.start_len if honour_start else 0)
    assert episode["input_ids"].shape[1] == len(first.input_ids) + MAX_NEW
    assert_truth(episode, server, geometry)
    # the resumed pass's re-routed prefix differs (new routers): keeping it would have changed the rows
    prefix = len(first.tokens) - 1
    moe = list(geometry.moe_layers)
    reroute = first_routing(server.calls[1:], server.versions, list(resumed.tokens))[:prefix][:, moe]
    assert (as_sets(reroute) != as_sets(episode[ROUTES_KEY][0, :prefix].numpy())).any()


def test_areal_backend_duplicates_the_prefix_rows(versions: list[Any], geometry: RouteGeometry) -> None:
    """The defect routereplay's backend fixes: AReaL's own SGLangBackend, same server, same interruption: the
    resumed pass's rows of [0, seqlen - 1) are concatenated after the first pass's, so the prefix rows come twice
    and the response holds more rows than the sequence has positions. EpisodeRoutes refuses that response."""
    request = ModelRequest(input_ids=[10, 11, 12, 13, 4], gconfig=gconfig())
    with (
        SGLangServer(versions, abort_after=3) as server,
        areal_engine(server, return_routed_experts=True) as engine,
    ):
        assert type(engine._engine.backend) is SGLangBackend
        response = asyncio.run(engine.agenerate(request))
    first, resumed = server.calls
    assert resumed.start_len == 0  # AReaL never sends the field
    sequence = response.input_tokens + response.output_tokens
    rows_TA = response.routed_experts
    assert rows_TA.shape[0] == (len(first.tokens) - 1) + (len(sequence) - 1)  # prefix rows twice
    assert rows_TA.shape[0] > len(sequence) - 1
    with pytest.raises(DuplicatedPrefixError, match="too many"):
        EpisodeRoutes(geometry).add_response(response)


def test_multi_turn_minus_one_rows_exactly_where_no_pass_routed(versions: list[Any], geometry: RouteGeometry) -> None:
    """AReaL's MultiTurnWorkflow, three turns (reward 0), weights updated after every request: each turn re-sends
    the whole history; every position keeps its first turn's row, and only the final token has none."""
    workflow = RoutedMultiTurnWorkflow(
        reward_fn=zero_reward,
        gconfig=gconfig(),
        tokenizer=word_tokenizer(),
        max_turns=3,
        turn_discount=0.9,
        route_geometry=geometry,
    )
    with SGLangServer(versions, update_after_request=True) as server, areal_engine(server) as engine:
        episode = asyncio.run(workflow.arun_episode(engine, chat("w20 w21 w22")))
    assert [served.version for served in server.calls] == [0, 1, 2]
    assert_truth(episode, server, geometry)
    unrouted = np.flatnonzero((episode[ROUTES_KEY][0] == -1).all(dim=(-2, -1)).numpy())
    assert unrouted.tolist() == [episode["input_ids"].shape[1] - 1]


def test_packed_episodes_keep_each_row_on_its_token(versions: list[Any], geometry: RouteGeometry) -> None:
    """Episodes of different lengths, rolled out concurrently by AReaL's own WorkflowExecutor (rollout_batch),
    padded by concat_padded_tensors and packed by pack_tensor_dict: each packed row still sits on its token."""
    prompts = ["w30 w31", "w40 w41 w42 w43 w44", "w50 w51 w52 w53 w54 w55 w56 w57"]
    workflow, count = rlvr(geometry), len(prompts)
    with (
        SGLangServer(versions, abort_after=2) as server,
        areal_engine(server, consumer_batch_size=count, max_concurrent_rollouts=count) as engine,
    ):
        for prompt in prompts:
            engine.submit(chat(prompt), workflow=workflow)
        episodes = engine.wait(count, timeout=120)  # AReaL's rollout_batch, with a deadline
    assert len(episodes) == len(prompts)
    batch = concat_padded_tensors(episodes)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) == len(prompts)
    for index in range(len(prompts)):
        assert_truth(batch, server, geometry, index)
    check_columns(
        batch[ROUTES_KEY],
        batch[TOKENS_KEY],
        num_experts=geometry.num_experts,
        num_moe_layers=len(geometry.moe_layers),
        top_k=geometry.top_k,
        valid=batch["attention_mask"],
        input_ids=batch["input_ids"],
    )
    packed = pack_tensor_dict(batch)
    assert packed[ROUTES_KEY].shape == (sum(lengths), 2, 2) and packed[TOKENS_KEY].shape == (sum(lengths),)
    routed = check_columns(
        packed[ROUTES_KEY],
        packed[TOKENS_KEY],
        num_experts=geometry.num_experts,
        num_moe_layers=len(geometry.moe_layers),
        top_k=geometry.top_k,
        input_ids=packed["input_ids"],
    )
    assert routed == sum(lengths) - len(prompts)  # every position but each episode's last token
    cu = packed["cu_seqlens"].tolist()
    for index in range(len(prompts)):
        np.testing.assert_array_equal(
            packed[ROUTES_KEY][cu[index] : cu[index + 1]], batch[ROUTES_KEY][index, : lengths[index]]
        )


class NoRoutesServer(SGLangServer):
    """A server that does not return routes although asked (no --enable-return-routed-experts): the field is
    missing, or JSON null."""

    def __init__(self, versions: list[Any], *, null: bool, **kwargs: Any) -> None:
        super().__init__(versions, **kwargs)
        self.null = null

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = super()._generate(body)
        reply["meta_info"].pop("routed_experts", None)
        if self.null:
            reply["meta_info"]["routed_experts"] = None
        return reply


@pytest.mark.parametrize("null", [False, True], ids=["field-missing", "field-null"])
def test_a_server_without_routes_is_a_missing_routes_error_before_areals_own_check(
    versions: list[Any], geometry: RouteGeometry, null: bool
) -> None:
    """AReaL's agenerate raises a bare RuntimeError ("not a MoE model") for a finished pass without routes;
    routereplay's backend names it first. The first pass is aborted (no routes expected), the resumed one is not."""
    with NoRoutesServer(versions, null=null, abort_after=2) as server, areal_engine(server) as engine:
        with pytest.raises(MissingRoutesError, match=r"request \S+, pass 2 .*--enable-return-routed-experts"):
            asyncio.run(rlvr(geometry).arun_episode(engine, chat("w10 w11 w12 w13")))
    assert [call.aborted for call in server.calls] == [True, False]


class ShortRowsServer(SGLangServer):
    """Drops the last route row of every pass whose prompt holds `bad_token`: a `RowCountError` for that episode."""

    def __init__(self, versions: list[Any], *, bad_token: int, row_width: int) -> None:
        super().__init__(versions)
        self.bad_token, self.row_width = bad_token, row_width

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = super()._generate(body)
        meta = reply["meta_info"]
        if self.bad_token in body["input_ids"] and meta.get("routed_experts"):
            rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            meta["routed_experts"] = base64.b64encode(rows[: -self.row_width].tobytes()).decode()
        return reply


def test_areals_executor_drops_a_refused_episode_logs_it_and_the_refusal_rate_shows(
    versions: list[Any], geometry: RouteGeometry
) -> None:
    """AReaL's WorkflowExecutor (submit / wait, what rollout_batch uses) catches the workflow's routereplay error,
    logs it and drops the episode; `rollout/router_replay/refused_rate` in AReaL's rollout stats shows it."""
    from areal.utils import stats_tracker

    tokenizer = word_tokenizer()
    bad_token = tokenizer("w12")["input_ids"][-1]
    stats_tracker.get("rollout").export()  # a clean step
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    with (
        ShortRowsServer(versions, bad_token=bad_token, row_width=geometry.num_layers * geometry.top_k) as server,
        areal_engine(server, consumer_batch_size=2, max_concurrent_rollouts=2) as engine,
    ):
        executor_logger = engine._engine.workflow_executor.logger
        executor_logger.addHandler(handler)
        try:
            workflow = rlvr(geometry)
            for prompt in ("w10 w11", "w12 w13"):
                engine.submit(chat(prompt), workflow=workflow)
            results = engine.wait(2, timeout=120)
        finally:
            executor_logger.removeHandler(handler)
    kept = [episode for episode in results if episode is not None]
    assert len(kept) == 1 and bad_token not in kept[0]["input_ids"][0].tolist()
    assert "Workflow execution failed" in logged.getvalue() and "RowCountError" in logged.getvalue()
    exported = stats_tracker.get("rollout").export()
    assert exported["rollout/" + REFUSED_METRIC] == 0.5  # one of the step's two routed episodes refused


def test_vllm_engine_is_refused_by_name(geometry: RouteGeometry) -> None:
    engine = RemotevLLMEngine(InferenceEngineConfig(backend="vllm:d1"))
    with pytest.raises(ConfigError, match="SGLang only"):
        asyncio.run(rlvr(geometry).arun_episode(engine, chat("w10 w11")))


def test_workflow_installs_routereplays_backend_once(versions: list[Any], geometry: RouteGeometry) -> None:
    with SGLangServer(versions) as server, areal_engine(server) as engine:
        workflow = rlvr(geometry)
        asyncio.run(workflow.arun_episode(engine, chat("w10 w11")))
        backend = engine._engine.backend
        asyncio.run(workflow.arun_episode(engine, chat("w12 w13")))
        assert isinstance(backend, RoutedSGLangBackend) and engine._engine.backend is backend


def test_the_documented_string_form_resolves_through_areals_engine(versions: list[Any], tmp_path: Any) -> None:
    """docs/areal.md's way to turn it on: the workflow as an import string and `route_geometry` as the model's
    path in `workflow_kwargs`, resolved and built by AReaL's own engine (`_resolve_workflow`), as AReaL's
    trainer hands them to its rollout workers."""
    versions[0].config.save_pretrained(tmp_path)  # the model folder's config.json, as `config.actor.path` names it
    geometry = RouteGeometry.from_hf_config(versions[0].config)
    kwargs = dict(reward_fn=unit_reward, gconfig=gconfig(), tokenizer=word_tokenizer(), route_geometry=str(tmp_path))
    with SGLangServer(versions) as server, areal_engine(server) as engine:
        engine.submit(
            chat("w60 w61 w62"),
            workflow="routereplay.integrations.areal.workflows.RoutedRLVRWorkflow",
            workflow_kwargs=kwargs,
        )
        (episode,) = engine.wait(1, timeout=120)
    assert_truth(episode, server, geometry)
