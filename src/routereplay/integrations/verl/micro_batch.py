"""verl micro-batches -> routes in the exact layout verl feeds the model, and recorded routes -> verl's batch key.

verl 0.9.1's FSDP engine (`FSDPEngineWithLMHead.prepare_model_inputs`) receives each micro-batch in
"no padding" form: `input_ids` a jagged NestedTensor (B, j), and the rollout's routes under
`routed_experts`, jagged (B, j, L, K) with the same offsets (`verl/workers/utils/padding.py`). It
then feeds the model one of two layouts, and `MicroBatchLayout` places routes (and, to check itself,
token ids) the same way with `routereplay.layout`:

- `use_remove_padding` (packed THD): every token back to back in one row (1, N), then the static
  `pad_to_length` bucket pad, then the Ulysses SP pad to a multiple of the SP size, then this SP
  rank's contiguous chunk (1, s) -- `layout.ulysses_shard`;
- padded: (B, S) right padded to the longest sequence, with an attention mask -- `layout.pad`.

Dynamic batch size needs nothing here: verl's `rearrange_micro_batches` moves whole rows of the
TensorDict, so `routed_experts` travels with its sequence, and `postprocess_batch_func` restores the
original order of what `forward_step` returns (recorded routes included).

Rollout routes (R3) follow verl's own Megatron rules (`align_r3_router_replay_data`,
`build_r3_replay_mask`): a sequence has a route per token or one fewer (autoregressive rollout never
routes its final token); the final token of every sequence stays live (-1), its logits are unused.

Legend: B = sequences in the micro-batch, N = their tokens back to back, S = padded positions of a
row, s = positions this SP rank feeds, P = payload layers (all decoder layers or MoE only),
L = bound MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from routereplay.enums import StrEnum
from routereplay.errors import ConfigError, MissingRoutesError, RowCountError, TokenMismatchError
from routereplay.integrations.verl.batch import ROUTES_KEY as COMPACT_KEY
from routereplay.integrations.verl.batch import routes_for_batch
from routereplay.integrations.verl.digest import DIGEST_KEY
from routereplay.integrations.verl.rollout import RouteGeometry
from routereplay.integrations.verl.routed_experts import VERL_ROUTES_KEY, routed_experts_for_batch
from routereplay.layout import LayerMap, Ragged, pad, ulysses_shard
from routereplay.layout.ragged import token_starts


def offsets_of(nested_Bj: torch.Tensor) -> torch.Tensor:
    """(B + 1,) int64 host offsets of a jagged NestedTensor."""
    offsets: torch.Tensor = nested_Bj.offsets()  # type: ignore[attr-defined]
    return offsets.to(torch.int64).cpu()


def rollout_routes(
    routes_BjPK: torch.Tensor, input_ids_Bj: torch.Tensor, *, final_token_live: bool = True
) -> torch.Tensor:
    """(N, P, K) int64 routes, one row per token of the micro-batch (-1 rows route live).

    `routes_BjPK` is verl's jagged `routed_experts` (or a dense (B, S, P, K) of equal-length rows); a
    sequence may carry one route fewer than it has tokens (its final token was never fed). With
    `final_token_live` (R3: rollout routes) each sequence's final token is -1, as verl's Megatron R3
    leaves it; R2's recorded routes cover every token and replay whole."""
    if not input_ids_Bj.is_nested:
        raise ConfigError(
            "verl micro-batch input_ids is not a jagged NestedTensor: the routereplay FSDP engine reads verl's "
            "no-padding batches (verl.workers.utils.padding.left_right_2_no_padding); convert the batch first"
        )
    cu_B1 = offsets_of(input_ids_Bj)
    lengths_B = cu_B1[1:] - cu_B1[:-1]
    if routes_BjPK.is_nested:
        route_cu_B1 = offsets_of(routes_BjPK)
        values_MPK = routes_BjPK.values()
    else:
        if routes_BjPK.dim() != 4:
            raise ConfigError(f"{VERL_ROUTES_KEY} must be (B, j, layers, top_k); got shape {tuple(routes_BjPK.shape)}")
        batch, seq = routes_BjPK.shape[:2]
        route_cu_B1 = torch.arange(batch + 1, dtype=torch.int64) * seq
        values_MPK = routes_BjPK.reshape(batch * seq, *routes_BjPK.shape[2:])
    route_lengths_B = route_cu_B1[1:] - route_cu_B1[:-1]
    if route_lengths_B.numel() != lengths_B.numel():
        raise RowCountError(
            f"{VERL_ROUTES_KEY} holds {route_lengths_B.numel()} sequences but the micro-batch has {lengths_B.numel()}; "
            "the routes were split or reordered apart from input_ids: keep them in the same TensorDict"
        )
    short = lengths_B - route_lengths_B
    bad = torch.nonzero((short != 0) & (short != 1)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise RowCountError(
            f"sequence {b} of the micro-batch has {int(route_lengths_B[b])} route rows for {int(lengths_B[b])} "
            "tokens; expected one per token or exactly one fewer (the final token). A longer trace repeats a prefix "
            "(a resumed rollout, verl #6029); a shorter one lost rows: rebuild the rollout's routes"
        )
    out_NPK = torch.full((int(cu_B1[-1]), *values_MPK.shape[1:]), -1, dtype=torch.int64, device=values_MPK.device)
    source_M = token_starts(route_cu_B1[:-1], route_lengths_B).to(values_MPK.device)
    target_M = token_starts(cu_B1[:-1], route_lengths_B).to(values_MPK.device)
    out_NPK[target_M] = values_MPK[source_M].to(torch.int64)
    if final_token_live:
        out_NPK[(cu_B1[1:] - 1)[lengths_B > 0].to(values_MPK.device)] = -1
    return out_NPK


def bound_layers(routes_NPK: torch.Tensor, num_layers: int, layers: tuple[int, ...]) -> torch.Tensor:
    """(N, L, K): the columns of the bound MoE `layers` from an all-layer or MoE-only payload (P = L or all)."""
    if routes_NPK.shape[1] == len(layers):
        return routes_NPK
    return LayerMap(num_layers=num_layers, moe_layers=layers).select(routes_NPK, layers, dim=1)


def require_fed_tokens(
    expected: torch.Tensor,
    model_input_ids: torch.Tensor,
    holds_token: Callable[[torch.device], torch.Tensor],
    *,
    framework: str,
    laid_out: str,
    otherwise: str,
    knobs: str,
) -> None:
    """`TokenMismatchError` unless the trainer fed the model `expected` (the micro-batch's token ids as
    routereplay laid them out) at every position `holds_token` marks: routes placed the same way would otherwise
    land on other tokens. The first differing position is named; `laid_out` / `otherwise` / `knobs` say which
    of the framework's settings the layout followed, what a shape mismatch means, and what can differ."""
    if tuple(expected.shape) != tuple(model_input_ids.shape):
        raise TokenMismatchError(
            f"{framework} fed the model input_ids of shape {tuple(model_input_ids.shape)} but routereplay laid the "
            f"micro-batch out as {tuple(expected.shape)} ({laid_out}); {otherwise}: replay would misplace routes"
        )
    differ = holds_token(model_input_ids.device) & (expected != model_input_ids)
    if bool(differ.any()):
        row, col = (int(i) for i in torch.nonzero(differ)[0])
        raise TokenMismatchError(
            f"model input position ({row}, {col}) holds token {int(model_input_ids[row, col])} but routereplay "
            f"placed token {int(expected[row, col])} (and its route) there; {framework}'s micro-batch layout differs "
            f"from routereplay's ({knobs}): replay would misplace routes"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatchLayout:
    """Where each token of a verl micro-batch sits in the model input verl builds from it."""

    remove_padding: bool
    cu_seqlens: torch.Tensor  # (B + 1,) int64 on the host
    tail_pad: int = 0  # verl's pad_to_length bucket pad, before the SP pad (packed only)
    sp_size: int = 1
    sp_rank: int = 0

    def __post_init__(self) -> None:
        if self.sp_size < 1 or not 0 <= self.sp_rank < self.sp_size:
            raise ConfigError(f"Ulysses SP rank {self.sp_rank} of {self.sp_size}: need 0 <= rank < size >= 1")
        if self.sp_size > 1 and not self.remove_padding:
            raise ConfigError(
                f"Ulysses SP size {self.sp_size} with use_remove_padding=False: verl shards only packed batches; "
                "set actor_rollout_ref.model.use_remove_padding=True"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def place(self, values_N: torch.Tensor, fill: int) -> torch.Tensor:
        """(N, ...) per-token values -> (1, s, ...) packed for this SP rank, or (B, S, ...) right padded."""
        if values_N.shape[0] != self.num_tokens:
            raise RowCountError(
                f"{values_N.shape[0]} rows for a micro-batch of {self.num_tokens} tokens; the routes belong to "
                "another micro-batch"
            )
        if not self.remove_padding:
            return pad(Ragged(values_N, self.cu_seqlens), side="right", fill=fill)
        if self.tail_pad:
            tail = values_N.new_full((self.tail_pad, *values_N.shape[1:]), fill)
            values_N = torch.cat([values_N, tail])
        return ulysses_shard(values_N, self.sp_size, self.sp_rank, fill=fill).unsqueeze(0)

    def holds_token(self, device: torch.device) -> torch.Tensor:
        """Bool (1, s) or (B, S): the positions of the model input that hold a token of the micro-batch."""
        return self.place(torch.ones(self.num_tokens, dtype=torch.bool, device=device), fill=0)

    def attention_mask(self, device: torch.device) -> torch.Tensor | None:
        """The mask verl passes with a padded batch (None for packed: the model reads position_ids)."""
        return None if self.remove_padding else self.holds_token(device).to(torch.int32)

    def check_tokens(self, input_ids_Bj: torch.Tensor, model_input_ids: torch.Tensor) -> None:
        """Raise `TokenMismatchError` unless verl fed the model this layout's tokens: routes placed by
        `place` would otherwise land on other tokens (verl changed its micro-batch layout)."""
        require_fed_tokens(
            self.place(input_ids_Bj.values().to(model_input_ids.device), fill=0),
            model_input_ids,
            self.holds_token,
            framework="verl",
            laid_out=f"remove_padding={self.remove_padding}, SP rank {self.sp_rank} of {self.sp_size}, tail pad "
            f"{self.tail_pad}",
            otherwise="this verl version lays out micro-batches differently (a VLM under Ulysses SP is not supported)",
            knobs="remove_padding, Ulysses SP, pad_to_length",
        )

    def recorded(self, routes_BSLK: torch.Tensor, sp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """(N, L, K): the routes a record pass produced, one row per token of the micro-batch, all SP ranks'."""
        if not self.remove_padding:
            return routes_BSLK[self.holds_token(routes_BSLK.device)]
        local_sLK = routes_BSLK[0]
        if self.sp_size > 1:
            shards = [torch.empty_like(local_sLK) for _ in range(self.sp_size)]
            dist.all_gather(shards, local_sLK.contiguous(), group=sp_group)
            local_sLK = torch.cat(shards)
        return local_sLK[: self.num_tokens]


def recorded_batch_routes(routes_NLK: torch.Tensor, cu_seqlens: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Jagged (B, j, L, K) routes as verl carries `routed_experts` (int16 when the ids fit, like verl)."""
    dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
    return torch.nested.nested_tensor_from_jagged(
        routes_NLK.to(dtype).contiguous(), offsets=cu_seqlens.to(routes_NLK.device)
    )


class RouteSource(StrEnum):
    """Where a micro-batch's routes are."""

    COMPACT = "compact"  # routereplay's column (`batch.ROUTES_KEY`): only ever the rollout's routes
    VERL = "verl"  # verl's `routed_experts` tensor: the rollout's (R3), or what compute_log_prob recorded (R2)


def route_source(micro_batch: object) -> RouteSource | None:
    """Which routes the micro-batch carries, read without decoding them; None when it has none."""
    get = getattr(micro_batch, "get", None)
    if get is None:
        raise MissingRoutesError(f"a verl micro-batch is a TensorDict, got {type(micro_batch).__name__}")
    if get(COMPACT_KEY, None) is not None:
        return RouteSource.COMPACT
    return RouteSource.VERL if isinstance(get(VERL_ROUTES_KEY, None), torch.Tensor) else None


def routes_of(
    micro_batch: object, *, geometry: RouteGeometry, unchecked: bool = False, recorded: bool = False
) -> torch.Tensor | None:
    """The micro-batch's routes, jagged (B, j, P, K) with -1 where no route is known, or None (R2's recording pass).

    routereplay's compact column (`batch.ROUTES_KEY`, codec blobs the rollout side put on the batch) is read
    first, by `routes_for_batch`: its traces carry token ids, checked against the micro-batch's. Otherwise
    verl's `routed_experts` tensor, by `routed_experts_for_batch` (`routed_experts.py`): routereplay's dense
    form is checked against its token digest; a tensor without one is refused (`UncheckedRoutesError`) unless
    `unchecked` (the engine's R3 opt-out, or R2 after `route_checks.RecordedRoutes` checked it); verl's own
    zero-filled form gets -1 on the zero rows verl's masks say no engine routed, unless `recorded` (R2: rows the
    engine recorded itself, every one a route). Every form is checked against the model's `geometry` (headers,
    top-k, layer columns, an all-layer payload's dense columns) before anything is decoded."""
    source = route_source(micro_batch)
    if source is RouteSource.COMPACT:
        return routes_for_batch(micro_batch, geometry=geometry)
    if source is RouteSource.VERL:
        return routed_experts_for_batch(micro_batch, geometry=geometry, unchecked=unchecked, recorded=recorded)
    return None


def has_digest(micro_batch: object) -> bool:
    """Whether the micro-batch's dense routes carry routereplay's token digest (`digest.DIGEST_KEY`)."""
    get = getattr(micro_batch, "get", None)
    return get is not None and get(DIGEST_KEY, None) is not None


def check_recorded(routes_NPK: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """R2 replays what compute_log_prob recorded: a route of K distinct experts for every token, the final one
    included. A -1 row, or a final-token row that repeats an expert (verl's zero fill of the row no rollout
    engine routes), says the routes are the rollout's: `ConfigError` (R2 with rollout routes, see fsdp_engine)."""
    missing_N = (routes_NPK < 0).any(dim=-1).any(dim=-1)
    final_NPK = routes_NPK[(cu_seqlens[1:] - 1)[cu_seqlens[1:] > cu_seqlens[:-1]].to(routes_NPK.device)]
    sorted_NPK = final_NPK.sort(dim=-1).values
    repeated = bool((sorted_NPK[..., 1:] == sorted_NPK[..., :-1]).any())
    if bool(missing_N.any()) or repeated:
        where = (
            f"token {int(torch.nonzero(missing_N)[0])} of the micro-batch has no route (-1)"
            if bool(missing_N.any())
            else "a sequence's final token repeats an expert (verl's zero fill: no rollout engine routes it)"
        )
        raise ConfigError(r2_with_rollout_routes(f"'{VERL_ROUTES_KEY}' of a training micro-batch: {where}"))


def r2_with_rollout_routes(where: str) -> str:
    """The refusal of router_replay.mode=R2 with the rollout's routes on the batch: what, where, how to fix."""
    return (
        f"router_replay.mode=R2 with the rollout's routes on the batch ({where}): R2 records the trainer's own "
        "routing in compute_log_prob and replays that in the updates, so rollout routes would silently turn it into "
        "R3; verl refuses this too ('R2 and enable_rollout_routing_replay cannot be enabled simultaneously'). Fix: "
        "for R2 set actor_rollout_ref.rollout.enable_rollout_routing_replay=False and put no "
        f"'{COMPACT_KEY}' on AgentLoopOutput.extra_fields; to replay the rollout's routes set router_replay.mode=R3"
    )
