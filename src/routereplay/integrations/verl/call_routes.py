"""One agent-loop sample's routes, engine call by engine call, checked against the sequence the loop returns.

verl 0.9.1's agent loops call `server_manager.generate(request_id, prompt_ids=..., ...)` once per assistant
turn, each call with the whole sequence so far, and get verl's `TokenOutput` back: `token_ids` (what the call
generated) and `routed_experts` (the engine's routes of `prompt_ids + token_ids` but the last token: vLLM's or
SGLang's ndarray, every hidden layer, dense layers zero-filled). verl keeps the last call's array and pads it
with zeros by count (`agent_loop.py` l.783-809). Here every call is kept, by token position:

- `AgentLoopRoutes.add_output(prompt_ids, output)` decodes one call's routes (`RolloutRoutes.decode`: the MoE
  layers only, each row naming its token) and merges them into the sample under `MergePolicy.KEEP`: a token
  keeps the row of the first call that fed it (the routes it was sampled with), stamped with the call's
  policy version (`TokenOutput.extra_fields["global_steps"]`, when the call names one version).
- A loop may rewrite the end of the sequence between calls: verl's Continuous Token builders drop a
  trailing boundary token before appending a tool response (GLM's `<|observation|>`, Gemma's turn separator,
  DeepSeek's tool-output end: `MergeResult.removed_prefix_token_count`). A row stays valid while every token
  up to it is unchanged, so the sample restarts from the longest common prefix: rows before the first
  rewritten token are kept, the rewritten positions take the next call's rows (it prefilled them), and
  `rewrites` counts the restarts.
- `trace(token_ids)` merges against the sequence the loop returns (`prompt_ids + response_ids` of its
  `AgentLoopOutput`): tokens after the last call (a tool response the loop ended on) are -1 rows, and a
  response cut to `response_length` cuts its rows. A returned sequence that differs from what the last call
  saw at a routed position raises `TokenMismatchError`: the routes would be replayed on other tokens.
- `put_on(output)` puts that trace on verl's `AgentLoopOutput` (`batch.put_output_routes`: a codec blob with
  the token ids in `extra_fields["routereplay_routes"]`, `routed_experts = None`), so verl's `_postprocess`
  copies it into the batch and the trainer checks every sample's tokens against it.

`RecordingServer` wraps a loop's `server_manager` so each `generate` call is added as it returns; `checked_loops`
mixes it into verl's own loops. Nothing here imports verl: outputs are read duck-typed.

Legend: N tokens of a sample, T rows of one call, L MoE layers, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from routereplay.enums import CodecMode
from routereplay.errors import ConfigError, TokenMismatchError
from routereplay.integrations.verl.batch import put_output_routes
from routereplay.integrations.verl.rollout import Engine, RolloutRoutes, RouteGeometry, checked_token_ids
from routereplay.trace.provenance import MergePolicy
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.limits import is_int

SAMPLE = "sample"  # the one sample id of an AgentLoopRoutes' store


def common_prefix(a_N: np.ndarray, b_N: np.ndarray) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a_N), len(b_N))
    differ = np.flatnonzero(a_N[:n] != b_N[:n])
    return int(differ[0]) if differ.size else n


def policy_version_of(output: Any) -> int | None:
    """The weights version a verl `TokenOutput` names (`extra_fields["global_steps"]`), or None when it names none
    or a resumed partial rollout spanned several (`min_global_steps` != `max_global_steps`)."""
    extra = getattr(output, "extra_fields", None) or {}
    version: Any = extra.get("global_steps")
    lowest, highest = extra.get("min_global_steps", version), extra.get("max_global_steps", version)
    if not is_int(version) or int(version) < 0 or lowest != highest:
        return None
    return int(version)


class AgentLoopRoutes:
    """The routes of one agent-loop sample, call by call: `add_output` per engine call, `put_on` at the end."""

    def __init__(
        self,
        geometry: RouteGeometry,
        *,
        engine: Engine | str = Engine.VLLM,
        codec_mode: CodecMode | str = CodecMode.SET,
    ) -> None:
        try:
            self.engine = Engine(engine)
        except ValueError:
            raise ConfigError(
                f"rollout engine {engine!r}: routereplay decodes the routes of 'vllm' and 'sglang' (verl's "
                "actor_rollout_ref.rollout.name)"
            ) from None
        self.rollout = RolloutRoutes(geometry, codec_mode=codec_mode)  # checks both
        self.geometry, self.codec_mode = geometry, codec_mode
        self.calls = 0  # engine calls added
        self.rewrites = 0  # restarts after the loop rewrote tokens a call had seen

    def add_call(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        token_ids: Sequence[int] | np.ndarray,
        routes: Any,
        *,
        policy_version: int | None = None,
    ) -> RouteTrace:
        """One engine call: it was sent `prompt_ids` (the whole sequence so far), generated `token_ids`, and
        returned `routes` (any form the engine's decoder reads). Returns the call's own trace."""
        tokens_N = checked_token_ids([*prompt_ids, *token_ids], SAMPLE)
        trace = self.rollout.decode(routes, tokens_N, engine=self.engine, policy_version=policy_version)
        self._follow(tokens_N)
        self.rollout.store.add_turn(SAMPLE, tokens_N, trace, policy=MergePolicy.KEEP, policy_version=policy_version)
        self.calls += 1
        return trace

    def add_output(self, prompt_ids: Sequence[int] | np.ndarray, output: Any) -> RouteTrace | None:
        """One verl `TokenOutput` for a `generate(prompt_ids=...)` call; None (nothing added) when it has no routes."""
        routes = getattr(output, "routed_experts", None)
        if routes is None:
            return None
        token_ids = getattr(output, "token_ids", None)
        if token_ids is None:
            raise ConfigError(
                f"the engine call's output ({type(output).__name__}) has no token_ids; pass verl's TokenOutput"
            )
        return self.add_call(prompt_ids, token_ids, routes, policy_version=policy_version_of(output))

    def trace(self, token_ids: Sequence[int] | np.ndarray) -> RouteTrace:
        """The sample's routes over the sequence the loop returns, rows [0, N - 1), each naming its token."""
        final_N = checked_token_ids(token_ids, SAMPLE)
        if not self.calls:
            raise ConfigError("no engine call returned routes for this sample: nothing to put on the batch")
        stored_N = np.asarray(self.rollout.tokens(SAMPLE), dtype=np.int64)
        shared = common_prefix(stored_N, final_N)
        routed = min(len(stored_N), len(final_N)) - 1  # rows the last call routed that the returned sequence keeps
        if shared < routed:
            raise TokenMismatchError(
                f"the agent loop returned token {int(final_N[shared])} at position {shared} where its last engine call "
                f"saw {int(stored_N[shared])} ({len(final_N)} tokens returned, {len(stored_N)} seen): its routes would "
                "replay on other tokens. Return the tokens the engine generated (prompt_ids + response_ids as sent to "
                "and returned by server_manager.generate), or re-tokenise before the last call, not after"
            )
        self._follow(final_N)
        if len(final_N) > len(self.rollout.tokens(SAMPLE)):
            self.rollout.add_tokens(SAMPLE, final_N)  # tokens no call fed (a tool response the loop ended on): -1
        return self.rollout.trace(SAMPLE)

    def put_on(self, output: Any) -> RouteTrace:
        """Put the sample's routes on verl's `AgentLoopOutput` (its `prompt_ids + response_ids`): the compact blob in
        `extra_fields[ROUTES_KEY]`, `routed_experts = None`. Returns the trace put there."""
        prompt, response = getattr(output, "prompt_ids", None), getattr(output, "response_ids", None)
        if prompt is None or response is None:
            raise ConfigError(
                f"output must be verl's AgentLoopOutput (prompt_ids, response_ids), got {type(output).__name__}"
            )
        trace = self.trace(list(prompt) + list(response))
        put_output_routes(output, trace, mode=self.codec_mode)
        return trace

    def _follow(self, tokens_N: np.ndarray) -> None:
        """Restart the sample when `tokens_N` does not extend the stored tokens: keep the rows before the first
        changed token (each saw only unchanged tokens), under a fresh store, with `tokens_N` as its tokens."""
        if SAMPLE not in self.rollout.store:
            return
        stored_N = np.asarray(self.rollout.tokens(SAMPLE), dtype=np.int64)
        shared = common_prefix(stored_N, tokens_N)
        if shared == len(stored_N):
            return
        old = self.rollout.trace(SAMPLE)
        end = min(old.stop, shared, len(tokens_N) - 1)
        self.rollout = RolloutRoutes(self.geometry, codec_mode=self.codec_mode)
        kept = old.slice(old.start, end) if end > old.start else None
        self.rollout.store.add_turn(SAMPLE, tokens_N, kept)
        self.rewrites += 1


class RecordingServer:
    """A loop's `server_manager` whose `generate` adds each call's routes to the sample's `AgentLoopRoutes`.

    `routes` is the sample's `AgentLoopRoutes`, or a zero-argument factory called when the first call returns
    routes (so a loop with R3 off never reads the model's config). Every other attribute is the server's."""

    def __init__(self, server: Any, routes: AgentLoopRoutes | Callable[[], AgentLoopRoutes]) -> None:
        if not hasattr(server, "generate"):
            raise ConfigError(f"server must be verl's server manager (generate), got {type(server).__name__}")
        self.server = server
        self.routes: AgentLoopRoutes | None = routes if isinstance(routes, AgentLoopRoutes) else None
        self.make_routes: Callable[[], AgentLoopRoutes] | None = None if isinstance(routes, AgentLoopRoutes) else routes
        self.calls_without_routes = 0

    async def generate(self, *args: Any, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        output = await self.server.generate(*args, prompt_ids=prompt_ids, **kwargs)
        if getattr(output, "routed_experts", None) is None:
            self.calls_without_routes += 1
            return output
        if self.routes is None:
            assert self.make_routes is not None
            self.routes = self.make_routes()
        self.routes.add_output(prompt_ids, output)
        return output

    def put_on(self, output: Any) -> RouteTrace | None:
        """The sample's routes on its `AgentLoopOutput`; None (the output untouched) when no call returned routes."""
        if self.routes is None or not self.routes.calls:
            return None
        return self.routes.put_on(output)

    def __getattr__(self, name: str) -> Any:
        if name == "server":  # not set yet (copy, unpickle): no recursion through self.server
            raise AttributeError(name)
        return getattr(self.server, name)


__all__ = ["AgentLoopRoutes", "RecordingServer", "common_prefix", "policy_version_of"]
