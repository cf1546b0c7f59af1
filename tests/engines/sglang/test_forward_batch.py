"""The whole forcing path inside SGLang 0.5.23 on CPU, the plugin loaded by SGLang's own `load_plugins()`.

SGLang's own objects carry a forward from scheduling to capture: `Req`s with prompts and `custom_params`,
`ReqToTokenPool` / `TokenToKVPoolAllocator` / a (disabled) `RadixCache`, `ScheduleBatch.init_new` +
`prepare_for_extend` (the scheduler's host fields, KV slots allocated), `ForwardBatch.init_new` (hooked: the
forward's forced rows mapped), `ModelRunner.forward` (hooked: the forced rows current while it runs; it calls the
routed-experts capturer's `on_forward_end`), `select_experts` on the torch-native path (`_post_process_topk_ids`
hooked: the substitution) and `RoutedExpertsCapturer` (what a request gets back). Stand-ins, because a model cannot
be loaded here: the runner object `ModelRunner.forward` runs on (`Runner`: the attributes `init_new` and `forward`
read, SGLang's own `KVIndexTranslator`) and its `_forward_raw` (three MoE routers on fixed hidden states instead
of a model; `select_experts` is SGLang's). The scheduler queue `_add_request_to_queue` runs on a stand-in
scheduler with the four methods it calls.

The truth: the ids and weights `select_experts` returns and SGLang's capturer holds, compared with the same forward
run live (routes as sets).

Legend: N = token rows of the forward, D = hidden size, E = experts, K = top-k, L = layers.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang.srt.model_executor.model_runner", reason="needs fastapi, uvicorn, setproctitle")

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner, ModelRunnerOutput
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from routereplay.engines.sglang import SGLangPlugin
from routereplay.engines.sglang.forcing import CUSTOM_KEY
from routereplay.engines.sglang.forcing.hooks import BATCH_ATTR, REQ_ATTR
from routereplay.engines.sglang.forcing.requests import REPREFILL_ENV, REPREFILL_KEY
from routereplay.engines.vllm.forced_routes import encode_forced
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace

E, K, L, D = 8, 2, 3, 16  # the conftest's tiny Qwen3-MoE (model_config)
SLOTS = 128


class Runner:
    """What `ForwardBatch.init_new` and `ModelRunner.forward` read from a model runner; `_forward_raw` stands for
    the model: L routers over fixed hidden states, each through SGLang's `select_experts` (torch-native)."""

    def __init__(self, model_config: ModelConfig, pool: ReqToTokenPool, allocator: Any) -> None:
        self.model_config = model_config
        self.device = "cpu"
        self.is_draft_worker = False
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=pool.req_to_token,
            token_to_kv_pool_allocator=allocator,
            token_to_kv_pool=None,
            page_size=1,
            device="cpu",
        )
        self.ngram_embedding_manager = SimpleNamespace(enabled=False)
        self.lora_manager = None
        self.prefill_attention_backend_str = "torch_native"
        self.forward_pass_id = 0
        self.msprobe_debugger = None
        self.canary_manager = None
        self.enable_elastic_ep = False
        self.decode_cuda_graph_runner = None
        self.eplb_manager = None
        self.update_weights(seed=11)
        self.bias_E = torch.linspace(-0.3, 0.3, E)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update_weights(self, seed: int) -> None:
        """New router weights (a weight update: the same tokens route differently afterwards)."""
        self.gate_LDE = torch.randn(L, D, E, generator=torch.Generator().manual_seed(seed))

    def _forward_raw(self, forward_batch: ForwardBatch, *args: Any) -> ModelRunnerOutput:
        num_rows = int(forward_batch.positions.shape[0])
        hidden_ND = torch.randn(num_rows, D, generator=torch.Generator().manual_seed(5))
        for layer in range(L):
            # layer 1 routes DeepSeek-V3 style (biased grouped sigmoid), the others softmax top-k
            config = TopKConfig(top_k=K, renormalize=True, torch_native=True)
            if layer == 1:
                config = TopKConfig(
                    top_k=K,
                    renormalize=True,
                    use_grouped_topk=True,
                    num_expert_group=4,
                    topk_group=2,
                    scoring_func="sigmoid",
                    torch_native=True,
                )
                config.correction_bias = self.bias_E
            out = select_experts(hidden_ND, hidden_ND @ self.gate_LDE[layer], config, layer_id=layer)
            self.seen[layer] = (out.topk_ids.clone(), out.topk_weights.clone())
        return ModelRunnerOutput(logits_output=None, can_run_graph=False)


class Engine:
    """SGLang's pools, capturer and a stand-in runner for one CPU process."""

    def __init__(self, model_config: ModelConfig) -> None:
        from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer

        self.model_config = model_config
        self.pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(SLOTS, torch.float16, "cpu", None, need_sort=False)
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=True, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=1
            )
        )
        self.capturer = RoutedExpertsCapturer(
            self.model_config, num_tokens=SLOTS, max_running_requests=4, num_fused_shared_experts=0, device="cpu"
        )
        set_global_experts_capturer(self.capturer)
        self.runner = Runner(self.model_config, self.pool, self.allocator)
        self.scheduler = SimpleNamespace(
            server_args=SimpleNamespace(),
            model_config=self.model_config,
            disaggregation_mode=DisaggregationMode.NULL,
            waiting_queue=[],
            processed_tokens_counter=0,
            _set_or_validate_priority=lambda req: True,
            _abort_on_queued_limit=lambda req: False,
            _prefetch_kvcache=lambda req: None,
        )

    def queue(self, req: Req) -> None:
        """SGLang's `Scheduler._add_request_to_queue` (hooked) on the stand-in scheduler."""
        Scheduler._add_request_to_queue(self.scheduler, req)
        assert self.scheduler.waiting_queue[-1] is req

    def extend(self, reqs: list[Req]) -> ScheduleBatch:
        """An EXTEND batch of whole prompts, as the scheduler's PrefillAdder admits them."""
        for req in reqs:
            req.init_next_round_input(self.tree_cache)
            req.extend_end = len(req.full_untruncated_fill_ids)
        batch = ScheduleBatch.init_new(
            reqs, self.pool, self.allocator, self.tree_cache, self.model_config, False, SpeculativeAlgorithm.NONE
        )
        batch.prepare_for_extend()
        return batch

    def forward(self, batch: ScheduleBatch) -> ForwardBatch:
        """`ForwardBatch.init_new` and `ModelRunner.forward`, both SGLang's (and hooked)."""
        forward_batch = ForwardBatch.init_new(batch, self.runner, return_hidden_states_before_norm=False)
        ModelRunner.forward(self.runner, forward_batch)
        return forward_batch

    def retract(self, req: Req) -> None:
        """SGLang's own retraction (`retract_all` -> `release_req` -> `Req.reset_for_retract`)."""
        from sglang.srt.managers import schedule_batch

        schedule_batch.retract_all(
            reqs=[req],
            req_to_token_pool=self.pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache,
            hisparse_coordinator=None,
        )
        assert req.is_retracted and req.kv.req_pool_idx is None

    def routed(self) -> np.ndarray:
        """The expert ids `select_experts` returned in the last forward, (N, L, K)."""
        return torch.stack([self.runner.seen[layer][0] for layer in range(L)], dim=1).numpy()

    def captured(self, req: Req) -> np.ndarray:
        """What SGLang's capturer holds for the request's prompt rows (what it returns at finish)."""
        rows_NLK = self.capturer.get_topk(
            req_pool_idx=int(req.kv.req_pool_idx), seqlen=req.seqlen + 1, req_to_token_pool=self.pool
        )
        return np.asarray(rows_NLK)


def prompt_request(rid: str, prompt: list[int], forced: RouteTrace | None) -> Req:
    custom = {CUSTOM_KEY: encode_forced(forced)} if forced is not None else None
    return Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=4, custom_params=custom))


def other_sets(live_NLK: np.ndarray, seed: int) -> np.ndarray:
    """For each (row, layer) K distinct experts that are not the live set."""
    generator = np.random.default_rng(seed)
    out_NLK = np.empty_like(live_NLK)
    for index in np.ndindex(*live_NLK.shape[:2]):
        while True:
            pick = generator.choice(E, size=K, replace=False)
            if set(pick.tolist()) != set(live_NLK[index].tolist()):
                out_NLK[index] = pick
                break
    return out_NLK


def as_sets(rows: np.ndarray) -> np.ndarray:
    return np.sort(rows, axis=-1)


@pytest.fixture
def engine(model_config: ModelConfig, published_sync: Any, cpu_host_buffers: None) -> Engine:
    return Engine(model_config)


def test_forced_rows_reach_select_experts_through_sglangs_own_forward(engine: Engine, plugin: SGLangPlugin) -> None:
    prompt_a, prompt_b = [3, 4, 5, 6, 7, 8], [9, 10, 11, 12]
    a_live, b = prompt_request("a", prompt_a, None), prompt_request("b", prompt_b, None)
    batch = engine.extend([a_live, b])
    live_fb = engine.forward(batch)
    assert getattr(live_fb, BATCH_ATTR, None) is None, "no request forces: the forward is not touched"
    live = {layer: (ids.clone(), weights.clone()) for layer, (ids, weights) in engine.runner.seen.items()}
    live_NLK = torch.stack([live[layer][0] for layer in range(L)], dim=1).numpy()

    # request a forces its positions 1..4 (position 2 of layer... every layer; position 3 stays live: a -1 row)
    forced_TLK = other_sets(live_NLK[1:5], seed=3).astype(np.int16)
    forced_TLK[2] = -1
    trace = RouteTrace(forced_TLK, E, tuple(range(L)), start=1)
    a = prompt_request("a", prompt_a, trace)
    engine.queue(a)
    engine.queue(b)
    assert getattr(a, REQ_ATTR, None) is not None and getattr(b, REQ_ATTR, None) is None
    batch.reqs[0] = a  # the same batch (same slots, same host fields), now holding the forcing request
    forced_fb = engine.forward(batch)
    assert getattr(forced_fb, BATCH_ATTR).requests == ("a",)

    forced_rows = [1, 2, 4]  # batch rows of a's positions 1, 2, 4 (a is first in the batch)
    others = [n for n in range(len(prompt_a) + len(prompt_b)) if n not in forced_rows]
    for layer in range(L):
        ids_NK, weights_NK = engine.runner.seen[layer]
        live_ids_NK, live_weights_NK = live[layer]
        assert torch.equal(ids_NK[others], live_ids_NK[others]), f"layer {layer}: an unforced row changed"
        assert torch.equal(weights_NK[others], live_weights_NK[others]), f"layer {layer}: an unforced weight changed"
        for row, position in zip(forced_rows, (1, 2, 4), strict=True):
            assert set(ids_NK[row].tolist()) == set(forced_TLK[position - 1, layer].tolist())
    stats = plugin.forcing.stats
    assert (stats.forwards_forced, stats.rows_forced, stats.layers_unforced) == (1, 3 * L, 0)

    # SGLang's own capture holds the forced sets on the forced rows (read through the KV slots the batch
    # allocated, recorded on the request it was built with)
    captured_NLK = engine.captured(a_live)
    want_NLK = live_NLK[: len(prompt_a)].copy()
    want_NLK[[1, 2, 4]] = forced_TLK[[0, 1, 3]]
    np.testing.assert_array_equal(as_sets(captured_NLK[: len(prompt_a)]), as_sets(want_NLK))


def test_prefill_cuda_graph_is_refused_for_a_forced_forward(engine: Engine, plugin: SGLangPlugin) -> None:
    """`PrefillCudaGraphRunner.can_run_graph` (SGLang's, with its local checks passing) says False for a forward
    with forced rows and keeps its own answer otherwise."""
    trace = RouteTrace(np.array([[[0, 1]] * L], dtype=np.int16), E, tuple(range(L)), start=0)
    a, b = prompt_request("a", [3, 4, 5], trace), prompt_request("b", [6, 7], None)
    engine.queue(a)
    engine.queue(b)
    graph_runner = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
    graph_runner.max_context_size = graph_runner.max_seq_len = None
    graph_runner.enable_lora = False
    graph_runner._has_inactive_dp_rank = lambda forward_batch: False
    graph_runner.can_replay_locally = lambda **checks: True

    forced = ForwardBatch.init_new(engine.extend([a]), engine.runner, return_hidden_states_before_norm=False)
    plain = ForwardBatch.init_new(engine.extend([b]), engine.runner, return_hidden_states_before_norm=False)
    assert getattr(forced, BATCH_ATTR, None) is not None
    for forward_batch in (forced, plain):  # SGLang copies the ids to the device after init_new (resolve_forward_inputs)
        forward_batch.input_ids = torch.zeros(forward_batch.extend_num_tokens, dtype=torch.int64)
    assert PrefillCudaGraphRunner.can_run_graph(graph_runner, forced) is False
    assert PrefillCudaGraphRunner.can_run_graph(graph_runner, plain) is True


PROMPT = [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    ("plugin_env", "custom", "forced"),
    [
        ({}, {REPREFILL_KEY: True}, True),  # the request asks
        ({REPREFILL_ENV: "1"}, None, True),  # the server's default
        ({REPREFILL_ENV: "1"}, {REPREFILL_KEY: False}, False),  # the request declines the server's default
        ({}, None, False),  # off by default
    ],
)
def test_reprefill_after_retraction_is_forced_with_the_sampling_time_rows(
    engine: Engine, plugin: SGLangPlugin, custom: dict[str, Any] | None, forced: bool
) -> None:
    """A request is prefilled, samples a token, is retracted, the router weights change (Miles retracts around
    weight updates), and it is prefilled again: forced, the rows the re-prefill computes are the kept rows."""
    req = Req(
        "r", "", array("q", PROMPT), SamplingParams(max_new_tokens=8, custom_params=custom), return_routed_experts=True
    )
    engine.queue(req)
    engine.forward(engine.extend([req]))  # rows 0..5 computed
    first_NLK = engine.routed()
    req.output_ids.append(40)  # the token sampled from row 5
    req.kv.kv_committed_len = len(PROMPT)
    engine.retract(req)
    kept = plugin.retraction.sampling_rows(req)
    assert kept is not None and (kept.start, kept.end) == (0, len(PROMPT))
    np.testing.assert_array_equal(as_sets(kept.rows_NLK.numpy()), as_sets(first_NLK))

    engine.runner.update_weights(seed=12)
    engine.forward(engine.extend([req]))  # the re-prefill: rows 0..6
    again_NLK = engine.routed()
    assert again_NLK.shape[0] == len(PROMPT) + 1
    if forced:
        np.testing.assert_array_equal(as_sets(again_NLK[: len(PROMPT)]), as_sets(kept.rows_NLK.numpy()))
        assert plugin.forcing.stats.reprefills_forced == 1
    else:
        assert (as_sets(again_NLK[: len(PROMPT)]) != as_sets(kept.rows_NLK.numpy())).any(), "the weights changed"
        assert plugin.forcing.stats.reprefills_forced == 0


def test_a_bad_server_reprefill_setting_is_refused_at_start_up(
    hook_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routereplay.engines.sglang.forcing import install

    monkeypatch.setenv(REPREFILL_ENV, "yes please")
    with pytest.raises(ForcedRoutesError, match=f"{REPREFILL_ENV}='yes please': set it to 1"):
        install(hook_registry)


def test_a_bad_request_reprefill_flag_is_refused_by_name(engine: Engine, plugin: SGLangPlugin) -> None:
    req = Req("r", "", array("q", PROMPT), SamplingParams(custom_params={REPREFILL_KEY: "maybe"}))
    engine.queue(req)
    assert req.to_finish is not None and REPREFILL_KEY in str(req.to_finish.message)
    assert plugin.forcing.stats.requests_refused == 1


def test_layers_that_cannot_be_forced_refuse_forced_requests_by_name(engine: Engine, plugin: SGLangPlugin) -> None:
    """The start-up scan (the hook AFTER `ModelRunner.__init__`) over SGLang's own `TopK` modules, as a model holds
    them; a forced request is then refused by name in the scheduler. `ModelRunner.__init__` itself does not run on
    this CPU (it loads the model: docs/sglang.md, "A live SGLang on CPU"), so the hook is called with the runner's
    `model` as `__init__` leaves it."""
    from sglang.srt.layers.moe.topk import TopK

    def own_routing(hidden_states, gating_output, topk, renormalize):  # type: ignore[no-untyped-def]
        return torch.topk(gating_output.softmax(-1), topk)

    model = torch.nn.ModuleList(
        [
            TopK(K, layer_id=0),
            TopK(K, layer_id=1, custom_routing_function=own_routing),
            TopK(K, layer_id=2, scoring_func="sqrtsoftplus"),
        ]
    )
    plugin.forcing.scanned_model(None, SimpleNamespace(model=model, is_draft_worker=False))
    assert sorted(plugin.forcing.refused_layers) == [1, 2]

    forced = prompt_request("a", PROMPT, RouteTrace(np.array([[[0, 1]] * L], dtype=np.int16), E, tuple(range(L))))
    engine.queue(forced)
    message = str(forced.to_finish.message)
    assert "cannot force routes" in message and "layer 1: the custom routing function" in message
    assert "layer 2: scoring 'sqrtsoftplus'" in message
    assert getattr(forced, REQ_ATTR, None) is None and plugin.forcing.stats.requests_refused == 1


def test_the_model_files_named_as_own_capture_sites_capture_routes_in_sglang() -> None:
    """The list is SGLang's truth, not ours: each module named in `OWN_CAPTURE_SITES` exists in the installed SGLang
    and calls the routed-experts capturer itself (the capturer, or topk's `capture_routed_experts_if_allowed` from a
    site of its own); and `topk.py` (where the hook sits) is not among them."""
    import importlib.util
    from pathlib import Path

    from routereplay.engines.sglang.forcing.hooks import OWN_CAPTURE_SITES

    for name in OWN_CAPTURE_SITES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{name} is not in this SGLang"
        source = Path(spec.origin).read_text(encoding="utf-8")
        captures = "capture_routed_experts_if_allowed(" in source or (
            "get_global_experts_capturer" in source and ".capture(" in source
        )
        assert captures, f"{name} captures no routes of its own"
    assert "sglang.srt.layers.moe.topk" not in OWN_CAPTURE_SITES


def test_a_model_with_its_own_capture_site_refuses_forced_requests_by_name(
    engine: Engine, plugin: SGLangPlugin
) -> None:
    """A model built from a class of an own-capture-site file (here a module whose class lives in
    `sglang.srt.models.llada2`) is found by the start-up scan, and a forced request is refused naming it; a model
    without one refuses nothing."""
    import sglang.srt.models.llada2 as llada2

    own = next(
        cls
        for cls in vars(llada2).values()
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == llada2.__name__
    )
    holder = torch.nn.Module()
    holder.add_module("layer", torch.nn.Module.__new__(own))  # the class is what the scan reads; no weights built
    torch.nn.Module.__init__(holder.layer)
    plugin.forcing.scanned_model(None, SimpleNamespace(model=torch.nn.ModuleList([holder]), is_draft_worker=False))
    assert plugin.forcing.refused_model == ["model LLaDA2 (models/llada2.py captures its routes itself)"]

    forced = prompt_request("a", PROMPT, RouteTrace(np.array([[[0, 1]] * L], dtype=np.int16), E, tuple(range(L))))
    engine.queue(forced)
    assert "cannot force routes" in str(forced.to_finish.message)
    assert "LLaDA2" in str(forced.to_finish.message) and plugin.forcing.stats.requests_refused == 1

    plugin.forcing.scanned_model(None, SimpleNamespace(model=torch.nn.ModuleList([torch.nn.Linear(2, 2)])))
    assert plugin.forcing.refused_model == []
