"""Where each token of a SkyRL micro-batch sits in the model input SkyRL's FSDP wrapper builds from it.

SkyRL 0.4.0's `HFModelWrapper.forward` (`workers/model_wrapper.py`) receives a micro-batch as left-padded
`sequences` / `attention_mask` (B, S) and feeds its HF model one of two layouts:

- `remove_microbatch_padding=True` (packed): `unpad_input` keeps the attended positions in row-major order,
  one row (1, N); under Ulysses SP (`sequence_parallel_size` > 1) `ulysses_pad_and_slice_inputs` pads it to a
  multiple of the SP size and this rank feeds its contiguous chunk (1, s);
- padded: (B, S) as given, with the attention mask; under Ulysses SP every row is padded and sliced the same
  way along S, (B, s).

`ModelInputLayout` places per-position values (routes, token ids) the same way with `routereplay.layout`, so
replay forces each token's own route, and checks its work at every forward: `check_tokens` compares the token
ids SkyRL fed the model with the ones it placed (`TokenMismatchError` if SkyRL laid the batch out otherwise).
`recorded` turns what a record pass saw back into (B, S) positions (R2).

Legend: B = sequences of the micro-batch, S = padded positions, N = attended tokens back to back, s =
positions this SP rank feeds, M = MoE layers, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from routereplay.errors import ConfigError, RowCountError
from routereplay.integrations.verl.micro_batch import require_fed_tokens
from routereplay.layout import ulysses_shard


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInputLayout:
    """How SkyRL's `HFModelWrapper` lays a (B, S) micro-batch out for its model on this rank."""

    attention_mask: torch.Tensor  # (B, S) bool
    remove_padding: bool
    sp_size: int = 1
    sp_rank: int = 0

    def __post_init__(self) -> None:
        if self.sp_size < 1 or not 0 <= self.sp_rank < self.sp_size:
            raise ConfigError(f"Ulysses SP rank {self.sp_rank} of {self.sp_size}: need 0 <= rank < size >= 1")
        if self.attention_mask.dim() != 2:
            raise ConfigError(f"a SkyRL micro-batch's attention_mask is (batch, seq_len); got {self.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.attention_mask.shape)

    def place(self, values_BS: torch.Tensor, fill: int) -> torch.Tensor:
        """(B, S, ...) per-position values -> what the model sees: (1, s, ...) packed or (B, s, ...) padded."""
        if tuple(values_BS.shape[:2]) != self.shape:
            raise RowCountError(
                f"values of shape {tuple(values_BS.shape)} for a micro-batch of {self.shape} positions; the routes "
                "belong to another micro-batch (split or reordered apart from sequences)"
            )
        mask_BS = self.attention_mask.to(values_BS.device)
        if self.remove_padding:
            packed = values_BS[mask_BS].unsqueeze(0)  # unpad_input's row-major order
            return ulysses_shard(packed, self.sp_size, self.sp_rank, dim=1, fill=fill)
        if not values_BS.dtype.is_floating_point:
            values_BS = values_BS.masked_fill(~mask_BS.view(*self.shape, *([1] * (values_BS.dim() - 2))), fill)
        return ulysses_shard(values_BS, self.sp_size, self.sp_rank, dim=1, fill=fill)

    def holds_token(self, device: torch.device) -> torch.Tensor:
        """Bool, shaped like the model input: the positions that hold an attended token of the micro-batch."""
        return self.place(self.attention_mask.to(device), fill=0)

    def replay_mask(self, device: torch.device) -> torch.Tensor | None:
        """The attention mask for `Replayer.replay`: padded layouts only (packed feeds no mask)."""
        return None if self.remove_padding else self.holds_token(device).to(torch.int64)

    def check_tokens(self, sequences_BS: torch.Tensor, model_input_ids: torch.Tensor) -> None:
        """`TokenMismatchError` unless SkyRL fed the model this layout's tokens at every attended position:
        routes placed by `place` would otherwise land on other tokens."""
        require_fed_tokens(
            self.place(sequences_BS.to(model_input_ids.device), fill=0),
            model_input_ids,
            self.holds_token,
            framework="SkyRL",
            laid_out=f"remove_microbatch_padding={self.remove_padding}, SP rank {self.sp_rank} of {self.sp_size}",
            otherwise="this SkyRL lays micro-batches out differently (a VLM batch?)",
            knobs="remove_microbatch_padding, Ulysses SP",
        )

    def recorded(self, routes_xsMK: torch.Tensor, sp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """(B, S, M, K) int64: what a record pass saw (all SP ranks' shards), -1 where no token was attended."""
        if self.sp_size > 1:
            shards = [torch.empty_like(routes_xsMK) for _ in range(self.sp_size)]
            dist.all_gather(shards, routes_xsMK.contiguous(), group=sp_group)
            routes_xsMK = torch.cat(shards, dim=1)
        mask_BS = self.attention_mask.to(routes_xsMK.device)
        out_BSMK = routes_xsMK.new_full((*self.shape, *routes_xsMK.shape[2:]), -1, dtype=torch.int64)
        if self.remove_padding:
            out_BSMK[mask_BS] = routes_xsMK[0, : int(mask_BS.sum())].to(torch.int64)
        else:
            width = self.shape[1]
            out_BSMK[mask_BS] = routes_xsMK[:, :width][mask_BS].to(torch.int64)
        return out_BSMK


def layout_of(model: object, attention_mask: torch.Tensor) -> ModelInputLayout:
    """The layout SkyRL's `HFModelWrapper` (`model`) will give this micro-batch on this rank."""
    remove_padding = bool(getattr(model, "remove_microbatch_padding", False))
    sp_size = int(getattr(model, "sequence_parallel_size", 1) or 1)
    sp_rank = 0
    if sp_size > 1:
        from skyrl.backends.skyrl_train.distributed.ulysses.utils import get_ulysses_sequence_parallel_group

        sp_rank = dist.get_rank(get_ulysses_sequence_parallel_group())
    return ModelInputLayout(
        attention_mask=attention_mask.to(torch.bool), remove_padding=remove_padding, sp_size=sp_size, sp_rank=sp_rank
    )


__all__ = ["ModelInputLayout", "layout_of"]
