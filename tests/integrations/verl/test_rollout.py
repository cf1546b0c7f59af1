"""`routereplay.integrations.verl` without verl: decoding every engine form, merging calls, verl's layout.

These need neither verl nor a model (synthetic all-layer payloads), so they run in the main suite too.
Legend: N tokens, T = N - 1 rows, A = all hidden layers, L = MoE layers, K = top-k, B samples, S = P + R.
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from routereplay.errors import ConfigError, RowCountError, TraceShapeError
from routereplay.integrations.verl import (
    ROUTES_KEY,
    VERL_ROUTES_KEY,
    RolloutRoutes,
    RouteGeometry,
    compact_routes,
    padded_routes,
    put_routes,
    routes_for_batch,
    traces_of,
)
from routereplay.trace import RouteTrace

GEOMETRY = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))


def payload(rows: int, seed: int = 0) -> np.ndarray:
    """vLLM >= 0.22's in-process routes: uint8 (T, A, K), dense layer 0 zero-filled, distinct ids per row."""
    rng = np.random.default_rng(seed)
    out_TAK = np.zeros((rows, 3, 2), dtype=np.uint8)
    for layer in (1, 2):
        out_TAK[:, layer] = np.argsort(rng.random((rows, 16)), axis=1)[:, :2]
    return out_TAK


def b64_npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def test_geometry_from_config_keeps_moe_layers_by_global_number() -> None:
    config = SimpleNamespace(num_hidden_layers=4, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1)
    assert RouteGeometry.from_hf_config(config) == RouteGeometry(
        num_experts=64, num_layers=4, top_k=6, moe_layers=(1, 2, 3)
    )
    with pytest.raises(ConfigError, match="not an MoE config"):
        RouteGeometry.from_hf_config(SimpleNamespace(num_hidden_layers=4))
    with pytest.raises(ConfigError, match=r"moe_layers=\[2, 1\] must be distinct, ascending"):
        RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(2, 1))
    with pytest.raises(ConfigError, match="top_k=20 exceeds num_experts=16"):
        RouteGeometry(num_experts=16, num_layers=3, top_k=20, moe_layers=(1, 2))


def test_every_engine_form_decodes_to_the_same_moe_trace_with_token_ids() -> None:
    tokens = list(range(10, 19))
    routes_TAK = payload(len(tokens) - 1)
    routes = RolloutRoutes(GEOMETRY)
    in_process = routes.decode(routes_TAK, tokens)
    http = routes.decode({"choices": [{"routed_experts": b64_npy(routes_TAK)}]}, tokens)
    raw = base64.b64encode(routes_TAK.astype(np.int32).tobytes()).decode()
    sglang = routes.decode({"meta_info": {"routed_experts": raw}}, tokens, engine="sglang")
    assert in_process.layers == (1, 2) and in_process.experts.dtype.kind == "i"
    assert np.array_equal(in_process.experts, routes_TAK[:, 1:].astype(np.int16))
    assert np.array_equal(in_process.token_ids, tokens[:-1])
    assert np.array_equal(http.experts, in_process.experts) and np.array_equal(sglang.experts, in_process.experts)
    with pytest.raises(ConfigError, match="engine='trtllm' is not one verl serves"):
        routes.decode(routes_TAK, tokens, engine="trtllm")
    with pytest.raises(RowCountError):
        routes.decode(routes_TAK[:-1], tokens)  # one row short: not the call's tokens


def test_turns_tool_tokens_and_prompt_start_merge_by_position() -> None:
    """Turn 2 reports rows from its prompt_start only (a cached prefix); the tool tokens between the turns and
    after the last one stay -1, under a 'none' segment."""
    routes = RolloutRoutes(GEOMETRY)
    turn1, tool, turn2, tail = list(range(10, 16)), [900, 901], [20, 21, 22], [902]
    first = payload(len(turn1) - 1, seed=1)
    routes.add_call("s", turn1, first, policy_version=3)
    routes.add_tokens("s", turn1 + tool)
    tokens = turn1 + tool + turn2
    start = len(turn1) + len(tool)  # the engine reports rows from here on
    second = payload(len(tokens) - 1 - start, seed=2)
    routes.add_call("s", tokens, second, start=start, policy_version=3)
    routes.add_tokens("s", tokens + tail)
    trace = routes.trace("s")
    assert trace.num_tokens == len(tokens + tail) - 1
    routed = trace.routed_mask.all(axis=1)
    assert routed.tolist() == [True] * 5 + [False] * 3 + [True] * 2 + [False]
    assert [s.describe() for s in trace.segments] == ["vllm@v3[0:5]", "none[5:8]", "vllm@v3[8:10]", "none[10:11]"]


def test_padded_routes_follow_verls_layout_with_minus_one() -> None:
    """Prompt left-padded to P, response right-padded to R; rows the engine never routed are -1, not 0."""
    trace = RouteTrace(np.array([[[1, 2], [3, 4]]] * 5, dtype=np.int16), 16, layers=(1, 2))
    out = padded_routes(trace, prompt_len=3, response_len=3, prompt_length=5, response_length=4)
    assert out.shape == (1, 9, 2, 2) and out.dtype == torch.int16
    routed = (out[0, :, 0, 0] >= 0).tolist()
    assert routed == [False, False, True, True, True, True, True, False, False]  # last token (pos 5) has no row
    all_layers = padded_routes(
        trace, prompt_len=3, response_len=3, prompt_length=5, response_length=4, num_hidden_layers=3
    )
    assert (all_layers[0, :, 0] == -1).all() and torch.equal(all_layers[0, :, 1:], out[0])
    with pytest.raises(TraceShapeError, match="6 prompt and 3 response tokens do not fit verl's prompt_length=5"):
        padded_routes(trace, prompt_len=6, response_len=3, prompt_length=5, response_length=4)
    wide = RouteTrace(np.zeros((1, 1, 1), dtype=np.int32) + 40000, 40001)
    with pytest.raises(ConfigError, match="do not fit verl's int16 routed_experts"):
        padded_routes(wide, prompt_len=1, response_len=1, prompt_length=1, response_length=1)


class Batch:
    """The two dicts of a verl `DataProto` and its length (enough for `put_routes` / `routes_for_batch`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.batch = tensors
        self.non_tensor_batch: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.batch["input_ids"])


def test_put_routes_compact_and_dense_give_the_same_routes() -> None:
    traces = [RouteTrace(payload(4, seed=b)[:, 1:], 16, layers=(1, 2), token_ids=[7, 8, 9, 10]) for b in range(2)]
    input_ids = torch.tensor([[0, 7, 8, 9, 10, 11, 0], [7, 8, 9, 10, 11, 12, 0]])
    mask = (input_ids > 0).long()
    batch = Batch({"input_ids": input_ids, "attention_mask": mask, "prompts": input_ids[:, :3]})
    put_routes(batch, traces)
    assert isinstance(batch.non_tensor_batch[ROUTES_KEY][0], bytes)
    compact = routes_for_batch(batch)
    put_routes(batch, traces, form="dense")
    assert torch.equal(batch.batch[VERL_ROUTES_KEY].sort(-1).values, compact)  # compact: route sets (sorted)
    put_routes(batch, traces, mode="ordered")
    assert torch.equal(batch.batch[VERL_ROUTES_KEY], routes_for_batch(batch))  # ordered: the router's order too
    assert [t.experts.shape for t in traces_of(compact_routes(traces))] == [(4, 2, 2)] * 2
    with pytest.raises(ConfigError, match="form='sparse' is not a batch form"):
        put_routes(batch, traces, form="sparse")
    with pytest.raises(TraceShapeError, match="1 traces for a batch of 2 samples"):
        put_routes(batch, traces[:1])
    with pytest.raises(ConfigError, match="the batch has no 'routereplay_routes' column"):
        routes_for_batch(Batch(batch.batch))


def test_geometry_of_the_other_interleaved_families_and_bad_layer_lists() -> None:
    """Found by the issue 25 acceptance tester: Llama 4 (its own `moe_layers`), Jamba (expert period and offset)
    and ERNIE 4.5 (start index) were read as all-MoE, so a dense layer's zeros became routes to expert 0."""
    from transformers import JambaConfig, Llama4TextConfig

    llama4 = Llama4TextConfig(
        num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2
    )
    jamba = JambaConfig(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1
    )
    ernie = SimpleNamespace(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_layer_start_index=1)
    assert RouteGeometry.from_hf_config(llama4).moe_layers == (1, 3)
    assert RouteGeometry.from_hf_config(jamba).moe_layers == (1, 3)
    assert RouteGeometry.from_hf_config(ernie).moe_layers == (1, 2)
    for bad in (None, ("a",), (1.7, 2.2), "12"):
        with pytest.raises(ConfigError, match="must be a sequence of int global layer numbers"):
            RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=bad)  # type: ignore[arg-type]


def test_a_prefix_appended_twice_is_a_duplicated_prefix_error() -> None:
    """verl #6029 through the public API: the resumed call's routes hold the first call's rows twice. An exact
    repeat is named `DuplicatedPrefixError`; a re-routed repeat is still a `RowCountError` (its parent class)."""
    from routereplay.errors import DuplicatedPrefixError

    rollout = RolloutRoutes(GEOMETRY)
    ids = list(range(100, 107))
    first = payload(6)
    rollout.add_call("s", ids, first)
    resumed = [*ids, 200, 201, 202]
    full = np.concatenate([first, payload(3, seed=1)])  # the resumed call's own 9 rows, prefix as first sampled
    with pytest.raises(DuplicatedPrefixError, match="verl #6029"):
        rollout.add_call("s", resumed, np.concatenate([first, full]))
    with pytest.raises(RowCountError, match="15 route rows, expected 9"):
        rollout.add_call("s", resumed, np.concatenate([first, payload(9, seed=2)]))
    assert issubclass(DuplicatedPrefixError, RowCountError)
    assert rollout.add_call("s", resumed, full).num_tokens == 9


def test_a_payload_dtype_too_narrow_for_the_experts_is_refused() -> None:
    """A uint8 payload for a 300-expert model: ids above 255 would have wrapped on the way."""
    from routereplay.errors import DtypeError

    wide = RolloutRoutes(RouteGeometry(num_experts=300, num_layers=3, top_k=2, moe_layers=(1, 2)))
    with pytest.raises(DtypeError, match="uint8, whose largest value 255 cannot hold expert ids up to 299"):
        wide.add_call("s", list(range(7)), payload(6))


def test_a_dense_layer_holding_expert_ids_is_refused_not_dropped() -> None:
    """Found by the issue 38 acceptance tester: add_call kept layers 1 and 2 of a payload whose layer 0 (dense by
    the geometry) held real ids, discarding them; the trainer-side reader refuses the same payload."""
    from routereplay.errors import DenseLayerRouteError

    rows_TAK = payload(6)
    rows_TAK[:, 0] = rows_TAK[:, 2]  # layer 0 holds routes
    with pytest.raises(DenseLayerRouteError, match=r"sequence 's', token 0, layer 0: .* holds expert ids"):
        RolloutRoutes(GEOMETRY).add_call("s", list(range(7)), rows_TAK, policy_version=1)


def test_bad_token_ids_and_objects_are_named_errors() -> None:
    """Found by the issue 25 acceptance tester: text or out-of-range token ids were taken (a -5 then read as
    'unknown', switching the token check off), and None for a trace or a batch raised AttributeError."""
    from routereplay.integrations.verl import padded_routes, routes_for_batch

    rollout = RolloutRoutes(GEOMETRY)
    for bad, message in ((["a", "b", "c", "d"], "sequence of ints"), ([1, 2, 3, 2**40], r"\[0, 2\*\*31\)")):
        with pytest.raises(ConfigError, match=message):
            rollout.add_call("a", bad, payload(3))
    rollout.add_call("b", [1, 2, 3, 4], payload(3))
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 2\*\*31\)"):
        rollout.add_tokens("b", [1, 2, 3, 4, -5])
    with pytest.raises(ConfigError, match="padded_routes takes a RouteTrace"):
        padded_routes(None, prompt_len=4, response_len=6, prompt_length=6, response_length=6)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="routes_for_batch takes verl's DataProto or TensorDict"):
        routes_for_batch(None)
