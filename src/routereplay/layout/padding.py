"""Padded batches <-> ragged routes, left or right padding, or any attention mask.

A padded batch holds sequence b in row b of a (B, S, ...) array: at the start of the row with
right padding, at the end with left padding (what generation engines and HF `generate` use), or at
the attended positions of an attention mask. Padding rows are -1, never 0: a 0 would replay as
expert 0.

Legend: B = sequences, S = padded positions per row, N = tokens of all sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from routereplay.enums import StrEnum
from routereplay.errors import BatchShapeError, ConfigError
from routereplay.layout.array import Array, as_tensor, index_tensor, like, put, select
from routereplay.layout.ragged import Ragged, cu_seqlens_of, positions, sequence_ids


class Side(StrEnum):
    LEFT = "left"
    RIGHT = "right"


def unpad_index(lengths_B: torch.Tensor, seq_len: int, side: Side | str = Side.RIGHT) -> torch.Tensor:
    """(N,) flat positions in a (B * S) batch of the tokens of sequences of `lengths_B`, in order."""
    side = Side(side)
    if lengths_B.numel() and int(lengths_B.max()) > seq_len:
        b = int(torch.argmax(lengths_B))
        raise BatchShapeError(f"sequence {b} has {int(lengths_B[b])} tokens but the padded rows hold {seq_len}")
    cu = cu_seqlens_of(lengths_B)
    offset_N = positions(cu)
    row_N = sequence_ids(cu)
    if side is Side.LEFT:
        offset_N = offset_N + torch.repeat_interleave(seq_len - lengths_B, lengths_B)
    return row_N * seq_len + offset_N


def unpad(
    padded_BS: Array,
    lengths: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    attention_mask: np.ndarray | torch.Tensor | None = None,
    side: Side | str = Side.RIGHT,
) -> Ragged[Array]:
    """The tokens of each row of a padded batch, back to back. Give `lengths` (with `side`) or an
    `attention_mask` (B, S) whose attended positions are the tokens, in order."""
    x = as_tensor(padded_BS)
    if x.ndim < 2:
        raise BatchShapeError(f"a padded batch needs shape (B, S, ...), got {tuple(x.shape)}")
    batch, seq_len = x.shape[:2]
    flat = x.reshape(batch * seq_len, *x.shape[2:])
    if attention_mask is not None:
        if lengths is not None:
            raise ConfigError("give lengths or attention_mask, not both")
        mask_BS = as_tensor(attention_mask).to(torch.bool)
        if tuple(mask_BS.shape) != (batch, seq_len):
            raise BatchShapeError(
                f"attention_mask has shape {tuple(mask_BS.shape)} but the batch is {(batch, seq_len)}"
            )
        index_N = torch.nonzero(mask_BS.reshape(-1)).squeeze(1).to(flat.device)
        lengths_B = mask_BS.sum(1).cpu()
    else:
        if lengths is None:
            raise ConfigError("unpad needs the sequence lengths or an attention_mask")
        lengths_B = index_tensor(lengths, "lengths")
        if lengths_B.numel() != batch:
            raise BatchShapeError(f"got {lengths_B.numel()} lengths for a batch of {batch} rows")
        index_N = unpad_index(lengths_B, seq_len, side).to(flat.device)
    return Ragged(like(select(flat, index_N), padded_BS), cu_seqlens_of(lengths_B))


def pad(
    ragged: Ragged[Any],
    *,
    side: Side | str = Side.RIGHT,
    length: int | None = None,
    multiple: int = 1,
    fill: int = -1,
) -> Any:
    """(B, S, ...) batch of the ragged sequences, `fill` in the padding. S is `length` or the longest
    sequence, rounded up to `multiple` (e.g. the SP world size)."""
    if multiple < 1:
        raise ConfigError(f"multiple must be >= 1, got {multiple}")
    lengths_B = ragged.lengths
    longest = int(lengths_B.max()) if lengths_B.numel() else 0
    seq_len = longest if length is None else length
    if seq_len < longest:
        raise BatchShapeError(f"length {length} is shorter than the longest sequence ({longest} tokens)")
    seq_len = -(-seq_len // multiple) * multiple
    x = as_tensor(ragged.values)
    batch = ragged.num_sequences
    out = put(x, unpad_index(lengths_B, seq_len, side), batch * seq_len, fill=fill)
    return like(out.reshape(batch, seq_len, *x.shape[1:]), ragged.values)


def attention_mask_of(
    lengths: Sequence[int] | np.ndarray | torch.Tensor, seq_len: int, side: Side | str
) -> torch.Tensor:
    """(B, S) bool mask of sequences of `lengths` padded on `side` to `seq_len`."""
    lengths_B = index_tensor(lengths, "lengths")
    mask = torch.zeros(lengths_B.numel() * seq_len, dtype=torch.bool)
    mask[unpad_index(lengths_B, seq_len, side)] = True
    return mask.reshape(lengths_B.numel(), seq_len)
