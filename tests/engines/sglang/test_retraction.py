"""Sampling-time routes across retraction, on SGLang 0.5.23's own classes (CPU).

The scenario is stepped by hand the way SGLang's scheduler steps it, with SGLang's own objects doing the work: a
`Req` returning routes; `ReqToTokenPool`, `TokenToKVPoolAllocator` and a (disabled) `RadixCache` holding its KV
slots; `RoutedExpertsCapturer` capturing each forward's ids per layer and writing them to its host buffer at the
tokens' KV slots (`capture` + `on_forward_end`, the non-overlap path); `schedule_batch.retract_all` retracting it
(`release_req` -> `release_kv_cache` -> `Req.reset_for_retract`, the `pause_generation(mode="retract")` path);
and `SchedulerBatchResultProcessor._maybe_collect_routed_experts` reading its rows at finish. Only the model is
absent: each forward's ids come from `routes(position, layer, epoch)`, a different expert set per epoch, so a row
computed before retraction (epoch 0) and the same position recomputed by the re-prefill (epoch 1) differ.

Legend: N = token rows, L = layers, K = top-k, E = experts.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from routereplay.engines.sglang import SamplingTimeRoutes

L, K, E = 3, 2, 8
PROMPT = [11, 12, 13, 14]
SLOTS = 128


def routes(position: int, layer: int, epoch: int) -> list[int]:
    """The expert set a forward picks for (position, layer): any two of epochs 0, 1, 2 give disjoint sets."""
    base = (3 * position + layer + 3 * epoch) % E
    return [base, (base + 1) % E]


def expected_NLK(positions: range, epoch_of: Any) -> np.ndarray:
    return np.array([[routes(p, layer, epoch_of(p)) for layer in range(L)] for p in positions], dtype=np.int32)


class Scheduler:
    """SGLang's pools, capturer and result processor for one CPU process, stepped like the scheduler steps them."""

    def __init__(self) -> None:
        import torch
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer

        model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts_per_tok=K, num_hidden_layers=L))
        self.capturer = RoutedExpertsCapturer(
            model_config, num_tokens=SLOTS, max_running_requests=4, num_fused_shared_experts=0, device="cpu"
        )
        set_global_experts_capturer(self.capturer)
        self.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(SLOTS, torch.float16, "cpu", None, need_sort=False)
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
            )
        )
        # the scheduler's result processor (a frozen dataclass of the scheduler's parts): finish reads only its
        # req_to_token_pool, the other parts are not used here
        parts = {field.name: None for field in dataclasses.fields(SchedulerBatchResultProcessor)}
        self.processor = SchedulerBatchResultProcessor(**{**parts, "req_to_token_pool": self.req_to_token_pool})

    def request(self, rid: str, *, start_len: int = 0, routed: bool = True) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid,
            "",
            list(PROMPT),
            SamplingParams(max_new_tokens=16),
            return_routed_experts=routed,
            routed_experts_start_len=start_len,
        )

    def forward(self, req: Any, first: int, last: int, epoch: int) -> None:
        """One forward of positions [first, last) of `req` (an extend, or a decode step when last = first + 1):
        KV slots allocated and registered in req_to_token, every layer's ids captured, the host buffer written;
        then the token sampled from the last row is appended."""
        import torch

        if req.kv.req_pool_idx is None:
            assert self.req_to_token_pool.alloc([req]) is not None
        slots = self.allocator.alloc(last - first)
        self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, first:last] = slots.to(torch.int32)
        for layer in range(L):
            ids_NK = torch.tensor([routes(p, layer, epoch) for p in range(first, last)], dtype=torch.int32)
            self.capturer.capture(layer, ids_NK)
        batch = SimpleNamespace(out_cache_loc=slots, out_cache_loc_virtual=None)
        assert self.capturer.on_forward_end(batch, can_run_graph=False, cuda_graph_batch=None) is None
        req.kv.kv_allocated_len = req.kv.kv_committed_len = last
        if last == req.seqlen:  # the forward fed the last token: it samples the next one
            req.output_ids.append(100 + last)

    def retract(self, req: Any) -> None:
        from sglang.srt.managers import schedule_batch

        schedule_batch.retract_all(
            reqs=[req],
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache,
            hisparse_coordinator=None,
        )
        assert req.is_retracted and req.kv.req_pool_idx is None

    def finish(self, req: Any) -> np.ndarray:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        self.processor._maybe_collect_routed_experts(req)
        return np.asarray(req.routed_experts)


def decode_then_retract(scheduler: Scheduler, req: Any, *, decode_steps: int, epoch: int) -> None:
    """Prefill what is not computed yet, decode `decode_steps` tokens, then retract."""
    scheduler.forward(req, 0, req.seqlen, epoch)
    for _ in range(decode_steps):
        scheduler.forward(req, req.seqlen - 1, req.seqlen, epoch)
    scheduler.retract(req)


@pytest.fixture
def scheduler(published: Any, cpu_host_buffers: None) -> Scheduler:
    return Scheduler()


@pytest.fixture
def plugin(hook_registry: Any) -> SamplingTimeRoutes:
    retraction = SamplingTimeRoutes()
    retraction.install(hook_registry)
    hook_registry.apply_hooks()
    return retraction


def as_sets(rows_NLK: np.ndarray) -> np.ndarray:
    return np.sort(rows_NLK, axis=-1)


def test_without_the_plugin_sglang_returns_the_re_prefill_routes(scheduler: Scheduler) -> None:
    """The defect (issue 39 item 1), on SGLang's own code: positions computed before retraction come back with the
    routes of the re-prefill, not the routes their tokens were sampled with."""
    req = scheduler.request("r0")
    decode_then_retract(scheduler, req, decode_steps=2, epoch=0)  # rows 0..5 computed, 3 tokens sampled
    scheduler.forward(req, 0, req.seqlen, epoch=1)  # re-prefill of 7 tokens, samples the 4th
    scheduler.forward(req, req.seqlen - 1, req.seqlen, epoch=1)
    returned_NLK = scheduler.finish(req)

    assert returned_NLK.shape == (8, L, K)
    np.testing.assert_array_equal(as_sets(returned_NLK), as_sets(expected_NLK(range(8), lambda p: 1)))


def test_retracted_request_returns_its_sampling_time_routes(scheduler: Scheduler, plugin: SamplingTimeRoutes) -> None:
    req = scheduler.request("r0")
    decode_then_retract(scheduler, req, decode_steps=2, epoch=0)
    scheduler.forward(req, 0, req.seqlen, epoch=1)
    scheduler.forward(req, req.seqlen - 1, req.seqlen, epoch=1)
    returned_NLK = scheduler.finish(req)

    # rows 0..5 were first computed before retraction; 6 (fed first by the re-prefill) and 7 after it
    want_NLK = expected_NLK(range(8), lambda p: 0 if p < 6 else 1)
    np.testing.assert_array_equal(as_sets(returned_NLK), as_sets(want_NLK))
    assert (plugin.stats.retractions, plugin.stats.rows_saved) == (1, 6)
    assert (plugin.stats.requests_spliced, plugin.stats.rows_spliced, plugin.stats.rows_changed) == (1, 6, 6)
    assert plugin.sampling_rows(req) is None  # handed back at finish, nothing kept


def test_second_retraction_keeps_the_first_rows_and_adds_the_new_ones(
    scheduler: Scheduler, plugin: SamplingTimeRoutes
) -> None:
    req = scheduler.request("r0")
    decode_then_retract(scheduler, req, decode_steps=1, epoch=0)  # rows 0..4 at epoch 0; seqlen 6
    decode_then_retract(scheduler, req, decode_steps=2, epoch=1)  # re-prefill 0..5, decode 6, 7; seqlen 9
    kept = plugin.sampling_rows(req)
    assert kept is not None and (kept.start, kept.end) == (0, 8)
    scheduler.forward(req, 0, req.seqlen, epoch=2)
    returned_NLK = scheduler.finish(req)

    # rows 0..4 first computed before the first retraction, 5..7 before the second, 8 by the last re-prefill
    want_NLK = expected_NLK(range(9), lambda p: 0 if p < 5 else (1 if p < 8 else 2))
    np.testing.assert_array_equal(as_sets(returned_NLK), as_sets(want_NLK))
    assert (plugin.stats.retractions, plugin.stats.rows_saved, plugin.stats.rows_spliced) == (2, 8, 8)


def test_start_len_is_honoured(scheduler: Scheduler, plugin: SamplingTimeRoutes) -> None:
    req = scheduler.request("r0", start_len=3)
    decode_then_retract(scheduler, req, decode_steps=2, epoch=0)
    scheduler.forward(req, 0, req.seqlen, epoch=1)
    returned_NLK = scheduler.finish(req)

    want_NLK = expected_NLK(range(3, 7), lambda p: 0 if p < 6 else 1)
    np.testing.assert_array_equal(as_sets(returned_NLK), as_sets(want_NLK))
    assert plugin.stats.rows_saved == 3


def test_requests_without_retraction_or_without_routes_are_untouched(
    scheduler: Scheduler, plugin: SamplingTimeRoutes
) -> None:
    plain = scheduler.request("plain")
    scheduler.forward(plain, 0, plain.seqlen, epoch=0)
    scheduler.forward(plain, plain.seqlen - 1, plain.seqlen, epoch=0)
    np.testing.assert_array_equal(as_sets(scheduler.finish(plain)), as_sets(expected_NLK(range(5), lambda p: 0)))

    unrouted = scheduler.request("unrouted", routed=False)
    decode_then_retract(scheduler, unrouted, decode_steps=1, epoch=0)
    assert plugin.sampling_rows(unrouted) is None
    assert plugin.stats.retractions == 0 and plugin.stats.requests_spliced == 0
