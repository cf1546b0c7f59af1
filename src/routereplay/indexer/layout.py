"""Where an indexer trace's rows live: implicit, unknown, or stored in which block.

A row (query token `start + t`, layer l) sees n = start + t + 1 keys. When n <= I the indexer picks
them all, so the row is implicit ("every causal key", no bits). Rows from token
t0 = clamp(I - start, 0, T) on are stored: for each layer, blocks of `block_rows` consecutive tokens
(the last maybe shorter), layer-major, unknown rows (all -1) skipped inside their block. The unknown
rows are one bit each, layer-major, present only when some row is unknown.
Legend: T = tokens (rows), L = layers, I = index_topk, B = block_rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The block grid of a (T, L, I, start, B) trace."""

    num_tokens: int
    num_layers: int
    index_topk: int
    start: int
    block_rows: int

    @property
    def first_stored(self) -> int:
        """t0: the first token whose query sees more than I keys."""
        return min(self.num_tokens, max(0, self.index_topk - self.start))

    @property
    def blocks_per_layer(self) -> int:
        return -(-(self.num_tokens - self.first_stored) // self.block_rows)

    @property
    def num_blocks(self) -> int:
        return self.num_layers * self.blocks_per_layer

    def block(self, index: int) -> tuple[int, int, int]:
        """(layer column, first token, end token) of block `index`."""
        layer, j = divmod(index, self.blocks_per_layer)
        begin = self.first_stored + j * self.block_rows
        return layer, begin, min(self.num_tokens, begin + self.block_rows)

    def visible(self, tokens: np.ndarray) -> np.ndarray:
        """Keys the queries of rows `tokens` see (start + t + 1), as int64."""
        return self.start + 1 + tokens.astype(np.int64)

    def block_stats(self, unknown_LT: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Per block: stored rows (known rows) and the keys their queries see in total, vectorised."""
        t0, rows, per = self.first_stored, self.block_rows, self.blocks_per_layer
        if unknown_LT is None:  # no mask: closed form, O(blocks) memory however long the blocks are
            begin = t0 + rows * np.arange(per, dtype=np.int64)
            end = np.minimum(self.num_tokens, begin + rows)
            cells = end - begin
            seen = (self.visible(begin) + self.visible(end - 1)) * cells // 2
            return np.tile(cells, self.num_layers), np.tile(seen, self.num_layers)
        span = per * rows
        tokens = t0 + np.arange(span, dtype=np.int64)
        inside = tokens < self.num_tokens
        known_LS = np.broadcast_to(inside, (self.num_layers, span)).copy()
        known_LS[:, : self.num_tokens - t0] &= ~unknown_LT[:, t0:]
        cells = known_LS.reshape(self.num_layers, per, rows).sum(axis=2).ravel()
        seen = (known_LS * self.visible(tokens)).reshape(self.num_layers, per, rows).sum(axis=2).ravel()
        return cells.astype(np.int64), seen.astype(np.int64)


def unpack_unknown(packed: np.ndarray | None, num_layers: int, num_tokens: int) -> np.ndarray | None:
    """The (L, T) unknown-row mask from its layer-major bits (None: no row is unknown)."""
    if packed is None:
        return None
    bits = np.unpackbits(packed, count=num_layers * num_tokens, bitorder="little")
    return bits.reshape(num_layers, num_tokens).astype(np.bool_)


def pack_unknown(unknown_LT: np.ndarray) -> np.ndarray | None:
    """Layer-major bits of the (L, T) unknown mask, or None when no row is unknown."""
    if not unknown_LT.any():
        return None
    return np.packbits(unknown_LT.ravel(), bitorder="little")


__all__ = ["BlockLayout", "pack_unknown", "unpack_unknown"]
