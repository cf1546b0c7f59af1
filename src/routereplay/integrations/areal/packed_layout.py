"""Where each route row goes in the input AReaL 1.0.4's FSDP engine gives the HF model, and the token check.

AReaL's path from the actor's batch to `self.model(**inputs)` (areal/utils/data.py, engine/fsdp_engine.py):
`concat_padded_tensors` makes the trajectories one right-padded `[B, S]` batch (pad 0); `ppo_update` splits it
into mini-batches, `_prepare_mb_list` into micro-batches (`split_padded_tensor_dict_into_mb_list`, which
reorders the samples), packs each (`pack_tensor_dict`: row i's first `len_i` positions, concatenated), pads the
packed tokens to a multiple of 256 or to `max_tokens_per_mb` (`pad_mb_list`, pad 0) into `[1, T]`; with Ulysses
SP `_prepare_mb_inputs` pads `[1, T]` to a multiple of the SP size (pad 0) and gives rank r the r-th slice.

Those steps split a key only when its `numel()` is `B * S` and pad it only when it is `T`, so the contract's
`[B, S, M, K]` routes column would reach every mini- and micro-batch whole, never split or packed. The actor
(`fsdp_actor.py`) therefore takes both contract columns out at `compute_logp` / `ppo_update` entry, keeps their
rows in a `RouteTable` for that call, and hands AReaL `ROW_KEY` instead: `[B, S]` int64, `n + 1` at a position
whose route is table row `n`, 0 elsewhere. AReaL splits, packs and pads it exactly like `input_ids` (every pad it
adds is 0: no row, the live router), and per micro-batch `RouteTable.model_routes` turns the model's slice of it
into `[1, T, M, K]` routes (-1 where 0); `RouteTable.check_fed` checks the model got the tokens each row was
placed for.

The contract's columns are read by the contract's one reader, `columns.check_columns` (shape, dtype, the core's
row catalogue, `TOKENS_KEY` -1 exactly where the row is -1): `read_columns` hands it each batch's attended
positions. It accepts a routes column longer than the attended positions: after AReaL's `compute_advantages`
(`split_batch` -> `_unpad_splits` trims only the last axis) the routes keep the batch's padded length while
`input_ids` and `TOKENS_KEY` are trimmed. The token check (`check_tokens`: `TOKENS_KEY == input_ids` wherever it
is not -1, `TokenMismatchError` naming the trajectory and position) is `columns.require_route_tokens` per row.
Legend: B trajectories, S padded positions, N table rows (attended positions of a call),
T positions of a micro-batch's model input, M MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from routereplay.errors import BatchFieldError, BatchGeometryError
from routereplay.integrations.areal.columns import ROUTES_KEY, TOKENS_KEY, check_columns, require_route_tokens
from routereplay.integrations.opt_out import env_opt_out
from routereplay.integrations.verl import RouteGeometry
from routereplay.integrations.verl.micro_batch import require_fed_tokens

ROW_KEY = "routereplay_route_row"  # [B, S] int64: table row + 1, 0 = none (what AReaL splits, packs, pads)
UNCHECKED_ENV = "ROUTEREPLAY_AREAL_UNCHECKED_ROUTES"  # a worker's opt-out of the token check (counted)
TOKEN_FIX = (
    "build the episode dict with routereplay's AReaL workflows (integrations/areal/workflows.py), which take both "
    "columns from the engine calls that routed these tokens"
)


def _tensor(episode: dict[str, Any], key: str, where: str) -> torch.Tensor:
    value = episode.get(key)
    if not isinstance(value, torch.Tensor) or value.is_nested or value.layout != torch.strided or value.is_meta:
        raise BatchFieldError(f"{where}: '{key}' must be a dense torch.Tensor with data, got {type(value).__name__}")
    return value


def attended_lengths(episode: dict[str, Any], where: str) -> torch.Tensor:
    """(B,) attended length of each row; the mask must be right-padded, since AReaL packs `value[i][:len_i]`."""
    mask_BS = _tensor(episode, "attention_mask", where).to(torch.bool)
    ids_BS = _tensor(episode, "input_ids", where)
    if mask_BS.dim() != 2 or tuple(mask_BS.shape) != tuple(ids_BS.shape):
        raise BatchFieldError(
            f"{where}: attention_mask {tuple(mask_BS.shape)} and input_ids {tuple(ids_BS.shape)} must both be [B, S]"
        )
    lengths_B = mask_BS.sum(1)
    prefix_BS = torch.arange(mask_BS.shape[1]).unsqueeze(0) < lengths_B.unsqueeze(1)
    if not torch.equal(prefix_BS, mask_BS.cpu()):
        b = int(torch.nonzero((prefix_BS != mask_BS.cpu()).any(1))[0])
        raise BatchFieldError(
            f"{where}, row {b}: attention_mask is not right-padded (AReaL's pack_tensor_dict packs each row's first "
            "attended-length positions, so routes would be packed onto padding); build the batch as AReaL's "
            "workflows do (attention_mask of ones, concat_padded_tensors)"
        )
    return lengths_B


def read_columns(
    episode: dict[str, Any], geometry: RouteGeometry, where: str, *, lengths_B: torch.Tensor, tokens_required: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The episode's (or batch's) routes `[B, S', M, K]` and token column `[B, S'']` (None when absent and not
    required), S', S'' >= the longest attended length; their attended positions read by `check_columns` against
    the model's geometry before anything is allocated."""
    routes = _tensor(episode, ROUTES_KEY, where)
    batch, longest = int(lengths_B.shape[0]), int(lengths_B.max()) if lengths_B.numel() else 0
    if routes.dim() != 4 or routes.shape[0] != batch or routes.shape[1] < longest:
        raise BatchGeometryError(
            f"{where}: '{ROUTES_KEY}' has shape {tuple(routes.shape)}, expected [{batch}, >= {longest}, M, K] (one row "
            "per input_ids position, B and S like input_ids)"
        )
    tokens = None
    if TOKENS_KEY in episode and episode[TOKENS_KEY] is not None:
        tokens = _tensor(episode, TOKENS_KEY, where)
        if tokens.dim() != 2 or tokens.shape[0] != batch or tokens.shape[1] < longest:
            raise BatchGeometryError(
                f"{where}: '{TOKENS_KEY}' has shape {tuple(tokens.shape)}, expected [{batch}, >= {longest}]"
            )
    elif tokens_required:
        raise BatchFieldError(f"{where}: '{TOKENS_KEY}' is missing")
    valid_BL = torch.arange(longest).unsqueeze(0) < lengths_B.cpu().unsqueeze(1)
    check_columns(
        routes[:, :longest],
        None if tokens is None else tokens[:, :longest],
        num_experts=geometry.num_experts,
        num_moe_layers=len(geometry.moe_layers),
        top_k=geometry.top_k,
        moe_layers=geometry.moe_layers,
        valid=valid_BL,
        where=where,
    )
    return routes, tokens


def check_tokens(tokens_BS: torch.Tensor, input_ids_BS: torch.Tensor, lengths_B: torch.Tensor, where: str) -> None:
    """The token check: the token each route row was routed for equals the batch's token at that position, on
    every attended position whose row is routed (`TokenMismatchError` names the first that is not)."""
    fix = f"{TOKEN_FIX}; or opt this worker out ({UNCHECKED_ENV}=1) to replay unchecked, counted"
    for b in range(int(lengths_B.shape[0])):
        n = int(lengths_B[b])
        require_route_tokens(tokens_BS[b, :n], input_ids_BS[b, :n], f"{where} row {b}", fix)


def unchecked_opt_out() -> bool:
    """Whether this worker opted out of R3's token check (`UNCHECKED_ENV`): it then replays without comparing."""
    return env_opt_out(UNCHECKED_ENV, on="replay R3 routes without the token check, counted", off="check them")


def ulysses_slice(column_xT: torch.Tensor, sp_size: int, sp_rank: int, fill: int) -> torch.Tensor:
    """Rank `sp_rank`'s part of a `[1, T, ...]` model-input column under Ulysses SP, as AReaL's
    `ulysses_pad_and_slice_inputs` cuts `input_ids`: padded with `fill` to a multiple of `sp_size`, then the
    `sp_rank`-th of `sp_size` equal slices along dim 1."""
    if sp_size <= 1:
        return column_xT
    pad = (sp_size - column_xT.shape[1] % sp_size) % sp_size
    if pad:
        shape = (column_xT.shape[0], pad, *column_xT.shape[2:])
        column_xT = torch.cat([column_xT, column_xT.new_full(shape, fill)], dim=1)
    part = column_xT.shape[1] // sp_size
    return column_xT[:, sp_rank * part : (sp_rank + 1) * part]


@dataclass(slots=True)
class RouteTable:
    """One call's route rows (compute_logp's or ppo_update's): row n per attended position of its batch, with
    the token it belongs to. `rows` is appended to by `add`, then read per micro-batch through `ROW_KEY`."""

    num_layers: int
    top_k: int
    routes: list[torch.Tensor] = field(default_factory=list)  # (n_i, M, K) int64 per added row
    tokens: list[torch.Tensor] = field(default_factory=list)  # (n_i,) int64
    size: int = 0
    _routes_NMK: torch.Tensor | None = None
    _tokens_N: torch.Tensor | None = None

    def add(
        self, input_ids_BS: torch.Tensor, lengths_B: torch.Tensor, routes_BSMK: torch.Tensor | None
    ) -> torch.Tensor:
        """Table rows for each attended position of a `[B, S]` batch (routes None: -1 rows, to be recorded);
        returns its `ROW_KEY` column (`[B, S]` int64, 0 on padding)."""
        row_BS = torch.zeros(tuple(input_ids_BS.shape), dtype=torch.int64)
        for b in range(int(lengths_B.shape[0])):
            n = int(lengths_B[b])
            row_BS[b, :n] = torch.arange(self.size + 1, self.size + n + 1)
            self.tokens.append(input_ids_BS[b, :n].cpu().to(torch.int64))
            if routes_BSMK is None:
                self.routes.append(torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.int64))
            else:
                self.routes.append(routes_BSMK[b, :n].cpu().to(torch.int64))
            self.size += n
        self._routes_NMK = self._tokens_N = None
        return row_BS.to(input_ids_BS.device)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._routes_NMK is None or self._tokens_N is None:
            empty = torch.empty((0, self.num_layers, self.top_k), dtype=torch.int64)
            self._routes_NMK = torch.cat([empty, *self.routes])
            self._tokens_N = torch.cat([torch.empty(0, dtype=torch.int64), *self.tokens])
            self.routes, self.tokens = [self._routes_NMK], [self._tokens_N]
        return self._routes_NMK, self._tokens_N

    def _index(self, row_xT: torch.Tensor) -> torch.Tensor:
        row = row_xT.detach().cpu().to(torch.int64)
        if bool(((row < 0) | (row > self.size)).any()):
            raise BatchFieldError(
                f"'{ROW_KEY}' holds {int(row.min())}..{int(row.max())} but this call's table has {self.size} rows: "
                "the column was not written by this actor's compute_logp / ppo_update (routereplay's own: do not set "
                "it)"
            )
        return row

    def model_routes(self, row_xT: torch.Tensor) -> torch.Tensor:
        """`[x, T, M, K]` int64 routes of a model input whose `ROW_KEY` slice is `row_xT`; -1 where it is 0."""
        routes_NMK, _ = self._tables()
        row = self._index(row_xT)
        out = torch.full((*row.shape, self.num_layers, self.top_k), -1, dtype=torch.int64)
        held = row > 0
        out[held] = routes_NMK[row[held] - 1]
        return out

    def model_tokens(self, row_xT: torch.Tensor) -> torch.Tensor:
        _, tokens_N = self._tables()
        row = self._index(row_xT)
        out = torch.zeros(tuple(row.shape), dtype=torch.int64)
        held = row > 0
        out[held] = tokens_N[row[held] - 1]
        return out

    def check_fed(self, row_xT: torch.Tensor, input_ids_xT: torch.Tensor, laid_out: str) -> None:
        """`TokenMismatchError` unless AReaL fed the model, at every position holding a row, that row's token."""
        expected = self.model_tokens(row_xT).to(input_ids_xT.device)
        held = row_xT.to(input_ids_xT.device) > 0
        require_fed_tokens(
            expected,
            input_ids_xT.to(torch.int64),
            lambda device: held.to(device),
            framework="AReaL",
            laid_out=laid_out,
            otherwise="this AReaL lays micro-batches out differently (tree training, a VLM batch?)",
            knobs="mb_spec, pad_to_maximum, Ulysses SP",
        )

    def fill(self, row_xT: torch.Tensor, recorded_xTMK: torch.Tensor) -> None:
        """R2: write what a micro-batch's routers chose into the rows it holds."""
        routes_NMK, _ = self._tables()
        row = self._index(row_xT)
        held = row > 0
        routes_NMK[row[held] - 1] = recorded_xTMK.detach().cpu().to(torch.int64)[held]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, M, K) routes and (N,) tokens, in the order `add` gave them."""
        return self._tables()


__all__ = [
    "ROW_KEY",
    "UNCHECKED_ENV",
    "RouteTable",
    "attended_lengths",
    "check_tokens",
    "read_columns",
    "ulysses_slice",
    "unchecked_opt_out",
]
