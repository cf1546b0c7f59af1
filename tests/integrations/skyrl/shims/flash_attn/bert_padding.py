"""Pure-PyTorch `pad_input` / `unpad_input` with the signatures and results flash-attn 2.8's `bert_padding` has.

Written here from their documented behaviour (not flash-attn's code): `unpad_input` keeps the attended positions
of a (B, S, ...) tensor in row-major order and returns `(kept (nnz, ...), indices (nnz,) into the flattened
B*S positions, cu_seqlens (B + 1,) int32, max_seqlen_in_batch int, seqused (B,) int32)`; `pad_input` scatters
(nnz, ...) rows back to (B, S, ...) with zeros elsewhere. SkyRL's FSDP model wrapper packs a micro-batch with
them (`remove_microbatch_padding=True`).

Legend: B = sequences, S = padded positions, nnz = attended positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(B, S, ...) -> the attended rows (nnz, ...), their flat indices, cu_seqlens, the longest length, lengths.

    `unused_mask` marks positions that are allocated but unused; they are kept like attended ones and do not
    count in `seqused`."""
    keep_BS = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens_B = keep_BS.sum(dim=-1, dtype=torch.int32)
    seqused_B = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices_nnz = torch.nonzero(keep_BS.flatten(), as_tuple=False).flatten()
    cu_seqlens_B1 = F.pad(torch.cumsum(seqlens_B, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens_B.max()) if seqlens_B.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices_nnz], indices_nnz, cu_seqlens_B1, max_seqlen, seqused_B


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(nnz, ...) rows at flat `indices` -> (batch, seqlen, ...), zeros where no row lands (differentiable)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
