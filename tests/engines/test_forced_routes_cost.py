"""What a forced-routes blob costs the vLLM front end and worker, before it is refused or while it is used.

Defects guarded against: a ~100-byte blob encoded for another model was decoded (that model's set-mode
tables built: 11-13 ms and 16.5 MiB for E=32767, K=2, measured on one shared AMD EPYC core) before its
geometry was compared with the served model's; and the worker widened every forced request's rows to
int64 (4x the int16 decode) from parse to the routing step.
"""

from __future__ import annotations

import base64
import tracemalloc
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from routereplay import codec
from routereplay.engines.vllm import forced_routes
from routereplay.engines.vllm.forced_routes import XARG_KEY, ForcedRoutes, ServedRouting, encode_forced
from routereplay.engines.vllm.forcing import LayerForcing, RoutingMethod, RoutingRule
from routereplay.engines.vllm.forcing.worker import ForcingWorker
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace

SERVED = ServedRouting(num_experts=128, top_k=8, num_layers=4, moe_layers=(1, 2, 3))
PROMPT = list(range(1000, 1300))


def routes(rows: int, experts: int, top_k: int, layers: tuple[int, ...], seed: int = 0, start: int = 0) -> RouteTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(experts, top_k, replace=False) for _ in layers] for _ in range(rows)])
    return RouteTrace(ids.astype(np.int16 if experts <= 32767 else np.int32), experts, layers, start=start)


def text(trace: RouteTrace, mode: str = "set") -> str:
    return base64.b64encode(codec.encode(trace, mode=mode)).decode()


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (routes(1, 32767, 2, (1,)), r"the trace has E=32767, K=2; the served model routes E=128, K=8"),
        (routes(1, 4096, 4, (1, 2, 3)), r"the trace has E=4096, K=4"),
        (routes(2, 128, 8, (0, 1)), r"the trace has layers \[0, 1\]; the served model's MoE layers are \[1, 2, 3\]"),
        (routes(2, 128, 8, (1, 2, 3), start=299), r"covers positions 299\.\.300 but the prompt has 300 tokens"),
    ],
)
def test_a_blob_for_another_model_is_refused_from_its_header_without_decoding(
    other: RouteTrace, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob_text = text(other)
    assert len(base64.b64decode(blob_text)) < 160
    decoded: list[Any] = []
    monkeypatch.setattr(forced_routes.codec, "decode", lambda *a, **k: decoded.append(a))
    tracemalloc.start()
    try:
        with pytest.raises(ForcedRoutesError, match=message):
            ForcedRoutes.parse(blob_text, SERVED, PROMPT, where="request 'r9'")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert decoded == [] and peak < 256 << 10  # was 16 MiB for E=32767, K=2: the set-mode tables


def test_a_damaged_blob_is_named_damaged_even_when_its_header_does_not_fit() -> None:
    """The header is read without the CRC pass; a header that does not fit is CRC-checked before it is named."""
    blob = bytearray(codec.encode(routes(2, 128, 8, (1, 2, 3))))
    blob[22] ^= 0x01  # E: 128 -> 129 (offset 22, u32), CRC left as it was
    with pytest.raises(ForcedRoutesError, match="not a valid codec blob: .*CRC32"):
        ForcedRoutes.parse(base64.b64encode(bytes(blob)).decode(), SERVED, PROMPT, where="r")


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_checked_rows_keep_the_traces_int16(mode: str) -> None:
    trace = routes(40, 128, 8, (1, 2, 3), start=10)
    plan = ForcedRoutes.parse(text(trace, mode), SERVED, PROMPT, where="r")
    assert plan.experts_TLK.dtype == np.int16 and plan.experts_TLK.shape == (40, 3, 8)
    assert np.array_equal(np.sort(plan.experts_TLK, -1), np.sort(trace.experts, -1))
    checked = ForcedRoutes.check(trace, SERVED, PROMPT, where="r")
    assert checked.experts_TLK.dtype == np.int16 and not np.shares_memory(checked.experts_TLK, trace.experts)
    wide = routes(3, 40000, 2, (1, 2, 3))
    served = ServedRouting(num_experts=40000, top_k=2, num_layers=4, moe_layers=(1, 2, 3))
    assert ForcedRoutes.parse(text(wide), served, PROMPT, where="r").experts_TLK.dtype == np.int32


def test_int16_ids_weigh_as_int64_ids() -> None:
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    experts = torch.stack([torch.randperm(128, generator=torch.Generator().manual_seed(i))[:8] for i in range(6)])
    for rule in (
        RoutingRule(RoutingMethod.SOFTMAX_TOPK, True),
        RoutingRule(RoutingMethod.SCORED_TOPK, True, "sigmoid"),
    ):
        assert torch.equal(rule.weights(logits, experts.to(torch.int16)), rule.weights(logits, experts))


class CPURouter:
    """A stand-in with vLLM's CPURouter name and attributes, routing every row to experts 0..7."""

    eplb_state = None
    scoring_func, renormalize, use_grouped_topk, custom_routing_function = "softmax", True, False, None

    def _compute_routing(self, hidden: torch.Tensor, logits: torch.Tensor, indices_type: object, **kw: object):
        rows = logits.shape[0]
        return torch.full((rows, 8), 1 / 8), torch.arange(8, dtype=torch.int32).repeat(rows, 1)


def test_the_worker_keeps_int16_rows_up_to_the_routing_step() -> None:
    """Two requests, one forced from position 10: each step's StepRows hold int16 ids, and the router
    dispatches exactly the forced sets on the forced rows (the live ones elsewhere)."""
    layers = {}
    for layer in SERVED.moe_layers:
        layers[layer] = LayerForcing.of(layer, CPURouter())
        layers[layer].install()
    worker = ForcingWorker(layers, SERVED, model_id=0)
    trace = routes(40, 128, 8, SERVED.moe_layers, start=10)
    forced = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={XARG_KEY: encode_forced(trace)}),
                             prompt_token_ids=PROMPT)  # fmt: skip
    live = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None), prompt_token_ids=PROMPT)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=2, req_ids=["live", "forced"]),
        requests={"live": live, "forced": forced},
        query_start_loc=SimpleNamespace(np=np.array([0, 4, 12])),
    )
    positions = torch.tensor([0, 1, 2, 3, 6, 8, 10, 11, 12, 48, 49, 50])  # forced: positions 10..49
    assert worker.begin_step(runner, positions)
    step = layers[2].step
    assert step is not None and step.experts_NK.dtype == torch.int16
    assert step.rows_N.tolist() == [6, 7, 8, 9, 10]
    logits = torch.randn(12, 128)
    _, ids = layers[2].router._compute_routing(torch.zeros(12, 4), logits, None)
    want = np.sort(trace.experts[[0, 1, 2, 38, 39], 1], -1)
    assert np.array_equal(np.sort(ids[6:11].numpy(), -1), want) and (ids[:6] == torch.arange(8)).all()
    worker.end_step()
    assert worker.counters()["forced_rows"] == 5  # layer 2 routed this step (the others were not called)
