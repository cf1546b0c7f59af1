"""Forced routes as a request carries them (issue 24), without a running vLLM: the checks every blob passes
before a worker uses it, the weights a forced row gets, and the client's side over HTTP against stub servers.

Hostile blobs must fail by name (`ForcedRoutesError`) before anything sized by the blob is allocated; a
server that ignores the forced routes must be caught from its own reply (`ForcingNotAppliedError`).
"""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay import codec
from routereplay.engines.hf import SamplingParams
from routereplay.engines.remote import VLLMClient
from routereplay.engines.vllm.forced_routes import (
    XARG_KEY,
    ForcedRoutes,
    ServedRouting,
    check_forced,
    encode_forced,
    moe_layers_of,
    salted,
)
from routereplay.engines.vllm.forcing import RoutingMethod, RoutingRule, rule_of
from routereplay.errors import (
    ConfigError,
    ExpertIdRangeError,
    ForcedRoutesError,
    ForcingNotAppliedError,
)
from routereplay.trace.route_trace import RouteTrace
from tests.engines.stub_server import StubConfig, stub_server

SERVED = ServedRouting(num_experts=16, top_k=2, num_layers=3, moe_layers=(1, 2))
PROMPT = list(range(100, 120))  # 20 tokens


def trace(
    rows: int = 19, *, seed: int = 0, start: int = 0, layers: tuple[int, ...] = (1, 2), experts: int = 16
) -> RouteTrace:
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((rows, len(layers), experts)), axis=-1)[:, :, :2]
    return RouteTrace(order.astype(np.int16), experts, layers, start=start)


def parse(value: object, prompt: list[int] | None = PROMPT) -> ForcedRoutes:
    return ForcedRoutes.parse(value, SERVED, prompt, where="request 'r1'")


# --- the checks -------------------------------------------------------------------------------------------------


def test_a_good_blob_parses_to_its_rows_by_position() -> None:
    routes = trace(10, start=5)
    plan = parse(encode_forced(routes))
    assert (plan.start, plan.stop, plan.moe_layers) == (5, 15, (1, 2))
    inside, rows = plan.rows_at(np.array([3, 5, 14, 15, 9]))
    assert inside.tolist() == [False, True, True, False, True]
    assert np.array_equal(np.sort(rows, -1), np.sort(routes.experts[[0, 9, 4]], -1))


def test_minus_one_rows_stay_live() -> None:
    experts = trace(6).experts.copy()
    experts[2, 0] = -1
    plan = parse(encode_forced(RouteTrace(experts, 16, (1, 2))))
    assert plan.forced_rows == 6 * 2 - 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (12345, r"value is a int; it must be base64 text"),
        ("@@@not base64@@@", r"not base64"),
        (base64.b64encode(b"RRT1" + b"\x00" * 40).decode(), r"not a valid codec blob"),
        (encode_forced(trace(19, layers=(0, 1))), r"layers \[0, 1\]; the served model's MoE layers are \[1, 2\]"),
        (encode_forced(trace(19, layers=(1,))), r"layers \[1\]; the served model's MoE layers are \[1, 2\]"),
        (encode_forced(trace(21)), r"positions 0\.\.20 but the prompt has 20 tokens"),
        (encode_forced(trace(5, start=18)), r"positions 18\.\.22 but the prompt has 20 tokens"),
        (encode_forced(trace(19, experts=32)), r"E=32, K=2; the served model routes E=16, K=2"),
        (encode_forced(trace(19).with_token_ids(list(range(200, 219)))), r"token id at position 0 is 200"),
    ],
    ids=[
        "not-text",
        "not-base64",
        "not-a-blob",
        "dense-layer",
        "layer-count",
        "rows-beyond",
        "start-beyond",
        "E",
        "tokens",
    ],
)
def test_bad_forced_routes_are_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ForcedRoutesError, match=rf"request 'r1': forced routes .* refused: .*{message}"):
        parse(value)


def test_a_flipped_byte_fails_the_checksum() -> None:
    blob = bytearray(codec.encode(trace()))
    blob[len(blob) // 2] ^= 0x10
    with pytest.raises(ForcedRoutesError, match=r"CRC|checksum"):
        parse(base64.b64encode(bytes(blob)).decode())


def test_matching_token_ids_pass_and_prompts_without_ids_are_refused() -> None:
    assert parse(encode_forced(trace(19).with_token_ids(PROMPT[:19]))).stop == 19
    with pytest.raises(ForcedRoutesError, match="no prompt token ids"):
        parse(encode_forced(trace()), prompt=None)


def test_ids_beyond_the_expert_count_never_make_a_blob() -> None:
    experts = trace(3).experts.copy()
    experts[0, 0, 0] = 16
    with pytest.raises(ExpertIdRangeError):
        encode_forced(RouteTrace(experts, 16, (1, 2)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=40))
def test_any_bytes_are_a_blob_or_a_forced_routes_error(data: bytes, cut: int) -> None:
    """Random bytes, and good blobs cut short or with random bytes spliced in, never raise anything else."""
    good = codec.encode(trace(4))
    for candidate in (data, good[: max(0, len(good) - cut)], good[:cut] + data + good[cut + len(data) :]):
        try:
            parse(base64.b64encode(candidate).decode())
        except ForcedRoutesError:
            pass


def test_salt_separates_routes_and_keeps_the_callers_salt() -> None:
    a, b = encode_forced(trace(seed=1)), encode_forced(trace(seed=2))
    assert salted(None, a) != salted(None, b) and salted(None, a) == salted(None, a)
    assert salted("user", a).startswith("user|") and salted("user", a).endswith(salted(None, a))


def test_moe_layers_follow_the_configs_own_fields() -> None:
    assert moe_layers_of(SimpleNamespace(mlp_only_layers=[0], decoder_sparse_step=1), 3) == (1, 2)
    assert moe_layers_of(SimpleNamespace(first_k_dense_replace=1, moe_layer_freq=1), 4) == (1, 2, 3)
    assert moe_layers_of(SimpleNamespace(decoder_sparse_step=2), 4) == (1, 3)
    assert moe_layers_of(SimpleNamespace(), 2) == (0, 1)


# --- the engine's reply -----------------------------------------------------------------------------------------


def test_check_forced_names_the_first_row_an_engine_did_not_force() -> None:
    asked = trace(8)
    got = RouteTrace(np.concatenate([asked.experts[:, :, ::-1], trace(3, seed=9).experts]), 16, (1, 2))
    check_forced(asked, got, where="prompt 0")  # the same sets, in another order, plus unforced rows after
    experts = got.experts.copy()
    experts[5, 1] = [e for e in range(16) if e not in set(asked.experts[5, 1].tolist())][:2]
    with pytest.raises(
        ForcingNotAppliedError, match=r"prompt 0: .* other experts on 1 of them \(first: token 5, layer 2"
    ):
        check_forced(asked, RouteTrace(experts, 16, (1, 2)), where="prompt 0")
    check_forced(asked, RouteTrace(experts[:5], 16, (1, 2)), where="prompt 0")  # aborted before row 5: unchecked


# --- weights of a forced row ------------------------------------------------------------------------------------


def test_forced_weights_follow_the_routing_method() -> None:
    logits = torch.randn(5, 16)
    experts = torch.stack([torch.randperm(16)[:2] for _ in range(5)])
    softmax = RoutingRule(RoutingMethod.SOFTMAX_TOPK, renormalize=True).weights(logits, experts)
    assert torch.allclose(softmax.sum(-1), torch.ones(5))
    probs = torch.softmax(logits, -1).gather(1, experts)
    assert torch.allclose(softmax, probs / probs.sum(-1, keepdim=True), atol=1e-6)
    raw = RoutingRule(RoutingMethod.SOFTMAX_TOPK, renormalize=False).weights(logits, experts)
    assert torch.allclose(raw, probs, atol=1e-6)
    grouped = RoutingRule(RoutingMethod.SCORED_TOPK, True, "sigmoid", 2.5).weights(logits, experts)
    scores = logits.sigmoid().gather(1, experts)
    assert torch.allclose(grouped, 2.5 * scores / scores.sum(-1, keepdim=True), atol=1e-6)


def test_routers_that_cannot_be_forced_are_named() -> None:
    class CPURouter:  # the attributes vLLM's CPURouter has
        eplb_state = None
        scoring_func, renormalize, use_grouped_topk, custom_routing_function = "softmax", True, False, None

    assert rule_of(CPURouter())[0] == RoutingRule(RoutingMethod.SOFTMAX_TOPK, True)
    custom = CPURouter()
    custom.custom_routing_function = len
    assert rule_of(custom)[0] is None
    assert rule_of(custom)[1].startswith("the custom routing function builtins.len (only Llama 4's")
    v4 = CPURouter()
    v4.scoring_func = "sqrtsoftplus"
    assert rule_of(v4)[0] is None and "sqrtsoftplus" in rule_of(v4)[1]
    assert rule_of(SimpleNamespace())[1].startswith("router SimpleNamespace is none of the routers forced")


# --- the client over HTTP ---------------------------------------------------------------------------------------


def _client(url: str, **kwargs: object) -> VLLMClient:
    options = {"model": "test-moe", "num_experts": 64, "moe_layers": (1, 2, 3), "top_k": 2, "timeout": 5.0}
    return VLLMClient(url, **{**options, **kwargs})  # type: ignore[arg-type]


def test_client_sends_the_blob_and_catches_a_server_that_ignored_it() -> None:
    """A server without the plugin (the stub) answers with its own routes: the client names it."""
    prompt = [5, 6, 7, 8, 9]
    asked = trace(4, layers=(1, 2, 3), experts=64)
    with stub_server(StubConfig(num_experts=64)) as stub:
        with pytest.raises(ForcingNotAppliedError, match=r"lacks the routereplay vLLM plugin"):
            _client(stub.url).generate([prompt], SamplingParams(max_new_tokens=3), prefix_routes=[asked])
        sent = stub.posts("/v1/completions")[-1]["vllm_xargs"][XARG_KEY]
    assert codec.decode(base64.b64decode(sent)).equal_sets(asked)


def test_client_checks_what_it_can_before_sending() -> None:
    with stub_server(StubConfig(num_experts=64)) as stub:
        with pytest.raises(ForcedRoutesError, match=r"positions 0\.\.5 but the prompt has 5 tokens"):
            _client(stub.url).generate(
                [[5, 6, 7, 8, 9]], SamplingParams(), prefix_routes=[trace(6, layers=(1, 2, 3), experts=64)]
            )
        assert stub.posts("/v1/completions") == []


def test_a_router_that_cannot_be_forced_routes_live_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    """A router that cannot be forced (a stand-in named like vLLM's RoutingSimulatorRouter) is never forced
    silently: its rows route live, are counted, and the worker's log names the layer and why (the client then sees
    ForcingNotAppliedError)."""
    import logging

    from routereplay.engines.vllm.forcing.router import LayerForcing, StepRows

    class RoutingSimulatorRouter:
        def _compute_routing(self, hidden: torch.Tensor, logits: torch.Tensor, indices_type: object, **kw: object):
            return torch.full((logits.shape[0], 2), 0.5), torch.tensor([[0, 1]] * logits.shape[0])

    router = RoutingSimulatorRouter()
    forcing = LayerForcing.of(3, router)
    forcing.install()
    forcing.install()  # installing twice keeps one wrapper around the original
    forcing.step = StepRows(torch.tensor([1]), torch.tensor([[5, 6]]))
    with caplog.at_level(logging.ERROR, logger="routereplay.vllm.forcing"):
        _weights, ids = router._compute_routing(torch.zeros(3, 4), torch.zeros(3, 8), None)
    assert ids.tolist() == [[0, 1]] * 3 and forcing.live_fallback_rows == 1 and forcing.forced_rows == 0
    assert "layer 3 cannot be forced (router RoutingSimulatorRouter: it routes synthetically" in caplog.text


def test_the_front_end_names_every_refusal_with_the_field_and_reserves_its_salt() -> None:
    """The plugin's front-end check (`check_request`, what vLLM's InputProcessor runs): a non-eager or data-parallel
    engine refuses forced routes naming the vllm_xargs field (so `VLLMClient` maps the 400 to ForcedRoutesError);
    an unforced request may not send the forced requests' reserved salt (it would reuse forced KV); a good forced
    request is salted with its routes' digest, after the caller's own salt."""
    from routereplay.engines.vllm.plugin import check_request

    text = encode_forced(trace(19))

    def processor(eager: bool = True, dp: int = 1) -> SimpleNamespace:
        model_config = SimpleNamespace(
            enforce_eager=eager,
            get_num_experts=lambda: 16,
            get_num_experts_per_tok=lambda: 2,
            hf_text_config=SimpleNamespace(num_hidden_layers=3, mlp_only_layers=[0]),
        )
        return SimpleNamespace(
            model_config=model_config,
            vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp)),
        )

    def request(extra: dict[str, object] | None, salt: str | None = None) -> SimpleNamespace:
        params = SimpleNamespace(extra_args=extra)
        return SimpleNamespace(request_id="r7", sampling_params=params, prompt_token_ids=PROMPT, cache_salt=salt)

    with pytest.raises(
        ForcedRoutesError, match=r"'r7': forced routes \(vllm_xargs 'routereplay_routes'\) need an eager"
    ):
        check_request(processor(eager=False), request({XARG_KEY: text}))
    with pytest.raises(
        ForcedRoutesError, match=r"vllm_xargs 'routereplay_routes'\) are supported with one data-parallel"
    ):
        check_request(processor(dp=2), request({XARG_KEY: text}))
    with pytest.raises(ForcedRoutesError, match=r"cache_salt contains 'routereplay-forced:', which is reserved"):
        check_request(processor(), request(None, salt=salted("mine", text)))
    plain = request(None, salt="mine")
    check_request(processor(), plain)
    assert plain.cache_salt == "mine"
    forced = request({XARG_KEY: text}, salt="mine")
    check_request(processor(), forced)
    assert forced.cache_salt == salted("mine", text)


def test_prefix_routes_must_be_a_list_per_prompt() -> None:
    with stub_server(StubConfig(num_experts=64)) as stub:
        routes = trace(4, layers=(1, 2, 3), experts=64)
        for value in (routes, 5, (t for t in [routes])):
            with pytest.raises(ConfigError, match=r"prefix_routes is a .*; give a list of one RouteTrace"):
                _client(stub.url).generate([[5, 6, 7, 8, 9]], SamplingParams(), prefix_routes=value)  # type: ignore[arg-type]
        assert stub.posts("/v1/completions") == []
