"""vLLM's combine weights on a rollout's trace: taken from the in-process worker, checked against vLLM's routes.

`VLLMEngine.generate(..., capture_weights=True)` (or `EngineConfig(capture_weights=True)`) sends every
request with `extra_args[WEIGHTS_KEY] = True`: the routereplay plugin's worker keeps, for each of its
token rows, the (L, K) combine weights its MoE routers returned after forcing, beside the ids they returned,
by position (`forcing.weights`). Before the call the engine makes the worker keep at least as many finished
requests as the call sends, and checks that the call's rows fit the worker's byte limit (`reserve`; the
worker keeps no finished request's weights unless an engine reserved room, and never more than
`ROUTEREPLAY_WEIGHTS_MAX_BYTES`); after it, the engine takes them from the worker (`take`:
`collective_rpc` with a function, which reaches the runner directly in process) and puts them on each
rollout's `RouteTrace` (`weights_for`), aligned with its rows (prompt + response - 1, as its routes).

The ids kept beside the weights must equal vLLM's own routed-experts capture of the same row, in the same
order (both are what `_select_experts` handed on: the capture reads the ids the router returned, the
plugin the (weights, ids) pair): any row where they differ, and any routed row without weights, raises
`WeightsCaptureError` naming the rows, so weights never sit beside ids they do not belong to. Rows whose
route is -1 carry weights 0. On the wire (`codec`) the weights travel as float16, 2 * K bytes per
(row, layer).

Legend: T = route rows of a rollout, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.engines.vllm.forcing.weights import MAX_BYTES_ENV, RequestWeights, row_bytes
from routereplay.errors import ConfigError, WeightsCaptureError
from routereplay.trace.route_trace import RouteTrace

SHOWN_ROWS = 5  # rows named in an error message


def _take_on_worker(worker: Any, request_ids: list[str]) -> dict[str, RequestWeights]:
    from routereplay.engines.vllm.plugin import take_weights

    return take_weights(worker.model_runner, request_ids)


def _reserve_on_worker(worker: Any, count: int) -> tuple[int, int]:
    from routereplay.engines.vllm.plugin import forcing_worker

    forcing = forcing_worker(worker.model_runner)
    store = forcing.weights
    store.capacity = max(store.capacity, int(count))
    return store.max_bytes, row_bytes(len(forcing.served.moe_layers), forcing.served.top_k)


def reserve(llm: Any, count: int, rows: int) -> None:
    """Make the worker keep at least `count` finished requests' weights until taken (one call's requests), after
    checking that the call's `rows` (prompts + new tokens) fit the worker's byte limit (`ConfigError` if not,
    before anything is generated)."""
    answers = llm.collective_rpc(_reserve_on_worker, args=(int(count),))
    for max_bytes, per_row in answers:
        if int(rows) * per_row > max_bytes:
            raise ConfigError(
                f"capture_weights: this call's {int(rows)} rows (prompts + max_new_tokens) would keep "
                f"{int(rows) * per_row} bytes of combine weights ({per_row} a row), above the {max_bytes} one vLLM "
                f"worker keeps; send fewer or shorter prompts per call, or set {MAX_BYTES_ENV} higher before the "
                "engine starts"
            )


def take(llm: Any, request_ids: Sequence[str]) -> dict[str, RequestWeights]:
    """Pop the weights the in-process worker kept for these requests (by the id vLLM's output carries)."""
    answers = llm.collective_rpc(_take_on_worker, args=([str(r) for r in request_ids],))
    return dict(answers[0]) if answers else {}


def weights_for(trace: RouteTrace, kept: RequestWeights | None, where: str) -> np.ndarray:
    """The (T, L, K) float32 combine weights of `trace`'s rows from what the worker kept; `WeightsCaptureError` if
    a routed row has none, or the ids kept beside them differ from the trace's on any row (order included)."""
    experts_TLK = np.asarray(trace.experts, dtype=np.int64)
    rows = trace.num_tokens
    if trace.start != 0:
        raise WeightsCaptureError(f"{where}: the trace starts at row {trace.start}; weights are kept from position 0")
    if kept is not None and kept.dropped is not None:
        raise WeightsCaptureError(f"{where}: the worker dropped this request's combine weights: {kept.dropped}")
    have_T, ids_TLK, weights_TLK = (kept or RequestWeights()).rows(rows)
    routed_T = (experts_TLK[..., 0] >= 0).any(axis=1)  # rows vLLM routed (a -1 row has no weights to give)
    missing_T = routed_T & ~have_T
    if missing_T.any():
        shown = np.flatnonzero(missing_T)[:SHOWN_ROWS].tolist()
        raise WeightsCaptureError(
            f"{where}: {int(missing_T.sum())} of {rows} routed rows (first {shown}) have no combine weights: the "
            "worker did not see them run (a vLLM without the routereplay plugin, or rows from the prefix cache); "
            "start the engine through VLLMEngine, which registers the plugin"
        )
    if not have_T.any():
        return np.zeros(experts_TLK.shape, dtype=np.float32)
    if ids_TLK.shape[1:] != experts_TLK.shape[1:]:
        raise WeightsCaptureError(
            f"{where}: the worker kept (L, K) = {ids_TLK.shape[1:]} per row but the trace has {experts_TLK.shape[1:]} "
            f"(layers {trace.layers}); the engine's MoE layers and the plugin's differ"
        )
    routed_TL = experts_TLK[..., 0] >= 0
    differ_T = (have_T[:, None] & routed_TL & (ids_TLK != experts_TLK).any(axis=-1)).any(axis=1)
    if differ_T.any():
        t = int(np.flatnonzero(differ_T)[0])
        raise WeightsCaptureError(
            f"{where}: the ids kept beside the combine weights differ from vLLM's routed experts on "
            f"{int(differ_T.sum())} rows (first row {t}: kept {ids_TLK[t].tolist()}, vLLM {experts_TLK[t].tolist()}); "
            "the weights would sit beside other experts, so none are returned"
        )
    return np.where(experts_TLK >= 0, weights_TLK, 0).astype(np.float32)


def with_weights(trace: RouteTrace, kept: RequestWeights | None, where: str) -> RouteTrace:
    """`trace` carrying its combine weights (`weights_for`)."""
    return trace.with_weights(weights_for(trace, kept, where))


__all__ = ["reserve", "take", "weights_for", "with_weights"]
