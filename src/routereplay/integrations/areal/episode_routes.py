"""One AReaL episode's routes, `agenerate` call by call, merged by token position into the episode's two columns.

An AReaL workflow calls `engine.agenerate(req)` once per turn, each time with the whole sequence so far
(`RLVRWorkflow`: one call; `MultiTurnWorkflow`, `workflow/multi_turn.py`: turn t+1 sends turn t's input, its
output, an EOS when the output did not end on one, and the retry prompt). Each call returns AReaL's
`ModelResponse`: `input_tokens`, `output_tokens`, `output_versions` and `routed_experts`, SGLang's rows of
positions [0, len(input_tokens) + len(output_tokens) - 1) over every hidden layer (dense layers 0), `int32`
`(rows, num_layers * K)`. A request interrupted for a weight update and resumed inside `agenerate` is still
ONE response; with routereplay's backend (`backend.py`) it holds each row once, with AReaL's own backend the
resumed call's prefix rows come twice and the row count refuses it here (`DuplicatedPrefixError` /
`RowCountError`), never a silent shift.

`EpisodeRoutes` is verl's per-call machinery (`call_routes.AgentLoopRoutes`: `RolloutRoutes.decode` keeps the
MoE layers and names each row's token, a `RouteStore` merges by absolute position under `MergePolicy.KEEP`)
with AReaL's rules:
- `add_response(resp)` adds one call; a response without routes raises `MissingRoutesError` (the episode asked
  for them). A call's policy version is the one version its output tokens name (`output_versions`), else none.
- KEEP: a position keeps the row of the first call that routed it (the routes its token was sampled with);
  positions no call routed stay -1 rows (the episode's last token).
- A call whose tokens differ from an earlier call's at a position that call routed raises `TokenMismatchError`
  (the earlier rows would replay on other tokens); a change only at unrouted positions (the previous call's
  last, never fed back, token) keeps the rows before it.
- `columns(input_ids)`: the episode's two columns over the sequence the workflow returns (`columns.py`);
  a returned sequence that differs from what the calls saw at a routed position raises `TokenMismatchError`.

`route_geometry(value)` turns what a workflow is given (a `RouteGeometry`, an HF config, or a model path) into the
geometry. Nothing here imports AReaL. Legend: N tokens of a call, S of the episode, M MoE layers, K top-k.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from routereplay.enums import CodecMode
from routereplay.errors import (
    ConfigError,
    DuplicatedPrefixError,
    LayerCountError,
    MissingRoutesError,
    RowCountError,
    TokenMismatchError,
)
from routereplay.integrations.areal.columns import episode_columns
from routereplay.integrations.verl.call_routes import SAMPLE, AgentLoopRoutes, common_prefix
from routereplay.integrations.verl.rollout import Engine, RouteGeometry
from routereplay.trace.route_trace import RouteTrace


def route_geometry(value: Any) -> RouteGeometry:
    """The routed model's geometry from a `RouteGeometry`, an HF config (`num_hidden_layers`, experts, top-k) or
    the path of a local model folder holding its `config.json`."""
    if isinstance(value, RouteGeometry):
        return value
    if isinstance(value, (str, os.PathLike)):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(os.fspath(value), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"route_geometry={os.fspath(value)!r}: no HF config could be read there ({error}); pass the actor's "
                "model path (a folder with config.json), its config object, or a RouteGeometry"
            ) from None
        return RouteGeometry.from_hf_config(config)
    if getattr(value, "num_hidden_layers", None) is None and getattr(value, "text_config", None) is None:
        raise ConfigError(
            f"route_geometry must be a RouteGeometry, an HF config or a model path, got {type(value).__name__}"
        )
    return RouteGeometry.from_hf_config(value)


def single_version(versions: Sequence[int] | None) -> int | None:
    """The one weights version a call's output tokens name (AReaL's `output_versions`), or None (none, or several:
    a request resumed across a weight update)."""
    named = {int(v) for v in versions or ()}
    return named.pop() if len(named) == 1 and min(named) >= 0 else None


class EpisodeRoutes(AgentLoopRoutes):
    """One episode's routes: `add_response` per `agenerate` call, `columns(input_ids)` at the end."""

    def __init__(self, geometry: RouteGeometry, *, codec_mode: CodecMode | str = CodecMode.SET) -> None:
        super().__init__(geometry, engine=Engine.SGLANG, codec_mode=codec_mode)

    def add_response(self, response: Any) -> RouteTrace:
        """One AReaL `ModelResponse`: its input and output tokens and the routes of [0, N - 1)."""
        routes = getattr(response, "routed_experts", None)
        inputs, outputs = getattr(response, "input_tokens", None), getattr(response, "output_tokens", None)
        if inputs is None or outputs is None:
            raise ConfigError(
                f"an agenerate call returned {type(response).__name__}, not AReaL's ModelResponse (input_tokens, "
                "output_tokens, routed_experts)"
            )
        if routes is None:
            raise MissingRoutesError(
                f"call {self.calls + 1} of the episode ({len(inputs)} input + {len(outputs)} output tokens) returned "
                "no routed_experts although the episode asked for them: run SGLang with "
                "--enable-return-routed-experts and serve an MoE model"
            )
        version = single_version(getattr(response, "output_versions", None))
        return self.add_call(inputs, outputs, self.shaped(routes, len(inputs) + len(outputs)), policy_version=version)

    def shaped(self, routes: Any, num_tokens: int) -> Any:
        """AReaL's `(rows, A * K)` array as `(rows, A, K)`, its row count checked from its shape (never guessed from
        the id count): a resumed request's prefix rows kept twice are named; any other form is decoded as it is."""
        g = self.geometry
        if not isinstance(routes, np.ndarray) or routes.ndim != 2:
            return routes
        extra = len(routes) - (num_tokens - 1)
        if extra > 1:
            raise DuplicatedPrefixError(
                f"call {self.calls + 1} of the episode: {len(routes)} route rows for {num_tokens} tokens (rows stop at "
                f"{num_tokens - 1}), {extra} too many: a request resumed after a weight update whose passes' rows of "
                "[0, seqlen - 1) were concatenated (AReaL's own SGLangBackend). Use routereplay's backend "
                "(backend.install(engine, geometry); the routed workflows install it), which keeps each row once"
            )
        if extra:
            raise RowCountError(
                f"call {self.calls + 1} of the episode: {len(routes)} route rows for {num_tokens} tokens; SGLang "
                f"returns {num_tokens - 1} (every position but the last): check the engine's response"
            )
        if routes.shape[1] != g.num_layers * g.top_k:
            raise LayerCountError(
                f"call {self.calls + 1} of the episode: routed_experts rows hold {routes.shape[1]} ids, not "
                f"num_hidden_layers({g.num_layers}) x top_k({g.top_k}) = {g.num_layers * g.top_k}: the rollout "
                "served another model than the geometry names (pass the actor's model config)"
            )
        return routes.reshape(len(routes), g.num_layers, g.top_k)

    def columns(self, input_ids: Any) -> dict[str, torch.Tensor]:
        """The episode's `ROUTES_KEY` / `TOKENS_KEY` columns over the sequence the workflow returns (S ids)."""
        ids_S = torch.as_tensor(input_ids).reshape(-1)
        return episode_columns(self.trace(ids_S.tolist()), ids_S)

    def _follow(self, tokens_N: np.ndarray) -> None:
        """A call must extend what earlier calls saw wherever they routed; then verl's restart rule applies."""
        if SAMPLE in self.rollout.store:
            stored_N = np.asarray(self.rollout.tokens(SAMPLE), dtype=np.int64)
            shared = common_prefix(stored_N, tokens_N)
            if shared < len(stored_N):
                held = self.rollout.trace(SAMPLE)
                routed_T = np.asarray(held.routed_mask.any(axis=1), dtype=bool)
                after = routed_T[max(shared - held.start, 0) :]
                if after.any():
                    at = shared if shared < len(tokens_N) else len(tokens_N)
                    now = f"token {int(tokens_N[at])}" if at < len(tokens_N) else "no token"
                    raise TokenMismatchError(
                        f"call {self.calls + 1} of the episode sends {now} at position {at} where an earlier call saw "
                        f"token {int(stored_N[at])} and {int(after.sum())} routed rows from there on: those rows would "
                        "replay on other tokens. Send each turn the whole history as the engine returned it "
                        "(resp.input_tokens + resp.output_tokens), never re-tokenised"
                    )
        super()._follow(tokens_N)


__all__ = ["EpisodeRoutes", "route_geometry", "single_version"]
