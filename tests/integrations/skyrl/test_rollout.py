"""`routereplay.integrations.skyrl` rollout side without SkyRL: every route form SkyRL 0.4.0 produces, multi-turn
calls with `routed_experts_prompt_start`, tool gaps, resumes, SkyRL #1912, and bad envelopes.

The envelopes are built here the way SkyRL's `generate_wire.pack_routed_experts` documents them (`{data: base64
of the C-order bytes, shape: [T, A, K], dtype}`, dtype the narrowest of uint8 / int16 / int32 for the call's
largest id); tests/integrations/skyrl/test_rollout_skyrl.py checks them against SkyRL's own functions.
Legend: N tokens, T rows of one call, A = all hidden layers, M = MoE layers, K = top-k.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from routereplay.codec import decode
from routereplay.errors import (
    ConfigError,
    DtypeError,
    DuplicatedPrefixError,
    ExpertIdRangeError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadLimitError,
    PayloadSizeError,
    RowCountError,
    TraceShapeError,
)
from routereplay.integrations.skyrl import RolloutRoutes, RouteGeometry, decode_skyrl, generator_routes
from routereplay.integrations.skyrl.rollout import route_dtype
from routereplay.wire.payload import npy_bytes

GEOMETRY = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))


def routes(rows: int, seed: int = 0, *, num_experts: int = 16, low: int = 0) -> np.ndarray:
    """int32 (T, A=3, K=2) all-layer routes: dense layer 0 zero-filled, distinct ids in [low, E) per row, each row
    sorted (routes are sets: a set store reads rows back sorted, so sorted rows compare as sets)."""
    rng = np.random.default_rng(seed)
    out_TAK = np.zeros((rows, 3, 2), dtype=np.int32)
    for layer in (1, 2):
        out_TAK[:, layer] = np.sort(low + np.argsort(rng.random((rows, num_experts - low)), axis=1)[:, :2], axis=1)
    return out_TAK


def compact(routes_TAK: np.ndarray) -> np.ndarray:
    """SkyRL's per-call compaction: the narrowest of its dtypes that holds this call's largest id."""
    top = int(routes_TAK.max(initial=0))
    return routes_TAK.astype(np.uint8 if top < 1 << 8 else np.int16 if top < 1 << 15 else np.int32)


def envelope(routes_TAK: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(compact(routes_TAK))
    return {"data": base64.b64encode(array.tobytes()).decode(), "shape": list(array.shape), "dtype": array.dtype.name}


def response(routes_TAK: np.ndarray, output_ids: list[int]) -> dict[str, Any]:
    """A `/skyrl/v1/generate` response body, parsed."""
    choice = {"token_ids": output_ids, "finish_reason": "stop", "logprobs": None, "rollout_sample_support": None}
    return {"choices": [{**choice, "routed_experts": envelope(routes_TAK)}]}


def test_every_skyrl_form_decodes_to_the_same_trace() -> None:
    routes_TAK = routes(7)  # prompt 5 + 3 generated - 1
    kwargs: dict[str, Any] = {"num_experts": 16, "moe_layers": (1, 2), "num_layers": 3, "top_k": 2, "num_tokens": 8}
    forms = {
        "response": response(routes_TAK, [9, 9, 9]),
        "choice": response(routes_TAK, [9, 9, 9])["choices"][0],
        "envelope": envelope(routes_TAK),
        "in-process array": compact(routes_TAK),
        "InferenceEngineOutput": {"responses": ["x"], "rollout_expert_indices": [compact(routes_TAK)]},
        "vLLM base64 .npy": base64.b64encode(npy_bytes(routes_TAK.astype(np.uint8))).decode(),
        "vLLM nested lists": routes_TAK.tolist(),
    }
    for name, form in forms.items():
        trace = decode_skyrl(form, **kwargs)
        assert trace.layers == (1, 2), name
        np.testing.assert_array_equal(trace.experts, routes_TAK[:, 1:], err_msg=name)


def test_multi_turn_prompt_start_merges_every_turn_and_observation_rows() -> None:
    """Turn 2's call sends prompt_start = the rows kept so far: its prefill routes turn 1's last token and the
    observation, so the merged trace has no gap, and SkyRL's generator form is the whole prefix."""
    rollout = RolloutRoutes(GEOMETRY)
    prompt, out1, obs, out2 = [1, 2, 3, 4, 5], [6, 7, 8], [20, 21], [9, 10, 11]
    assert rollout.prompt_start("a") == 0
    turn1_TAK = routes(len(prompt) + len(out1) - 1, seed=1)
    rollout.add_generation("a", prompt, out1, response(turn1_TAK, out1), prompt_start=0, policy_version=1)
    start = rollout.prompt_start("a")
    assert start == 7
    prompt2 = prompt + out1 + obs
    turn2_TAK = routes(len(prompt2) + len(out2) - 1 - start, seed=2)
    rollout.add_generation("a", prompt2, out2, envelope(turn2_TAK), prompt_start=start, policy_version=1)
    trace = rollout.trace("a")
    np.testing.assert_array_equal(trace.experts, np.concatenate([turn1_TAK, turn2_TAK])[:, 1:])
    assert trace.token_ids is not None and trace.token_ids.tolist() == (prompt2 + out2)[:-1]
    (skyrl_form,) = rollout.generator_routes(["a"])
    assert skyrl_form.dtype == np.uint8 and skyrl_form.shape == (12, 3, 2)
    np.testing.assert_array_equal(skyrl_form[:, 1:], trace.experts)
    assert not skyrl_form[:, 0].any()  # the dense layer as vLLM reports it


def test_tool_gap_stays_minus_one_and_never_becomes_expert_zero() -> None:
    """A call that skips re-routing the tool tokens (prompt_start at the end of the prompt) leaves them -1; the
    final observation is -1 too. The compact column keeps both; SkyRL's form cannot hold the inner gap."""
    rollout = RolloutRoutes(GEOMETRY)
    prompt, out1, tool, out2, final_obs = [1, 2, 3], [4, 5], [30, 31, 32], [6, 7], [40, 41]
    rollout.add_generation("t", prompt, out1, routes(4, seed=3), prompt_start=0)
    prompt2 = prompt + out1 + tool
    rollout.add_generation("t", prompt2, out2, routes(len(prompt2) + 1 - len(prompt2), seed=4), prompt_start=8)
    rollout.add_tokens("t", prompt2 + out2 + final_obs)
    trace = rollout.trace("t")
    unrouted_T = (trace.experts < 0).all(axis=(1, 2))
    assert np.flatnonzero(unrouted_T).tolist() == [4, 5, 6, 7, 9, 10]  # out1's last, tool, out2's last, obs
    assert (trace.experts[~unrouted_T] >= 0).all()
    (blob,) = rollout.compact_column(["t"])
    np.testing.assert_array_equal(decode(blob).experts, trace.experts)
    with pytest.raises(MissingRoutesError, match=r"token 4 has no route but later tokens have.*compact column"):
        rollout.generator_routes(["t"])


def test_final_observation_tail_is_cut_from_skyrls_form() -> None:
    rollout = RolloutRoutes(GEOMETRY)
    rollout.add_generation("f", [1, 2, 3], [4, 5], routes(4, seed=5), prompt_start=0)
    rollout.add_tokens("f", [1, 2, 3, 4, 5, 50, 51, 52])
    assert rollout.trace("f").num_tokens == 7 and rollout.prompt_start("f") == 4
    (skyrl_form,) = generator_routes(rollout.traces(["f"]), GEOMETRY)
    assert skyrl_form.shape == (4, 3, 2)  # SkyRL's captured prefix; its collate adds the dummy tail


def test_skyrl_1912_ids_past_255_in_a_later_turn_keep_their_value() -> None:
    """SkyRL #1912: per-turn compaction gives turn 1 (ids < 256) uint8; a later turn with ids >= 256 cast into
    that dtype would wrap. Here each call decodes to signed ids, the store merges by position, and SkyRL's form
    takes one dtype from E (int16 for 300 experts)."""
    geometry = RouteGeometry(num_experts=300, num_layers=3, top_k=2, moe_layers=(1, 2))
    rollout = RolloutRoutes(geometry)
    prompt, out1, out2 = [1, 2, 3, 4], [5, 6], [7, 8, 9]
    turn1_TAK = routes(5, seed=6, num_experts=250)
    turn2_TAK = routes(len(prompt + out1) + len(out2) - 1 - 5, seed=7, num_experts=300, low=256)
    first, second = envelope(turn1_TAK), envelope(turn2_TAK)
    assert (first["dtype"], second["dtype"]) == ("uint8", "int16")
    rollout.add_generation("s", prompt, out1, first, prompt_start=0)
    rollout.add_generation("s", prompt + out1, out2, second, prompt_start=5)
    expected_TMK = np.concatenate([turn1_TAK, turn2_TAK])[:, 1:]
    locked_TAK = np.concatenate([compact(turn1_TAK), compact(turn2_TAK).astype(np.uint8)])
    assert not np.array_equal(locked_TAK[:, 1:], expected_TMK)  # the locked dtype loses the ids >= 256
    np.testing.assert_array_equal(rollout.trace("s").experts, np.sort(expected_TMK, axis=-1))
    (skyrl_form,) = rollout.generator_routes(["s"])
    assert skyrl_form.dtype == np.int16 == route_dtype(300) and int(skyrl_form.max()) >= 256
    np.testing.assert_array_equal(np.sort(skyrl_form[:, 1:], axis=-1), np.sort(expected_TMK, axis=-1))
    (blob,) = rollout.compact_column(["s"])
    np.testing.assert_array_equal(decode(blob).experts, rollout.trace("s").experts)


def test_partial_resume_keeps_the_rows_used_at_sampling_with_provenance() -> None:
    """A resumed call after a weight update re-sends the whole sequence (prompt_start 0): rows already held stay
    (policy "keep"), the new tail comes from the resume, and the segments name both policy versions."""
    rollout = RolloutRoutes(GEOMETRY)
    prompt, out1, out2 = [1, 2, 3], [4, 5, 6], [7, 8]
    first_TAK = routes(5, seed=8)
    rollout.add_generation("r", prompt, out1, first_TAK, prompt_start=0, policy_version=3)
    resumed_TAK = routes(7, seed=9)
    rollout.add_generation("r", prompt + out1, out2, envelope(resumed_TAK), prompt_start=0, policy_version=4)
    trace = rollout.trace("r")
    np.testing.assert_array_equal(trace.experts[:5], np.sort(first_TAK[:, 1:], axis=-1))
    np.testing.assert_array_equal(trace.experts[5:], np.sort(resumed_TAK[5:, 1:], axis=-1))
    assert [(s.begin, s.end, s.policy_version) for s in trace.segments] == [(0, 5, 3), (5, 7, 4)]


def test_calls_that_do_not_fit_their_tokens_are_refused_by_name() -> None:
    rollout = RolloutRoutes(GEOMETRY)
    rollout.add_generation("x", [1, 2, 3], [4, 5], routes(4), prompt_start=0)
    with pytest.raises(RowCountError):  # a shifted call: prompt_start one past what the rows cover
        rollout.add_generation("x", [1, 2, 3, 4, 5], [6], routes(5), prompt_start=1)
    twice_TAK = routes(4, seed=10)
    with pytest.raises(DuplicatedPrefixError):  # the first rows sent twice (verl #6029's resume bug)
        rollout.add_generation("w", [1, 2, 3], [4, 5], np.concatenate([twice_TAK[:2], twice_TAK]), prompt_start=0)
    with pytest.raises(ExpertIdRangeError):  # ids >= E
        rollout.add_generation("y", [1, 2], [3], envelope(routes(2, num_experts=40, low=20)), prompt_start=0)
    with pytest.raises(Exception, match="vLLM only"):
        rollout.add_call("z", [1, 2], routes(1), engine="sglang")


def test_bad_envelopes_are_refused_before_decoding() -> None:
    kwargs: dict[str, Any] = {"num_experts": 16, "moe_layers": (1, 2), "num_layers": 3, "top_k": 2}
    good = envelope(routes(4))
    with pytest.raises(DtypeError, match="'float32' is not one SkyRL writes"):
        decode_skyrl({**good, "dtype": "float32"}, **kwargs)
    with pytest.raises(DtypeError, match="'uint16' is not one SkyRL writes"):
        decode_skyrl({**good, "dtype": "uint16"}, **kwargs)
    with pytest.raises(TraceShapeError, match="declares 2 dimensions"):
        decode_skyrl({**good, "shape": [4, 6]}, **kwargs)
    with pytest.raises(TraceShapeError, match="non-negative ints"):
        decode_skyrl({**good, "shape": [4, -3, 2]}, **kwargs)
    with pytest.raises(PayloadSizeError, match=r"32 base64 characters, .*needs 48 \(36 bytes\)"):
        decode_skyrl({**good, "shape": [6, 3, 2]}, **kwargs)
    with pytest.raises(PayloadSizeError, match="above max_bytes"):  # a forged shape: refused before decoding
        decode_skyrl({**good, "shape": [1 << 22, 1000, 8]}, max_bytes=1 << 20, **kwargs)
    with pytest.raises(PayloadLimitError, match="max_rows"):
        decode_skyrl({**good, "shape": [1 << 30, 3, 2]}, **kwargs)
    with pytest.raises(PayloadEncodingError, match="base64"):
        decode_skyrl({**good, "data": "!" * len(good["data"])}, **kwargs)
    with pytest.raises(MissingRoutesError):
        decode_skyrl({"choices": [{"token_ids": [1], "routed_experts": None}]}, **kwargs)
    spliced = {**good, "data": memoryview(good["data"].encode())}  # SkyRL's load_packed_body gives a view
    np.testing.assert_array_equal(decode_skyrl(spliced, **kwargs).experts, routes(4)[:, 1:])
    with pytest.raises(PayloadSizeError, match="holds 31 base64 characters"):
        decode_skyrl({**good, "data": memoryview(good["data"].encode())[:-1]}, **kwargs)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([1.7, 2, 3], r"prompt_token_ids\[0\] = '1.7' \(float\) is not a token id"),
        (["1", "2", "3"], r"prompt_token_ids\[0\] = '1' \(str\) is not a token id"),
        ([5, True, 3], r"prompt_token_ids\[1\] = 'True' \(bool\) is not a token id"),
        ([5, None, 3], r"prompt_token_ids\[1\] = 'None' \(NoneType\) is not a token id"),
        (None, "prompt_token_ids is a NoneType; pass the call's token ids as a list of ints"),
        ("abc", "prompt_token_ids is a str"),
        ([2**70, 1, 2], r"prompt_token_ids\[0\] = 1180591620717411303424 is outside the token ids' range"),
        ([-1, 1, 2], r"prompt_token_ids\[0\] = -1 is outside the token ids' range"),
        (np.array([1.0, 2.0, 3.0]), "prompt_token_ids is a float64 array"),
        (np.array([True, False, True]), "prompt_token_ids is a bool array"),
        (np.array([[1, 2, 3]]), r"prompt_token_ids is a int64 array of shape \(1, 3\)"),
    ],
    ids=["float", "str", "bool", "None-inside", "None", "str-whole", "2**70", "negative", "float-array",
         "bool-array", "2-D"],
)  # fmt: skip
def test_add_generation_refuses_token_ids_that_are_not_ints_before_any_cast(prompt: Any, match: str) -> None:
    """Item 9: token ids were cast to int64 first (1.7 -> 1, '1' -> 1, True -> 1; None / 'abc' / 2**70 raised
    numpy's errors). Each is a ConfigError naming the sample, the argument and the position; nothing is stored."""
    rollout = RolloutRoutes(GEOMETRY)
    with pytest.raises(ConfigError, match=f"sample 's': {match}"):
        rollout.add_generation("s", prompt, [4, 5], routes(4), prompt_start=0)
    with pytest.raises(ConfigError, match=f"sample 's': {match.replace('prompt_token_ids', 'output_ids')}"):
        rollout.add_generation("s", [1, 2, 3], prompt, routes(4), prompt_start=0)
    assert "s" not in rollout.store


def test_add_call_and_add_tokens_check_token_ids_as_given() -> None:
    rollout = RolloutRoutes(GEOMETRY)
    with pytest.raises(ConfigError, match=r"sample 's': token_ids\[2\] = 'True' \(bool\)"):
        rollout.add_call("s", [1, 2, True, 4, 5], routes(4))
    rollout.add_generation("s", [1, 2, 3], [4, 5], routes(4), prompt_start=0)
    with pytest.raises(ConfigError, match=r"sample 's': token_ids\[5\] = '6.0' \(float\)"):
        rollout.add_tokens("s", [1, 2, 3, 4, 5, 6.0])  # type: ignore[list-item]
    assert rollout.tokens("s") == [1, 2, 3, 4, 5]
