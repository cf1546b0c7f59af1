"""verl's rollout routes, decoded and merged: `RouteGeometry` and `RolloutRoutes`.

verl 0.9.1 hands the agent loop whatever the engine returned: vLLM's in-process
`CompletionOutput.routed_experts` ndarray (`vllm_async_server.py` l.716-756: every hidden layer, dense
layers zero-filled, `num_tokens - 1` rows), or SGLang's (`async_sglang_server.py` l.641-700). It keeps
only the last call's array in a multi-turn loop (`tool_agent_loop.py` l.286), appends
`routed_experts[-len(token_ids):]` on a partial-rollout resume (`llm_server.py` l.308-313, no record of
which weights routed which rows), and pads with zeros that mean "no route"
(`agent_loop.py` l.783-809).

`RolloutRoutes` replaces that bookkeeping. Each engine call is decoded with `decode_vllm` /
`decode_sglang` (every wire form those accept: the in-process ndarray, `TokenOutput`, an HTTP response,
base64 `.npy`, SGLang's raw base64) into a `RouteTrace` of the model's MoE layers only (dense layers
dropped by global layer number), with the call's token ids attached, and added to a `RouteStore` by
absolute token position (`add_turn`): tool-response tokens and each sequence's last token stay -1
rows, a resumed call merges under `policy="keep"` (the rows used when each token was sampled) with
its policy version in the provenance, and a re-sent prefix concatenated twice (verl #6029) is refused
(`DuplicatedPrefixError`). Nothing is ever sliced off an array by count.

`routereplay.integrations.verl.batch` puts the merged traces on verl's batch.

Legend: T = rows of one engine call (tokens fed), N = tokens of a sample, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.engines.vllm.forced_routes import moe_layers_of
from routereplay.enums import CodecMode, StrEnum
from routereplay.errors import ConfigError
from routereplay.store.route_store import RouteStore
from routereplay.store.sample import SampleId
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

MAX_TOKEN_ID = 2**31  # token ids are ints in [0, 2**31): what a trainer's int32 / int64 input ids hold


def checked_token_ids(token_ids: Sequence[int] | np.ndarray, sample_id: SampleId | None) -> np.ndarray:
    """A sample's token ids as int64 (N,): a non-empty 1-D sequence of ints in [0, 2**31), else `ConfigError`."""
    try:
        ids_N = np.asarray(token_ids)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"sample {sample_id!r}: token_ids are not a sequence of ints ({error})") from None
    if ids_N.ndim != 1 or ids_N.size == 0 or ids_N.dtype.kind not in "iu":
        raise ConfigError(
            f"sample {sample_id!r}: token_ids must be a non-empty 1-D sequence of ints, got {ids_N.dtype} of shape "
            f"{ids_N.shape}"
        )
    if int(ids_N.min()) < 0 or int(ids_N.max()) >= MAX_TOKEN_ID:
        raise ConfigError(
            f"sample {sample_id!r}: token ids must lie in [0, 2**31), got {int(ids_N.min())}..{int(ids_N.max())}"
        )
    return ids_N.astype(np.int64, copy=False)


class Engine(StrEnum):
    """Which rollout engine produced a call's routes (verl 0.9.1 serves both)."""

    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteGeometry:
    """The routed model as the engine reports it: every hidden layer on the wire, MoE layers kept.

    `num_layers` is the payload's layer axis (the model's `num_hidden_layers`: vLLM and SGLang report
    dense layers too, zero-filled); `moe_layers` the global numbers of the layers with a router.
    """

    num_experts: int
    num_layers: int
    top_k: int
    moe_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"RouteGeometry.{name}={value!r} must be a positive int (from the model's config)")
        given = self.moe_layers
        if (
            isinstance(given, (str, bytes))
            or not isinstance(given, (list, tuple, range))
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in given)
        ):
            raise ConfigError(
                f"RouteGeometry.moe_layers={given!r} must be a sequence of int global layer numbers; take them from "
                "the config (RouteGeometry.from_hf_config)"
            )
        layers = tuple(int(x) for x in given)
        if not layers or sorted(set(layers)) != list(layers) or not 0 <= layers[0] <= layers[-1] < self.num_layers:
            raise ConfigError(
                f"RouteGeometry.moe_layers={list(self.moe_layers)} must be distinct, ascending global layer numbers in "
                f"[0, num_layers={self.num_layers}); take them from the config (RouteGeometry.from_hf_config)"
            )
        object.__setattr__(self, "moe_layers", layers)
        if self.top_k > self.num_experts:
            raise ConfigError(f"RouteGeometry.top_k={self.top_k} exceeds num_experts={self.num_experts}")

    @classmethod
    def from_hf_config(cls, config: Any) -> RouteGeometry:
        """From an HF config: `num_hidden_layers`, the experts count, `num_experts_per_tok`, and the MoE layers
        its own fields name (`mlp_only_layers`, `decoder_sparse_step`, `first_k_dense_replace`, `moe_layer_freq`)."""
        text = getattr(config, "text_config", None) or config
        names = ("num_experts", "num_local_experts", "n_routed_experts")
        experts = next((getattr(text, n) for n in names if getattr(text, n, None)), None)
        top_k = getattr(text, "num_experts_per_tok", None)
        if experts is None or top_k is None:
            raise ConfigError(
                f"{type(config).__name__} names no experts count (num_experts / num_local_experts / n_routed_experts) "
                "or no num_experts_per_tok: not an MoE config; build RouteGeometry(...) by hand"
            )
        num_layers = int(text.num_hidden_layers)
        return cls(
            num_experts=int(experts),
            num_layers=num_layers,
            top_k=int(top_k),
            moe_layers=moe_layers_of(text, num_layers),
        )


class RolloutRoutes:
    """Every rollout sample's routes, decoded per engine call and merged in a `RouteStore`.

    Call `add_call` once per engine call with the sample's FULL token ids after it (prompt, every turn,
    tool tokens, the call's output), and `add_tokens` when tokens no engine routed join the sequence
    (a tool response). `trace(sample_id)` is the merged `RouteTrace` over rows [0, N - 1).
    """

    def __init__(self, geometry: RouteGeometry, *, codec_mode: CodecMode | str = CodecMode.SET) -> None:
        if not isinstance(geometry, RouteGeometry):
            raise ConfigError(f"geometry must be a RouteGeometry, got {type(geometry).__name__}")
        self.geometry = geometry
        self.store = RouteStore(
            num_experts=geometry.num_experts, layers=geometry.moe_layers, top_k=geometry.top_k, codec_mode=codec_mode
        )

    def decode(
        self,
        routes: Any,
        token_ids: Sequence[int] | np.ndarray,
        *,
        engine: Engine | str = Engine.VLLM,
        start: int = 0,
        policy_version: int | None = None,
        sample_id: SampleId | None = None,
    ) -> RouteTrace:
        """One engine call's routes as a `RouteTrace` of the MoE layers, naming the tokens it routed.

        `routes` is any form the engine's decoder reads; `token_ids` the sequence the call saw plus what
        it generated (its rows are positions [start, len(token_ids) - 1)); `start` is vLLM's
        `routed_experts_prompt_start` / SGLang's `routed_experts_start_len` when the request set one.
        """
        try:
            engine = Engine(engine)
        except ValueError:
            raise ConfigError(f"engine={engine!r} is not one verl serves; use 'vllm' or 'sglang'") from None
        ids_N = checked_token_ids(token_ids, sample_id)
        g = self.geometry
        common: dict[str, Any] = {
            "num_experts": g.num_experts,
            "moe_layers": g.moe_layers,
            "num_layers": g.num_layers,
            "top_k": g.top_k,
            "num_tokens": len(ids_N),
            "sequence": sample_id,
            "policy_version": policy_version,
        }
        if engine is Engine.VLLM:
            trace = decode_vllm(routes, prompt_start=start, **common)
        else:
            trace = decode_sglang(routes, start_len=start, **common)
        return trace.with_token_ids(ids_N[trace.start : trace.stop])

    def add_call(
        self,
        sample_id: SampleId,
        token_ids: Sequence[int] | np.ndarray,
        routes: Any,
        *,
        engine: Engine | str = Engine.VLLM,
        start: int = 0,
        policy_version: int | None = None,
        policy: MergePolicy | str = MergePolicy.KEEP,
    ) -> RouteTrace:
        """Decode one engine call's routes and merge them into the sample by token position; returns the
        call's trace. `token_ids` is the sample's full sequence after the call; `policy` says which rows win
        where a resumed call re-routes stored positions ("keep": those used when the token was sampled)."""
        trace = self.decode(
            routes, token_ids, engine=engine, start=start, policy_version=policy_version, sample_id=sample_id
        )
        self.store.add_turn(sample_id, token_ids, trace, policy=policy, policy_version=policy_version)
        return trace

    def add_tokens(self, sample_id: SampleId, token_ids: Sequence[int] | np.ndarray) -> None:
        """Tokens no engine routed joined the sample (a tool response): `token_ids` is its full sequence now.
        Their rows stay -1, so replay falls back to the live router there (counted)."""
        self.store.add_turn(sample_id, checked_token_ids(token_ids, sample_id), None)

    def trace(self, sample_id: SampleId) -> RouteTrace:
        """The sample's merged routes over rows [0, N - 1), -1 where no call routed the token, token ids named."""
        return self.store.trace(sample_id)

    def traces(self, sample_ids: Sequence[SampleId]) -> list[RouteTrace]:
        return [self.store.trace(sample_id) for sample_id in sample_ids]

    def tokens(self, sample_id: SampleId) -> list[int]:
        return self.store.tokens(sample_id)


__all__ = ["Engine", "RolloutRoutes", "RouteGeometry"]
