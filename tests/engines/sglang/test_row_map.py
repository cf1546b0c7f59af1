"""Rows of SGLang 0.5.23 forwards mapped to (request, position) from its own `Req` / `ScheduleBatch` host fields,
through the plugin's scheduler hooks: chunked prefill, prefix-cache hits, mixed forced / unforced / decoding batches,
retraction (`Req.reset_for_retract`) and re-prefill; bad blobs refused by name at the front end and the scheduler.

Legend: N = token rows of a forward, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang.srt.managers.schedule_batch")

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from routereplay.engines.sglang.forcing import CUSTOM_KEY, SGLangForcing, step_rows
from routereplay.engines.sglang.forcing.hooks import BATCH_ATTR, REQ_ATTR
from routereplay.engines.vllm.forced_routes import encode_forced
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace
from tests.engines.sglang.tiny_model import tiny_qwen3_moe_config

E, K, LAYERS = 8, 2, (0, 1, 2)
CONFIG = tiny_qwen3_moe_config()


def routes(rows: int, *, start: int = 0, seed: int = 0) -> RouteTrace:
    generator = np.random.default_rng(seed)
    experts_TLK = np.argsort(generator.random((rows, len(LAYERS), E)), axis=-1)[:, :, :K].astype(np.int16)
    return RouteTrace(experts_TLK, E, LAYERS, start=start)


def request(rid: str, prompt: list[int], forced: RouteTrace | None) -> Req:
    custom = {CUSTOM_KEY: encode_forced(forced)} if forced is not None else None
    return Req(rid, "", array("q", prompt), SamplingParams(custom_params=custom))


def scheduler(**server: object) -> SimpleNamespace:
    return SimpleNamespace(server_args=SimpleNamespace(**server), model_config=SimpleNamespace(hf_text_config=CONFIG))


def queued(forcing: SGLangForcing, *reqs: Req) -> None:
    for req in reqs:
        forcing.queued(scheduler(), req)


def forward(forcing: SGLangForcing, mode: ForwardMode, reqs: list[Req], prefix: list[int], extend: list[int]):
    batch = ScheduleBatch(reqs=reqs, forward_mode=mode, prefix_lens=prefix, extend_lens=extend)
    result = SimpleNamespace()
    forcing.mapped_batch(result, ScheduleBatch, batch, SimpleNamespace(device="cpu"))
    return getattr(result, BATCH_ATTR, None)


def forced_rows(batch) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """(mask_NL, forced_NLK) of a ForcedBatch."""
    return batch.mask_LN.numpy().T, batch.forced_LNK.numpy().transpose(1, 0, 2)


def test_chunked_prefill_forces_each_chunk_at_its_positions() -> None:
    forcing = SGLangForcing()
    trace = routes(10)
    a = request("a", list(range(1, 11)), trace)
    queued(forcing, a)
    for prefix, extend in ((0, 6), (6, 4)):
        mask_NL, forced_NLK = forced_rows(forward(forcing, ForwardMode.EXTEND, [a], [prefix], [extend]))
        assert mask_NL.all()
        assert np.array_equal(forced_NLK, trace.experts[prefix : prefix + extend])


def test_mixed_batch_prefix_hit_unforced_and_decoding_requests() -> None:
    forcing = SGLangForcing()
    trace = routes(6, start=2, seed=1)  # forces positions 2..7 of a 10-token prompt
    a = request("a", list(range(1, 11)), trace)
    b = request("b", list(range(20, 25)), None)
    c = request("c", list(range(30, 34)), routes(4, seed=2))  # decoding: its one row is a new token
    queued(forcing, a, b, c)
    # a: prefix-cache hit of 3 tokens, extends 7 (positions 3..9); b: 5 rows; c: one decode row at position 6
    batch = forward(forcing, ForwardMode.MIXED, [a, b, c], [3, 0, 6], [7, 5, 1])
    mask_NL, forced_NLK = forced_rows(batch)
    assert mask_NL.shape == (13, len(LAYERS))
    want_N = np.zeros(13, dtype=bool)
    want_N[0:5] = True  # a's positions 3..7
    assert np.array_equal(mask_NL, np.repeat(want_N[:, None], len(LAYERS), axis=1))
    assert np.array_equal(forced_NLK[0:5], trace.experts[1:6])
    assert (forced_NLK[5:] == -1).all()
    assert batch.requests == ("a",)


def test_retraction_keeps_the_checked_routes_and_the_reprefill_forces_prompt_rows() -> None:
    forcing = SGLangForcing()
    trace = routes(5)
    a = request("a", [5, 6, 7, 8, 9], trace)
    queued(forcing, a)
    a.output_ids.extend([11, 12, 13])
    a.reset_for_retract()  # SGLang's own retraction
    queued(forcing, a)  # re-queued as retracted: the kept plan is reused, not re-parsed
    mask_NL, forced_NLK = forced_rows(forward(forcing, ForwardMode.EXTEND, [a], [0], [8]))
    assert mask_NL[:5].all() and not mask_NL[5:].any()
    assert np.array_equal(forced_NLK[:5], trace.experts)


def test_minus_one_rows_and_batches_without_forced_rows_route_live() -> None:
    forcing = SGLangForcing()
    trace = routes(4)
    experts = trace.experts.copy()
    experts[1] = -1
    a = request("a", [1, 2, 3, 4], RouteTrace(experts, E, LAYERS))
    queued(forcing, a)
    mask_NL, _ = forced_rows(forward(forcing, ForwardMode.EXTEND, [a], [0], [4]))
    assert mask_NL.tolist() == [[True] * 3, [False] * 3, [True] * 3, [True] * 3]
    assert forward(forcing, ForwardMode.DECODE, [a], [], []) is None
    b = request("b", [1, 2, 3], None)
    assert forward(forcing, ForwardMode.EXTEND, [b], [0], [3]) is None


def test_step_rows_by_mode() -> None:
    rows = step_rows(ForwardMode.DECODE, 2, None, None, [4, 9])
    assert rows is not None and rows.position_N.tolist() == [3, 8] and rows.request_N.tolist() == [0, 1]
    assert step_rows(ForwardMode.TARGET_VERIFY, 1, [0], [3], [3]) is None
    with pytest.raises(ForcedRoutesError, match="extend_lens has 1 entries .* for 2 request"):
        step_rows(ForwardMode.EXTEND, 2, [0, 0], [3], None)


@pytest.mark.parametrize(
    ("forced", "message"),
    [
        ("not base64!", "not base64"),
        (encode_forced(routes(9)), "only prompt positions can be forced"),
        (
            encode_forced(RouteTrace(np.zeros((2, 2, K), np.int16) + np.arange(K, dtype=np.int16), E, (0, 1))),
            "served model's MoE layers are \\[0, 1, 2\\]",
        ),
        (7, "it must be base64 text"),
    ],
)
def test_bad_blobs_are_refused_by_name_in_the_scheduler_and_the_front_end(forced: object, message: str) -> None:
    forcing = SGLangForcing()
    req = Req("bad", "", array("q", [1, 2, 3, 4]), SamplingParams(custom_params={CUSTOM_KEY: forced}))
    with get_parallel().override(tp_rank=0):  # the TP rank a scheduler process publishes
        forcing.queued(scheduler(), req)
    assert getattr(req, REQ_ATTR, None) is None
    assert req.to_finish is not None and "sampling_params.custom_params" in str(req.to_finish.message)
    assert forcing.stats.requests_refused == 1
    tokenized = SimpleNamespace(
        rid="bad",
        input_ids=array("q", [1, 2, 3, 4]),
        cache_salt=None,
        sampling_params=SamplingParams(custom_params={CUSTOM_KEY: forced}),
    )
    manager = SimpleNamespace(server_args=SimpleNamespace(), model_config=SimpleNamespace(hf_text_config=CONFIG))
    with pytest.raises(ForcedRoutesError, match=message) as caught:
        forcing.checked_tokenized(tokenized, manager, None)
    assert isinstance(caught.value, ValueError)  # what SGLang's HTTP server answers with 400
    assert tokenized.cache_salt is None


def test_front_end_salts_forced_prompts_and_refuses_server_setups_by_name() -> None:
    forcing = SGLangForcing()
    text = encode_forced(routes(3))
    config = SimpleNamespace(hf_text_config=CONFIG)
    tokenized = SimpleNamespace(
        rid="a",
        input_ids=array("q", [1, 2, 3, 4]),
        cache_salt="mine",
        sampling_params=SamplingParams(custom_params={CUSTOM_KEY: text}),
    )
    forcing.checked_tokenized(tokenized, SimpleNamespace(server_args=SimpleNamespace(), model_config=config), None)
    assert tokenized.cache_salt.startswith("mine|routereplay-forced:")
    for setting, message in (
        ({"enable_dp_attention": True}, "DP attention"),
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding"),
        ({"moe_runner_backend": "flashinfer_trtllm"}, "the MoE kernel routes itself"),
        ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend deepep"),
    ):
        manager = SimpleNamespace(server_args=SimpleNamespace(**setting), model_config=config)
        with pytest.raises(ForcedRoutesError, match=message):
            forcing.checked_tokenized(tokenized, manager, None)
    unforced = SimpleNamespace(
        rid="b", input_ids=array("q", [1]), cache_salt=tokenized.cache_salt, sampling_params=SamplingParams()
    )
    with pytest.raises(ForcedRoutesError, match="reserves for requests that force routes"):
        forcing.checked_tokenized(unforced, SimpleNamespace(server_args=SimpleNamespace(), model_config=config), None)
