"""Combine weights kept by the plugin's worker (vLLM-free): per request and position, forced or not, taken once,
and checked against the engine's routes before they reach a trace (`combine_weights.weights_for`).

The routers are stand-ins with vLLM's `_compute_routing` signature (as in `test_forced_routes_cost`); the live
check against vLLM's own experts is `test_vllm_combine_weights`. Legend: N = rows of a step, L = MoE layers,
K = top-k, T = route rows.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.vllm.combine_weights import weights_for
from routereplay.engines.vllm.forced_routes import WEIGHTS_KEY, XARG_KEY, ServedRouting, asks_weights, encode_forced
from routereplay.engines.vllm.forcing import LayerForcing
from routereplay.engines.vllm.forcing.weights import RequestWeights, WeightsStore
from routereplay.engines.vllm.forcing.worker import ForcingWorker
from routereplay.errors import ForcedRoutesError, WeightsCaptureError
from routereplay.trace.route_trace import RouteTrace

E, K = 16, 2
SERVED = ServedRouting(num_experts=E, top_k=K, num_layers=3, moe_layers=(1, 2))
PROMPT = list(range(100, 140))


class CPURouter:
    """vLLM's CPURouter name and attributes, routing softmax top-2 of the logits (renormalised)."""

    eplb_state = None
    scoring_func, renormalize, use_grouped_topk, custom_routing_function = "softmax", True, False, None
    top_k = K

    def _compute_routing(
        self, hidden: torch.Tensor | None, logits: torch.Tensor, indices_type: object, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def request(extra: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), prompt_token_ids=PROMPT)


def worker_and_layers() -> tuple[ForcingWorker, dict[int, LayerForcing]]:
    layers = {layer: LayerForcing.of(layer, CPURouter()) for layer in SERVED.moe_layers}
    for forcing in layers.values():
        forcing.install()
    return ForcingWorker(layers, SERVED, model_id=0), layers


def step(worker: ForcingWorker, layers: dict[int, LayerForcing], runner: Any, positions: list[int], seed: int) -> dict:
    """One engine step: begin, every layer routes the step's logits, keep, end; what each layer returned."""
    positions_N = torch.tensor(positions)
    active = worker.begin_step(runner, positions_N)
    returned = {}
    logits = torch.randn(len(positions), E, generator=torch.Generator().manual_seed(seed))
    for layer, forcing in layers.items():
        returned[layer] = forcing.router._compute_routing(torch.zeros(len(positions), 4), logits * layer, None)
    if active:
        worker.keep_weights()
    worker.end_step()
    return returned


def test_the_worker_keeps_each_asking_requests_rows_by_position_forced_or_not() -> None:
    """Three requests in one batch: weights only, forced + weights, plain. Each asking request's kept rows are
    exactly what the routers returned for its rows (forced rows with their forced ids); the plain one keeps
    nothing and its rows route as without the plugin."""
    worker, layers = worker_and_layers()
    forced_trace = RouteTrace(np.tile(np.array([[3, 7]], np.int16), (40, 2, 1)), E, SERVED.moe_layers)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=3, req_ids=["w-00000000", "f-11111111", "p-22222222"]),
        requests={
            "w-00000000": request({WEIGHTS_KEY: True}),
            "f-11111111": request({WEIGHTS_KEY: True, XARG_KEY: encode_forced(forced_trace)}),
            "p-22222222": request(None),
        },
        query_start_loc=SimpleNamespace(np=np.array([0, 3, 6, 8])),
    )
    prefill = step(worker, layers, runner, [0, 1, 2, 0, 1, 2, 0, 1], seed=1)
    runner.query_start_loc.np = np.array([0, 1, 2, 3])
    decode = step(worker, layers, runner, [3, 3, 2], seed=2)
    kept = worker.take_weights(["w", "f-11111111", "p"])  # by the id given to vLLM or by the runner's
    assert sorted(kept) == ["f-11111111", "w"]
    for name, first, decode_row in (("w", 0, 0), ("f-11111111", 3, 1)):
        have_T, ids_TLK, weights_TLK = kept[name].rows(4)
        assert have_T.all()
        for column, layer in enumerate(SERVED.moe_layers):
            want_w = torch.cat([prefill[layer][0][first : first + 3], decode[layer][0][decode_row : decode_row + 1]])
            want_i = torch.cat([prefill[layer][1][first : first + 3], decode[layer][1][decode_row : decode_row + 1]])
            assert np.array_equal(weights_TLK[:, column], want_w.numpy())
            assert np.array_equal(ids_TLK[:, column], want_i.numpy())
    assert (kept["f-11111111"].rows(4)[1] == [3, 7]).all()  # forced rows: the forced ids, weights beside them
    counters = worker.counters()
    assert (counters["weights_requests"], counters["forced_requests"], counters["weights_rows"]) == (2, 1, 8)
    assert worker.take_weights(["w", "f-11111111"]) == {}  # taken once, then freed
    assert all(forcing.kept is None and not forcing.keep for forcing in layers.values())


def test_a_step_without_an_asking_request_keeps_nothing_and_routes_live() -> None:
    worker, layers = worker_and_layers()
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=1, req_ids=["p"]),
        requests={"p": request({WEIGHTS_KEY: False})},
        query_start_loc=SimpleNamespace(np=np.array([0, 3])),
    )
    returned = step(worker, layers, runner, [0, 1, 2], seed=3)
    live = CPURouter()._compute_routing(None, torch.randn(3, E, generator=torch.Generator().manual_seed(3)) * 2, None)
    assert torch.equal(returned[2][0], live[0]) and torch.equal(returned[2][1], live[1])
    assert len(worker.weights) == 0 and worker.counters()["weights_rows"] == 0


def one_row(value: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([0]), np.zeros((1, 2, K), np.int32), np.full((1, 2, K), value, np.float32)


def test_left_requests_wait_in_a_bounded_finished_store() -> None:
    store = WeightsStore(capacity=2)
    for name in ("a-1", "b-2", "c-3"):
        store.keep(name, *one_row())
    store.retire(present={"c-3"})
    assert list(store.finished) == ["a-1", "b-2"] and list(store.live) == ["c-3"]
    store.keep("d-4", *one_row(0.0))
    store.retire(present=set())  # c and d leave: a and b, the oldest, are dropped past capacity
    assert sorted(store.finished) == ["c-3", "d-4"] and store.evicted == 2  # a and b
    assert sorted(store.take(["c", "a"])) == ["a", "c"]


def test_weights_nobody_reserved_room_for_are_dropped_when_their_request_leaves() -> None:
    """Issue 38 item 7: behind `vllm serve` no engine takes the weights, so a request's are dropped (counted) once it
    has left the runner, and the engine side names why instead of calling the rows unseen."""
    store = WeightsStore()  # a server's worker: no engine reserved room
    for name in ("a-1", "b-2"):
        store.keep(name, *one_row())
    assert store.kept_bytes == 2 * (8 + 2 * K * 8) and len(store) == 2
    store.retire(present={"b-2"})
    assert (len(store), store.evicted, store.kept_bytes) == (1, 1, 8 + 2 * K * 8)
    store.retire(present=set())
    assert (len(store), store.evicted, store.kept_bytes) == (0, 2, 0)
    trace = RouteTrace(np.array([[[3, 7], [1, 2]]], np.int16), E, SERVED.moe_layers)
    with pytest.raises(WeightsCaptureError, match=r"prompt 0: the worker dropped .*finished and no engine took them"):
        weights_for(trace, store.take(["a"])["a"], "prompt 0")


def test_kept_weights_stay_under_the_byte_limit_checked_before_the_copy() -> None:
    """Finished requests are evicted first (oldest first); a live request whose rows still do not fit is dropped
    whole, keeps nothing more, and comes back named; the bytes held (summed from the arrays themselves) never pass
    the limit, and a refused step's rows are never copied (tracemalloc sees no allocation)."""
    import tracemalloc

    per_row = 8 + 2 * K * 8
    store = WeightsStore(capacity=8, max_bytes=10 * per_row)

    def held() -> int:
        kept = [*store.live.values(), *store.finished.values()]
        return sum(a.nbytes for w in kept for a in (*w.positions, *w.ids, *w.weights))

    rows = lambda n: (np.arange(n), np.zeros((n, 2, K), np.int32), np.ones((n, 2, K), np.float32))  # noqa: E731
    assert store.keep("old-1", *rows(4)) and store.keep("old-2", *rows(3))
    store.retire(present=set())
    assert store.keep("live-3", *rows(5))  # 12 rows would not fit: old-1 is evicted, old-2 stays
    assert list(store.finished) == ["old-2"] and store.evicted == 1 and held() == store.kept_bytes == 8 * per_row
    big = (np.arange(200_000), np.zeros((200_000, 2, K), np.int32), np.ones((200_000, 2, K), np.float32))
    tracemalloc.start()
    try:
        assert not store.keep("live-3", *big)  # 6.4 MB asked: old-2 evicted, then live-3 dropped whole, no copy
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"a refused step allocated {peak} bytes"
    assert (store.over_limit, store.evicted, store.kept_bytes, held(), len(store)) == (1, 2, 0, 0, 0)
    assert not store.keep("live-3", *rows(1)) and store.kept_bytes == 0, "a dropped request keeps nothing more"
    taken = store.take(["live-3", "old-1"])
    assert "would pass the 400 bytes" in str(taken["live-3"].dropped) and taken["live-3"].num_kept == 0
    assert "evicted, untaken" in str(taken["old-1"].dropped)


def test_the_byte_limit_is_read_from_the_environment_and_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from routereplay.engines.vllm.forcing.weights import DEFAULT_MAX_BYTES, MAX_BYTES_ENV
    from routereplay.errors import ConfigError

    monkeypatch.delenv(MAX_BYTES_ENV, raising=False)
    assert WeightsStore().max_bytes == DEFAULT_MAX_BYTES
    monkeypatch.setenv(MAX_BYTES_ENV, " 4096 ")
    assert WeightsStore().max_bytes == 4096
    for bad in ("1.5e9", "-1", "lots"):
        monkeypatch.setenv(MAX_BYTES_ENV, bad)
        with pytest.raises(ConfigError, match=rf"ROUTEREPLAY_WEIGHTS_MAX_BYTES='{re.escape(bad)}': .* whole number"):
            WeightsStore()


@pytest.mark.parametrize("value", [True, 1, "true", "TRUE", "True", " true ", False, 0, "false", "False", " FALSE "])
def test_the_weights_flag_is_read_in_every_form_vllm_delivers(value: object) -> None:
    """The forms docs/engines.md lists: strings in any case, surrounding spaces ignored."""
    asked = value is True or value == 1 or (isinstance(value, str) and value.strip().lower() == "true")
    assert asks_weights({WEIGHTS_KEY: value}, "r") is asked


@pytest.mark.parametrize("value", ["yes", 2, -1, 1.0, 0.0, None, [1], "1"])
def test_a_request_asking_for_weights_with_another_value_is_refused_by_name(value: object) -> None:
    assert not asks_weights(None, "r")
    with pytest.raises(ForcedRoutesError, match=r"'r': vllm_xargs 'routereplay_weights'=.* must be true .* or false"):
        asks_weights({WEIGHTS_KEY: value}, "vLLM request 'r'")


def test_vllms_openai_requests_turn_json_true_into_1_and_the_plugin_reads_it() -> None:
    """Issue 38 item 8, through vLLM 0.30's own request classes: `/v1/completions` and chat validate `vllm_xargs` as
    `str | int | float`, so JSON true / false reach `SamplingParams.extra_args` as 1 / 0; both are read as asked."""
    vllm = pytest.importorskip("vllm", reason="needs vLLM (the vllm extra)")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from routereplay.engines.vllm.plugin import asks_for_plugin

    for flag in (True, False):
        body = {"model": "m", "max_tokens": 4, "vllm_xargs": {WEIGHTS_KEY: flag}}  # the JSON body, as the server
        completion = CompletionRequest.model_validate(body | {"prompt": [1, 2, 3]})  # validates it
        chat = ChatCompletionRequest.model_validate(body | {"messages": [{"role": "user", "content": "x"}]})
        for sent in (completion, chat):
            params = sent.to_sampling_params(16, {})
            assert isinstance(params, vllm.SamplingParams)
            assert params.extra_args == {WEIGHTS_KEY: int(flag)} and type(params.extra_args[WEIGHTS_KEY]) is int
            assert asks_weights(params.extra_args, "r") is flag
            runner = SimpleNamespace(
                input_batch=SimpleNamespace(num_reqs=1, req_ids=["r"]),
                requests={"r": SimpleNamespace(sampling_params=params)},
            )
            assert asks_for_plugin(runner) is flag


def kept_rows(ids_TLK: np.ndarray, weights_TLK: np.ndarray, positions: list[int]) -> RequestWeights:
    kept = RequestWeights()
    kept.add(np.array(positions), ids_TLK[positions], weights_TLK[positions])
    return kept


def test_weights_reach_a_trace_only_beside_the_ids_vllm_reports() -> None:
    """The engine-side check: same ids in the same order -> the weights; another order, other ids or a routed row
    without weights -> `WeightsCaptureError` naming the rows."""
    rng = np.random.default_rng(0)
    ids_TLK = np.stack([[rng.choice(E, K, replace=False) for _ in range(2)] for _ in range(5)]).astype(np.int32)
    weights_TLK = rng.random((5, 2, K)).astype(np.float32)
    trace = RouteTrace(ids_TLK.astype(np.int16), E, SERVED.moe_layers)
    got = weights_for(trace, kept_rows(ids_TLK, weights_TLK, [0, 1, 2, 3, 4]), "prompt 0")
    assert np.array_equal(got, weights_TLK)
    swapped = ids_TLK.copy()
    swapped[3, 1] = swapped[3, 1, ::-1]  # the same set in another order: the weights would swap experts
    with pytest.raises(WeightsCaptureError, match=r"prompt 0: the ids kept .* differ .* on 1 rows \(first row 3"):
        weights_for(trace, kept_rows(swapped, weights_TLK, [0, 1, 2, 3, 4]), "prompt 0")
    with pytest.raises(WeightsCaptureError, match=r"2 of 5 routed rows \(first \[1, 4\]\) have no combine weights"):
        weights_for(trace, kept_rows(ids_TLK, weights_TLK, [0, 2, 3]), "prompt 0")
    routed_later = ids_TLK.astype(np.int16)
    routed_later[:2] = -1  # rows vLLM did not route: weights 0 there, nothing asked of them
    got = weights_for(RouteTrace(routed_later, E, SERVED.moe_layers), kept_rows(ids_TLK, weights_TLK, [2, 3, 4]), "p")
    assert (got[:2] == 0).all() and np.array_equal(got[2:], weights_TLK[2:])


def test_the_front_end_gives_a_weights_request_its_own_salt_and_the_forcing_checks() -> None:
    """`check_request`: a weights request needs an eager engine like forcing (named by its field); it gets a salt of
    its own after the caller's (no row from the prefix cache, so the worker sees every routed row); forced + weights
    keeps the forced routes' digest last; a request asking for neither is left as it came."""
    from routereplay.engines.vllm.forced_routes import WEIGHTS_SALT, salted
    from routereplay.engines.vllm.plugin import check_request

    def processor(eager: bool = True, speculative: Any = None) -> SimpleNamespace:
        model_config = SimpleNamespace(
            enforce_eager=eager,
            get_num_experts=lambda: E,
            get_num_experts_per_tok=lambda: K,
            hf_text_config=SimpleNamespace(num_hidden_layers=3, mlp_only_layers=[0]),
        )
        parallel = SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=1), speculative_config=speculative
        )
        return SimpleNamespace(model_config=model_config, vllm_config=parallel)

    def front(extra: dict[str, Any] | None, salt: str | None = None) -> SimpleNamespace:
        params = SimpleNamespace(extra_args=extra)
        return SimpleNamespace(request_id="r9", sampling_params=params, prompt_token_ids=PROMPT, cache_salt=salt)

    with pytest.raises(ForcedRoutesError, match=r"'r9': vllm_xargs 'routereplay_weights' need an eager engine"):
        check_request(processor(eager=False), front({WEIGHTS_KEY: True}))
    ngram = SimpleNamespace(method="ngram")  # vLLM 0.30 front end: speculative decoding refused for both asks
    with pytest.raises(ForcedRoutesError, match=r"'r9': vllm_xargs 'routereplay_weights' cannot .* speculative"):
        check_request(processor(speculative=ngram), front({WEIGHTS_KEY: True}))
    text_s = encode_forced(RouteTrace(np.tile(np.array([[3, 7]], np.int16), (20, 2, 1)), E, SERVED.moe_layers))
    with pytest.raises(ForcedRoutesError, match=r"forced routes .* speculative decoding \(method 'ngram'\)"):
        check_request(processor(speculative=ngram), front({XARG_KEY: text_s}))
    with pytest.raises(ForcedRoutesError, match=r"'routereplay_weights'=2 must be true"):
        check_request(processor(), front({WEIGHTS_KEY: 2}))
    check_request(processor(), front({WEIGHTS_KEY: 1}))  # JSON true as vLLM's OpenAI server delivers it
    first, second = front({WEIGHTS_KEY: True}, salt="mine"), front({WEIGHTS_KEY: True}, salt="mine")
    check_request(processor(), first)
    check_request(processor(), second)
    assert first.cache_salt.startswith(f"mine|{WEIGHTS_SALT}") and first.cache_salt != second.cache_salt
    text = encode_forced(RouteTrace(np.tile(np.array([[3, 7]], np.int16), (20, 2, 1)), E, SERVED.moe_layers))
    both = front({WEIGHTS_KEY: True, XARG_KEY: text})
    check_request(processor(), both)
    own = both.cache_salt.split("|")[0]
    assert own.startswith(WEIGHTS_SALT) and both.cache_salt == salted(own, text)
    for extra in (None, {WEIGHTS_KEY: False}):
        plain = front(extra, salt="mine")
        check_request(processor(eager=False), plain)
        assert plain.cache_salt == "mine"


def test_the_front_end_refuses_a_weights_request_whose_own_rows_pass_the_byte_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the request is queued: prompt + max_tokens rows x `row_bytes(L, K)` against the worker's limit."""
    from routereplay.engines.vllm.forcing.weights import MAX_BYTES_ENV, row_bytes
    from routereplay.engines.vllm.plugin import check_request

    model_config = SimpleNamespace(
        enforce_eager=True,
        get_num_experts=lambda: E,
        get_num_experts_per_tok=lambda: K,
        hf_text_config=SimpleNamespace(num_hidden_layers=3, mlp_only_layers=[0]),
    )
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1), speculative_config=None)
    processor = SimpleNamespace(model_config=model_config, vllm_config=vllm_config)
    need = (len(PROMPT) + 24) * row_bytes(2, K)
    request = lambda: SimpleNamespace(  # noqa: E731
        request_id="r7",
        sampling_params=SimpleNamespace(extra_args={WEIGHTS_KEY: 1}, max_tokens=24),
        prompt_token_ids=PROMPT,
        cache_salt=None,
    )
    monkeypatch.setenv(MAX_BYTES_ENV, str(need - 1))
    with pytest.raises(ForcedRoutesError, match=rf"'r7': .*40 prompt tokens \+ max_tokens=24 would keep {need} bytes"):
        check_request(processor, request())
    monkeypatch.setenv(MAX_BYTES_ENV, str(need))
    check_request(processor, request())
