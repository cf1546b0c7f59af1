"""SkyRL's rollout routes, decoded and merged: `RolloutRoutes`, and SkyRL's generator form out of them.

SkyRL 0.4.0's `SkyRLGymGenerator` (`train/generators/skyrl_gym_generator.py`) keeps one `RoutedExpertTrace`
per trajectory (`utils/routed_experts.py`): every turn's call asks vLLM for the rows from
`routed_experts_prompt_start` (the rows kept so far) on, and `record_generation` appends what came back,
compacted per call to the smallest dtype its largest id fits (uint8 below 256). Observation tokens get their
rows from the next call's prefill; the final observation and the last token get none, and SkyRL fills them
with dummy routes (`replay_padding_row`, experts 0..K-1) plus `router_padding_mask`.

`RolloutRoutes` does that bookkeeping with routereplay's pieces: each call's routes, in any form SkyRL or vLLM
produce (`wire_form.decode_skyrl`: the `{data, shape, dtype}` envelope, the in-process array, vLLM's HTTP
forms), are decoded into a `RouteTrace` of the MoE layers that names its tokens, and merged by absolute
token position in a `RouteStore` (`add_turn`): a tool span no call routed stays -1 rows (never expert 0),
a resumed call merges under `policy="keep"` with its policy version in the provenance, a prefix sent twice
or a call whose rows are shifted against its tokens is refused by name. Ids are held as signed ints from the
moment a call is decoded, so a uint8 turn followed by a turn with ids >= 256 keeps every id (SkyRL #1912).

Out of the merged traces:
- `generator_routes`: SkyRL's own `GeneratorOutput["rollout_expert_indices"]` (per trajectory, the captured
  prefix, every hidden layer as vLLM reports it, dense layers 0), in ONE dtype chosen from the model's expert
  count (uint8 for E <= 256, int16 up to 2**15), never from the ids a turn happened to hold. SkyRL's form has
  no "no route" value: a -1 row inside the prefix is refused (carry the compact column instead).
- `compact_column`: routereplay's codec blob per trajectory (-1 rows, token ids and provenance kept).
- `digest.route_digests`: per trajectory a digest of (token ids, generator form) that the trainer side checks
  SkyRL's packed `rollout_expert_indices` against (routereplay's trainer computes the same digests from the
  generator output itself, so a generator needs no code for it).

Token ids are checked as given, before any cast: a list of ints (not bools, floats, strings or None) or an
integer ndarray, each id in [0, 2**31) (`ConfigError` naming the sample, the argument and the position).

Legend: N = tokens of a trajectory, C = captured rows (the prefix with routes), L = every hidden layer,
M = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.codec import encode
from routereplay.enums import CodecMode
from routereplay.errors import ConfigError, MissingRoutesError
from routereplay.integrations.skyrl.wire_form import skyrl_routes
from routereplay.integrations.verl import Engine, RouteGeometry
from routereplay.integrations.verl import RolloutRoutes as EngineCallRoutes
from routereplay.integrations.verl.rollout import MAX_TOKEN_ID
from routereplay.store.sample import SampleId
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace


def route_dtype(num_experts: int) -> np.dtype[Any]:
    """The one dtype of SkyRL's route arrays for a model with `num_experts` experts: the narrowest of SkyRL's
    (uint8, int16, int32) that holds every id in [0, E), fixed for the whole run."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


class RolloutRoutes(EngineCallRoutes):
    """Every trajectory's routes, decoded per SkyRL engine call and merged in a `RouteStore` (`.store`).

    Per call: `add_generation(sample_id, prompt_token_ids, output_ids, routes, prompt_start=...)`, the
    arguments SkyRL's generator has at hand (`routes` as it came back: the response, its envelope, or
    `engine_output["rollout_expert_indices"][0]`). `add_call` takes the full token ids after the call instead,
    and `add_tokens` records tokens no call routed (the final observation). `trace(sample_id)` is the merged
    `RouteTrace` over rows [0, N - 1).
    """

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
        """One call's routes as a `RouteTrace` of the MoE layers naming its tokens; `start` is the call's
        `routed_experts_prompt_start`, `token_ids` the call's prompt plus its output."""
        if engine not in (Engine.VLLM, "vllm"):
            raise ConfigError(f"engine={engine!r}: SkyRL 0.4.0 serves routes from vLLM only; leave it 'vllm'")
        routes = skyrl_routes(routes, sequence=sample_id)
        return super().decode(
            routes, token_ids, engine=engine, start=start, policy_version=policy_version, sample_id=sample_id
        )

    def add_generation(
        self,
        sample_id: SampleId,
        prompt_token_ids: Sequence[int] | np.ndarray,
        output_ids: Sequence[int] | np.ndarray,
        routes: Any,
        *,
        prompt_start: int = 0,
        policy_version: int | None = None,
        policy: MergePolicy | str = MergePolicy.KEEP,
    ) -> RouteTrace:
        """One call as SkyRL's generator sees it (`RoutedExpertTrace.record_generation`): the prompt it sent,
        the ids it got, the routes, and the `routed_experts_prompt_start` the request carried."""
        prompt_N = checked_ids(prompt_token_ids, sample_id, "prompt_token_ids")
        token_ids = np.concatenate([prompt_N, checked_ids(output_ids, sample_id, "output_ids")])
        return self.add_call(
            sample_id, token_ids, routes, start=prompt_start, policy_version=policy_version, policy=policy
        )

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
        """One call by the sample's full token ids after it (checked as given, `checked_ids`), its routes and the
        call's `routed_experts_prompt_start` (`start`)."""
        ids = checked_ids(token_ids, sample_id, "token_ids")
        return super().add_call(
            sample_id, ids, routes, engine=engine, start=start, policy_version=policy_version, policy=policy
        )

    def add_tokens(self, sample_id: SampleId, token_ids: Sequence[int] | np.ndarray) -> None:
        """Tokens no call routed joined the sample (the final observation): its full token ids now, checked."""
        super().add_tokens(sample_id, checked_ids(token_ids, sample_id, "token_ids"))

    def prompt_start(self, sample_id: SampleId) -> int:
        """The `routed_experts_prompt_start` the sample's next call should send: the rows routed so far (0 for
        a new sample); rows after it come back from the call's prefill."""
        if sample_id not in self.store:
            return 0
        return captured_rows(self.store.trace(sample_id))

    def generator_routes(self, sample_ids: Sequence[SampleId]) -> list[np.ndarray]:
        """SkyRL's `GeneratorOutput["rollout_expert_indices"]` for these trajectories (see `generator_routes`)."""
        return generator_routes(self.traces(sample_ids), self.geometry)

    def compact_column(self, sample_ids: Sequence[SampleId], *, mode: CodecMode | str = CodecMode.SET) -> list[bytes]:
        """routereplay's compact column: one codec blob per trajectory (-1 rows, token ids, provenance kept)."""
        return [encode(trace, mode=mode) for trace in self.traces(sample_ids)]


def checked_ids(values: Any, sample_id: SampleId, name: str) -> np.ndarray:
    """One argument's token ids as int64 (n,), checked before any cast: a list / tuple of ints or a 1-D integer
    ndarray, every id in [0, 2**31); a bool, float, string, None or a too-large int is a `ConfigError`."""
    where = f"sample {sample_id!r}: {name}"
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ConfigError(
                f"{where} is a {values.dtype} array of shape {values.shape}; token ids are a 1-D integer array or a "
                "list of ints"
            )
        if values.size and (int(values.min()) < 0 or int(values.max()) >= MAX_TOKEN_ID):
            low, high = int(values.min()), int(values.max())
            raise ConfigError(f"{where}: token ids must lie in [0, 2**31), got {low}..{high}")
        return values.astype(np.int64)
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{where} is a {type(values).__name__}; pass the call's token ids as a list of ints")
    for position, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ConfigError(
                f"{where}[{position}] = {str(value)[:40]!r} ({type(value).__name__}) is not a token id: token ids are "
                "ints (a float, bool or string would be cast silently into another token)"
            )
        if not 0 <= value < MAX_TOKEN_ID:
            raise ConfigError(f"{where}[{position}] = {value} is outside the token ids' range [0, 2**31)")
    return np.array(values, dtype=np.int64).reshape(-1)


def captured_rows(trace: RouteTrace) -> int:
    """Rows [0, C) up to and including the last row with a route (trailing -1 rows are not captured)."""
    routed_T = (trace.experts >= 0).any(axis=(1, 2))
    hits = np.flatnonzero(routed_T)
    return int(hits[-1]) + 1 if hits.size else 0


def generator_routes(traces: Sequence[RouteTrace], geometry: RouteGeometry) -> list[np.ndarray]:
    """Per trajectory, SkyRL's route array: the captured prefix (C, L, K) in `route_dtype(E)`, every hidden
    layer in the payload's order (dense layers 0, as vLLM reports them). A -1 row inside the prefix (tokens
    no call routed, followed by routed ones) has no place in SkyRL's form and is refused: carry the compact
    column, whose -1 rows replay live."""
    if not isinstance(geometry, RouteGeometry):
        raise ConfigError(f"geometry must be a RouteGeometry, got {type(geometry).__name__}")
    dtype = route_dtype(geometry.num_experts)
    moe = list(geometry.moe_layers)
    arrays: list[np.ndarray] = []
    for index, trace in enumerate(traces):
        if trace.layers != geometry.moe_layers or trace.num_experts != geometry.num_experts:
            raise ConfigError(
                f"trajectory {index}: its trace routes layers {list(trace.layers)} of {trace.num_experts} experts, "
                f"the geometry {moe} of {geometry.num_experts}: decode it with this RolloutRoutes' geometry"
            )
        if trace.start != 0:
            raise ConfigError(f"trajectory {index}: the trace starts at token {trace.start}; pass a merged trace")
        captured = captured_rows(trace)
        if captured == 0:
            raise MissingRoutesError(
                f"trajectory {index}: no call returned routes for it; SkyRL's collate needs routes for every "
                "trajectory (was the request sent with return_routed_experts?)"
            )
        experts_CMK = trace.experts[:captured]
        gaps_C = (experts_CMK < 0).any(axis=(1, 2))
        if gaps_C.any():
            first = int(np.flatnonzero(gaps_C)[0])
            raise MissingRoutesError(
                f"trajectory {index}: token {first} has no route but later tokens have (rows {first}..; a tool span "
                "no call routed, or a prompt_start past the rows kept); SkyRL's rollout_expert_indices has no "
                "'no route' value (its dummy rows are experts 0..K-1): carry the compact column, whose -1 rows "
                "replay live"
            )
        out_CLK = np.zeros((captured, geometry.num_layers, geometry.top_k), dtype=dtype)
        out_CLK[:, moe] = experts_CMK
        arrays.append(out_CLK)
    return arrays


__all__ = ["RolloutRoutes", "RouteGeometry", "captured_rows", "checked_ids", "generator_routes", "route_dtype"]
