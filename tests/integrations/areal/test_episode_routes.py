"""`EpisodeRoutes`: an episode's agenerate responses merged by token position (KEEP, -1 rows, token checks).

Responses are AReaL's own `ModelResponse`, their rows (every hidden layer, dense layer 0 zero) from a seeded
generator so that every call's rows differ. Legend: N tokens of a call, A every hidden layer, M MoE layers, K top-k.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from areal.api import ModelResponse

from routereplay.errors import ConfigError, DuplicatedPrefixError, MissingRoutesError, TokenMismatchError
from routereplay.integrations.areal import ROUTES_KEY, TOKENS_KEY, EpisodeRoutes, route_geometry
from routereplay.integrations.areal.episode_routes import single_version
from routereplay.integrations.verl import RouteGeometry
from tests.integrations.areal.test_backend import GEOMETRY, rows

MOE = list(GEOMETRY.moe_layers)


def call(inputs: list[int], outputs: list[int], seed: int, *, versions: list[int] | None = None) -> ModelResponse:
    rows_TAK = rows(len(inputs) + len(outputs) - 1, seed)
    return ModelResponse(
        input_tokens=inputs,
        output_tokens=outputs,
        output_versions=versions if versions is not None else [0] * len(outputs),
        routed_experts=rows_TAK.reshape(len(rows_TAK), -1),
    )


def sets(rows_TMK: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(rows_TMK, dtype=np.int64), axis=-1)


def test_turns_keep_the_first_calls_row_and_minus_one_where_no_call_routed() -> None:
    routes = EpisodeRoutes(GEOMETRY)
    one = call([10, 11, 12], [20, 21], seed=1)
    routes.add_response(one)
    history = [10, 11, 12, 20, 21, 2, 30]  # MultiTurnWorkflow: output, EOS, retry prompt
    two = call(history, [40, 41], seed=2)
    routes.add_response(two)
    tail = [50, 51]  # tokens after the last call (a tool answer the episode ends on): no call routed them
    final = [*history, 40, 41, *tail]
    columns = routes.columns(final)
    routes_SMK, tokens_S = columns[ROUTES_KEY][0].numpy(), columns[TOKENS_KEY][0].numpy()
    first_TAK = one.routed_experts.reshape(-1, 3, 2)
    second_TAK = two.routed_experts.reshape(-1, 3, 2)
    np.testing.assert_array_equal(sets(routes_SMK[:4]), sets(first_TAK[:, MOE]))  # KEEP: the first call's rows
    assert (sets(second_TAK[:4, MOE]) != sets(first_TAK[:, MOE])).any()  # (the second call's differ there)
    np.testing.assert_array_equal(sets(routes_SMK[4:8]), sets(second_TAK[4:, MOE]))
    unrouted = [8, 9, 10]  # the last call's last token, then the tail
    assert (routes_SMK[unrouted] == -1).all() and (routes_SMK[:8] >= 0).all()
    np.testing.assert_array_equal(tokens_S, [*final[:8], -1, -1, -1])


def test_a_call_that_rewrites_a_routed_position_is_refused() -> None:
    routes = EpisodeRoutes(GEOMETRY)
    routes.add_response(call([10, 11, 12], [20, 21], seed=1))
    with pytest.raises(TokenMismatchError, match="position 1 where an earlier call saw token 11"):
        routes.add_response(call([10, 99, 12, 20, 21], [22], seed=2))


def test_a_changed_unrouted_last_token_keeps_the_rows_before_it() -> None:
    routes = EpisodeRoutes(GEOMETRY)
    one = call([10, 11, 12], [20, 21], seed=1)
    routes.add_response(one)
    routes.add_response(call([10, 11, 12, 20, 2], [22], seed=2))  # 21 (never fed back) replaced by EOS
    columns = routes.columns([10, 11, 12, 20, 2, 22])
    np.testing.assert_array_equal(
        sets(columns[ROUTES_KEY][0, :4].numpy()), sets(one.routed_experts.reshape(-1, 3, 2)[:, MOE])
    )


def test_returned_sequence_that_differs_at_a_routed_position_is_refused() -> None:
    routes = EpisodeRoutes(GEOMETRY)
    routes.add_response(call([10, 11, 12], [20, 21], seed=1))
    with pytest.raises(TokenMismatchError, match="position 3"):
        routes.columns([10, 11, 12, 77, 21])


def test_a_response_without_routes_is_named() -> None:
    response = ModelResponse(input_tokens=[10, 11], output_tokens=[20], routed_experts=None)
    with pytest.raises(MissingRoutesError, match="--enable-return-routed-experts"):
        EpisodeRoutes(GEOMETRY).add_response(response)


def test_a_duplicated_prefix_is_refused_not_shifted() -> None:
    """AReaL's own backend after a resume: the first pass's rows, then the resumed pass's [0, seqlen - 1)."""
    first_TA = rows(4, seed=1).reshape(4, -1)
    second_TA = rows(6, seed=2).reshape(6, -1)
    response = ModelResponse(
        input_tokens=[10, 11, 12],
        output_tokens=[20, 21, 22, 23],
        routed_experts=np.concatenate([first_TA, second_TA]),
    )
    with pytest.raises(DuplicatedPrefixError, match="4 too many"):
        EpisodeRoutes(GEOMETRY).add_response(response)


def test_a_call_names_its_policy_version_only_when_it_has_one() -> None:
    assert single_version([3, 3, 3]) == 3
    assert single_version([3, 4]) is None  # resumed across a weight update
    assert single_version([]) is None and single_version([-1]) is None


def test_route_geometry_from_a_model_folder_a_config_or_itself(tmp_path: Path) -> None:
    from routereplay.testing.vllm_models import tiny_vllm_config

    config = tiny_vllm_config("qwen3_moe_dense_first")
    config.save_pretrained(tmp_path)
    expected = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))
    assert route_geometry(str(tmp_path)) == route_geometry(config) == route_geometry(expected) == expected
    with pytest.raises(ConfigError, match="no HF config"):
        route_geometry(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="RouteGeometry, an HF config or a model path"):
        route_geometry(42)
