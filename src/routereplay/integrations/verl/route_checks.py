"""What the FSDP engine checks about verl's dense `routed_experts` when no digest travels with it.

routereplay's own forms carry their proof: the compact column holds each sample's token ids, the dense
form a per-sample digest (`digest.py`). Two dense tensors reach the engine without one:

- **R3, verl's own agent-loop `routed_experts`** (`enable_rollout_routing_replay=True` with an agent loop
  routereplay's are not: a user's own loop, or workers that never imported `fsdp_engine`; verl's default
  single-turn and tool loops are replaced by checked ones, `checked_loops.py`): nothing ties its rows to the
  tokens, so a tensor shifted by a position, cut, or moved onto swapped equal-length samples would replay
  silently. The engine refuses it (`UncheckedRoutesError`)
  unless the user opts out with the environment variable `UNCHECKED_ENV` set to 1 in every worker: verl's
  `EngineRouterReplayConfig` refuses keys it does not declare, so the opt-out travels to verl's Ray
  workers in `RUNTIME_ENV_OVERRIDE` on verl's command line (quoted: Ray takes string env_vars only).
  Opted out, the engine counts the samples it replayed unchecked and logs the count once per
  `forward_backward_batch` (one compute_log_prob, one update mini-batch).
- **R2, the routes compute_log_prob recorded**: verl's trainer keeps only `routed_experts` from that pass
  (`ray_trainer._compute_old_log_prob`), so the engine keeps the proof itself. `RecordedRoutes` maps, per
  sample it recorded, the digest of its token ids to the digest of its route rows (`route_digest`), and
  is cleared when the next compute_log_prob pass starts (one pass of this rank's samples at most). An
  update's sample whose tokens this rank recorded must carry exactly those rows (`TokenMismatchError`
  otherwise: routes moved apart from their tokens); a sample it never recorded (another DP rank recorded
  it, or verl re-balanced samples across ranks) is counted as unverified and replayed, not refused.
  `remember` and `check` each hash the routes once: 34 ms per 48 MiB of int16 routes (16 samples x 4,096
  tokens x 48 layers x top-8) on a 2-core CPU; the map keeps 32 bytes per sample.

Legend: B samples of a micro-batch, N tokens of one sample, L MoE layers, K top-k.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch

from routereplay.errors import TokenMismatchError, UncheckedRoutesError
from routereplay.integrations.opt_out import env_opt_out
from routereplay.integrations.verl.digest import DIGEST_KEY, route_digest, sample_rows

UNCHECKED_ENV = "ROUTEREPLAY_VERL_UNCHECKED_ROUTES"
# verl's command line (hydra); quoted, as Ray takes only string env_vars (an unquoted 1 is an int: TypeError)
RUNTIME_ENV_OVERRIDE = f"'+ray_kwargs.ray_init.runtime_env.env_vars.{UNCHECKED_ENV}=\"1\"'"
TOKEN_TAG = b"routereplay.verl.tokens.v1"

logger = logging.getLogger("routereplay.integrations.verl")


def unchecked_opt_out() -> bool:
    """Whether this process opted out of the token check of verl's own `routed_experts` (`UNCHECKED_ENV`)."""
    return env_opt_out(UNCHECKED_ENV, on="replay verl's own routed_experts without a token check", off="refuse them")


def unchecked_refusal(samples: int) -> UncheckedRoutesError:
    """R3 with verl's own digest-less `routed_experts`: what, where, how to fix."""
    return UncheckedRoutesError(
        f"router_replay.mode=R3: a micro-batch's routed_experts ({samples} samples) has no '{DIGEST_KEY}' column, "
        "so nothing ties its rows to the tokens (routes shifted by a position, cut, or on swapped equal-length "
        "samples would replay silently). This is the form verl's agent loops build when routereplay's are not in "
        "use. Fix: import routereplay.integrations.verl.fsdp_engine in the agent-loop workers too "
        "(actor_rollout_ref.model.external_lib does: it registers routereplay's checked single_turn_agent / "
        "tool_agent), mix routereplay.integrations.verl.checked_loops.RouteCheckedAgentLoop into a loop of your "
        "own, or put the routes with put_routes(..., form='compact' | 'dense'); or opt out in every worker with "
        f"{UNCHECKED_ENV}=1 ({RUNTIME_ENV_OVERRIDE} on verl's command line): the engine then replays them "
        "unchecked, as verl does, and logs how many samples it did"
    )


def token_digest(ids_N: torch.Tensor) -> bytes:
    """16 bytes of SHA-256 over one sample's token ids (int64): the key of its recorded routes."""
    h = hashlib.sha256(TOKEN_TAG)
    h.update(ids_N.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).data)
    return h.digest()[:16]


@dataclass(slots=True)
class RecordedRoutes:
    """Per sample R2 recorded on this rank: token-ids digest -> the digests of the route rows recorded for it
    (a set: equal samples, e.g. two identical GRPO answers, may route differently in different micro-batches)."""

    routes_by_tokens: dict[bytes, set[bytes]] = field(default_factory=dict)

    def clear(self) -> None:
        self.routes_by_tokens.clear()

    def remember(self, input_ids_Bj: torch.Tensor, routes_BjLK: torch.Tensor) -> None:
        """Keep the digests of a recorded micro-batch (jagged ids and routes, one row per token)."""
        for ids_N, routes_NLK in sample_rows(routes_BjLK, input_ids_Bj, None):
            self.routes_by_tokens.setdefault(token_digest(ids_N), set()).add(route_digest(ids_N, routes_NLK))

    def check(self, input_ids_Bj: torch.Tensor, routes_BjLK: torch.Tensor) -> int:
        """`TokenMismatchError` for a sample whose tokens this rank recorded but whose rows are not what it recorded;
        returns how many samples this rank never recorded (unverified, replayed)."""
        unverified = 0
        for b, (ids_N, routes_NLK) in enumerate(sample_rows(routes_BjLK, input_ids_Bj, None)):
            known = self.routes_by_tokens.get(token_digest(ids_N))
            if known is None:
                unverified += 1
            elif route_digest(ids_N, routes_NLK) not in known:
                raise TokenMismatchError(
                    f"router_replay.mode=R2: sample {b} of an update micro-batch ({ids_N.shape[0]} tokens) carries "
                    "routed_experts rows that compute_log_prob did not record for its tokens on this rank: the "
                    "recorded routes were moved apart from their tokens (samples reordered, e.g. swapped "
                    "equal-length samples, or routes shifted or edited between compute_log_prob and the update). "
                    "Fix: keep compute_log_prob's routed_experts in the batch it was computed for (verl's "
                    "batch.union) and reorder or split only that whole batch"
                )
        return unverified


@dataclass(slots=True)
class ReplayCounts:
    """Samples replayed without a check in the current `forward_backward_batch`, and in all of them."""

    unchecked: int = 0  # R3: verl's own routed_experts, opted out with UNCHECKED_ENV
    unverified: int = 0  # R2: samples this rank did not record
    total_unchecked: int = 0
    total_unverified: int = 0

    def add(self, *, unchecked: int = 0, unverified: int = 0) -> None:
        self.unchecked += unchecked
        self.unverified += unverified
        self.total_unchecked += unchecked
        self.total_unverified += unverified

    def log_pass(self) -> None:
        """One log line for the pass that ends, when it replayed any sample unchecked; then start a new pass."""
        if self.unchecked:
            logger.warning(
                "routereplay R3: %d samples replayed from verl's own routed_experts without a token check (%s=1 "
                "opts out of it; %d so far)",
                self.unchecked,
                UNCHECKED_ENV,
                self.total_unchecked,
            )
        if self.unverified:
            logger.warning(
                "routereplay R2: %d samples replayed routes this rank did not record in compute_log_prob, unverified "
                "against their tokens (another DP rank recorded them; %d so far)",
                self.unverified,
                self.total_unverified,
            )
        self.unchecked = self.unverified = 0


__all__ = [
    "UNCHECKED_ENV",
    "RecordedRoutes",
    "ReplayCounts",
    "token_digest",
    "unchecked_opt_out",
    "unchecked_refusal",
]
