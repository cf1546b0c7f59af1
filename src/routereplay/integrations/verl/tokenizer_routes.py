"""SGLang's routes on verl's SGLang server, decoded by routereplay: the verl-free half of `sglang_server`.

verl 0.9.1's `SGLangHttpServer.generate` (`verl/workers/rollout/sglang_rollout/async_sglang_server.py`
l.680-700) turns an SGLang output's `meta_info.routed_experts` into `TokenOutput.routed_experts` in two ways,
both written for SGLang 0.5.12 (verl's `sglang` extra) and both broken on SGLang 0.5.23:

- `skip_tokenizer_init=True` (verl's default): `captured.numpy()`, but 0.5.23's tokenizer manager base64-encodes
  the tensor, so `meta_info.routed_experts` is a `str` (`AttributeError: 'str' object has no attribute 'numpy'`);
- else `from sglang.srt.layers.moe.routed_experts_capturer import extract_routed_experts_from_meta_info`, a
  module 0.5.23 moved to `sglang.srt.state_capturer.routed_experts` (`ModuleNotFoundError` at the first rollout).

routereplay's server (`sglang_server.RouteReplaySGLangHttpServer`) keeps verl's `generate` and takes the routes
out of its hands: its own copy of verl's rollout config says `enable_rollout_routing_replay=False` once the
SGLang server is up (started with `--enable-return-routed-experts` as verl starts it), so verl's branch never
runs; `RouteRequestingTokenizerManager` wraps SGLang's tokenizer manager, sets `return_routed_experts` on each
`GenerateReqInput` and keeps each request's output by request id; and `routed_experts_array` decodes that
output's routes with `decode_sglang` (every SGLang form: base64 raw int32 / a tensor / an ndarray; rows, layers,
top-k and ids checked) into the array verl's agent loops expect: (num_tokens - 1, num_hidden_layers, top_k)
int32, the MoE layers' checked ids, -1 in dense layers (never 0: 0 is an expert).

`register_sglang_replica` puts `sglang_server.RouteReplaySGLangReplica` under verl's name "sglang" in verl's
`RolloutReplicaRegistry` (verl's loader runs first: it sets up what verl's SGLang module needs), so
`get_rollout_replica_class("sglang")` hands verl's rollout manager routereplay's server. Nothing here imports
verl or SGLang.

Legend: T rows (tokens fed: prompt + output - 1), A = every hidden layer, L MoE layers, K top-k.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.errors import ConfigError
from routereplay.integrations.verl.rollout import RouteGeometry, checked_token_ids
from routereplay.wire.sglang import decode_sglang

logger = logging.getLogger("routereplay.integrations.verl")

ROUTES_FIELD = "routed_experts"  # meta_info key of SGLang's /generate output
ENGINE_NAME = "sglang"  # verl's rollout.name and RolloutReplicaRegistry key
SERVER_MODULE = "routereplay.integrations.verl.sglang_server"


@dataclass(slots=True)
class SGLangRouteStats:
    """Per server: calls whose routes were decoded, and the counted fallbacks (`TokenOutput.routed_experts=None`)."""

    decoded: int = 0
    missing: int = 0  # the output had no routes (aborted before a forward pass)
    dropped: int = 0  # verl emptied the call's token_ids (logprob count mismatch): the routes name no kept tokens


def routed_experts_array(
    output: Any, prompt_ids: Sequence[int] | np.ndarray, geometry: RouteGeometry, *, request_id: str | None = None
) -> np.ndarray | None:
    """One SGLang `/generate` output's routes as verl's `TokenOutput.routed_experts`: int32 (T, A, K), T = prompt +
    `output_ids` - 1, the MoE layers checked by `decode_sglang`, -1 in dense layers. None when the output carries
    no routes (SGLang sends None for a request aborted before its first forward pass)."""
    meta = output.get("meta_info") if isinstance(output, dict) else None
    if not isinstance(meta, dict):
        raise ConfigError(
            f"request {request_id!r}: the SGLang output has no meta_info dict ({type(output).__name__}); pass the dict "
            "tokenizer_manager.generate_request yields"
        )
    if meta.get(ROUTES_FIELD) is None:
        return None
    output_ids = output.get("output_ids")
    if output_ids is None:
        raise ConfigError(
            f"request {request_id!r}: the SGLang output has no output_ids: the routes' rows cannot be tied to tokens"
        )
    tokens_N = checked_token_ids([*prompt_ids, *output_ids], request_id)
    trace = decode_sglang(
        meta,
        num_layers=geometry.num_layers,
        top_k=geometry.top_k,
        num_experts=geometry.num_experts,
        moe_layers=geometry.moe_layers,
        num_tokens=len(tokens_N),
        sequence=request_id,
    )
    experts_TAK = np.full((len(tokens_N) - 1, geometry.num_layers, geometry.top_k), -1, dtype=np.int32)
    experts_TAK[trace.start : trace.stop, list(geometry.moe_layers)] = trace.experts
    return experts_TAK


class RouteRequestingTokenizerManager:
    """SGLang's `TokenizerManager`, asking every generate request for its routes and keeping its latest output.

    `generate_request(obj, request)` sets `obj.return_routed_experts = True` and relays SGLang's outputs, keeping
    the latest per `obj.rid` until `take(rid)`; every other attribute is SGLang's manager's."""

    def __init__(self, manager: Any) -> None:
        if not hasattr(manager, "generate_request"):
            raise ConfigError(f"manager must be SGLang's TokenizerManager (generate_request), got {type(manager)}")
        object.__setattr__(self, "manager", manager)
        object.__setattr__(self, "outputs", {})

    def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        if not isinstance(getattr(obj, "rid", None), str):
            raise ConfigError(
                f"GenerateReqInput.rid={getattr(obj, 'rid', None)!r}: routereplay keys each request's routes by its "
                "one request id (verl sends one str per call)"
            )
        obj.return_routed_experts = True
        return self._relay(obj, request)

    async def _relay(self, obj: Any, request: Any) -> AsyncIterator[Any]:
        async for output in self.manager.generate_request(obj, request):
            self.outputs[obj.rid] = output
            yield output

    def take(self, rid: str) -> Any | None:
        """The latest output of request `rid` (forgotten here), or None when it sent none."""
        return self.outputs.pop(rid, None)

    def __getattr__(self, name: str) -> Any:
        if name in ("manager", "outputs"):  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.manager, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.manager, name, value)  # verl sets SGLang's own fields (server_status) on the manager


def register_sglang_replica() -> Callable[[], type]:
    """routereplay's SGLang replica under "sglang" in verl's `RolloutReplicaRegistry`; returns its loader.
    Idempotent: verl's own loader (kept) runs first, then `sglang_server` is imported (it imports SGLang)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    held = RolloutReplicaRegistry._registry.get(ENGINE_NAME)
    if held is None:
        raise ConfigError(
            "verl's RolloutReplicaRegistry has no 'sglang' loader: this verl is not 0.9.1's layout, so routereplay "
            "cannot put its SGLang server there"
        )
    if getattr(held, "routereplay_loader", False):
        return held
    verl_loader = held

    def load() -> type:
        verl_loader()  # verl's: SGLANG_USE_CPU_ENGINE while importing, vLLM stand-ins where vLLM is absent
        import importlib

        replica: type = importlib.import_module(SERVER_MODULE).RouteReplaySGLangReplica
        return replica

    load.routereplay_loader = True  # type: ignore[attr-defined]
    load.verl_loader = verl_loader  # type: ignore[attr-defined]
    RolloutReplicaRegistry.register(ENGINE_NAME, load)
    return load


__all__ = [
    "RouteRequestingTokenizerManager",
    "SGLangRouteStats",
    "register_sglang_replica",
    "routed_experts_array",
]
