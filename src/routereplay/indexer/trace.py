"""`IndexerTrace`: the DSA indexer choices of one sequence, held compactly.

DeepSeek-V3.2 / GLM-5 sparse attention picks, per query token and DSA layer, `index_topk` (I) key
positions to attend. Dense, that is T x L x I int32 (DeepSeek-V3.2: 61 x 2048 x 4 = 488 KiB a
token), so the trace keeps it compact (`routereplay.indexer.layout`): a row whose query sees at
most I keys costs nothing (it picks them all), an unknown row costs one bit, and every other row
is a block of bit-packed gaps or a bitmap over its visible keys, whichever is smaller
(`routereplay.indexer.blocks`). `to_dense` gives back the canonical form exactly
(`routereplay.indexer.canonical`); `encode` / `decode` are the checksummed blob
(`routereplay.indexer.blob`).
Legend: T = query tokens (rows), L = DSA layers, I = index_topk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.errors import ConfigError
from routereplay.indexer.blob import IndexerParts, pack_blob, parse_blob
from routereplay.indexer.blocks import decode_block, encode_block
from routereplay.indexer.canonical import check_dense
from routereplay.indexer.layout import BlockLayout, pack_unknown, unpack_unknown
from routereplay.indexer.limits import (
    DEFAULT_INDEXER_LIMITS,
    MAX_BLOCK_ROWS,
    MAX_POSITION,
    IndexerLimits,
    checked_indexer_limits,
)

DEFAULT_BLOCK_ROWS = 128  # rows per block: the gap width adapts per block, the block table stays small


class IndexerTrace:
    """The indexer choices of one sequence: rows are query tokens start .. start + T - 1."""

    __slots__ = ("_bits", "_extra", "_modes", "_offsets", "_payload", "_unknown", "block_rows", "index_topk",
                 "layers", "num_tokens", "start")  # fmt: skip
    __hash__ = None  # type: ignore[assignment]  # equality compares contents; instances are not keys

    def __init__(
        self,
        *,
        layers: tuple[int, ...],
        index_topk: int,
        start: int,
        num_tokens: int,
        block_rows: int,
        unknown: np.ndarray | None,
        modes: np.ndarray,
        bits: np.ndarray,
        extra: np.ndarray,
        offsets: np.ndarray,
        payload: bytes,
    ) -> None:
        """Internal: use `from_dense` or `decode`, which check what they are given."""
        self.layers, self.index_topk, self.start, self.num_tokens = layers, index_topk, start, num_tokens
        self.block_rows = block_rows
        self._unknown, self._modes, self._bits, self._extra = unknown, modes, bits, extra
        self._offsets, self._payload = offsets, payload

    @classmethod
    def from_dense(
        cls,
        positions_TLI: Any,
        layers: Sequence[int],
        index_topk: int,
        start: int = 0,
        *,
        block_rows: int = DEFAULT_BLOCK_ROWS,
    ) -> IndexerTrace:
        """The trace of a canonical dense (T, L, I) array (checked: `IndexerRouteError` names the bad row)."""
        layer_tuple = checked_layers(layers)
        index_topk = _checked(index_topk, "index_topk", 1, DEFAULT_INDEXER_LIMITS.max_index_topk)
        start = _checked(start, "start", 0, MAX_POSITION)
        block_rows = _checked(block_rows, "block_rows", 1, MAX_BLOCK_ROWS)
        dense_TLI = check_dense(positions_TLI, layer_tuple, index_topk, start)
        layout = BlockLayout(dense_TLI.shape[0], len(layer_tuple), index_topk, start, block_rows)
        unknown_LT = (dense_TLI[:, :, 0] < 0).T
        modes = np.zeros(layout.num_blocks, np.uint8)
        bits = np.zeros(layout.num_blocks, np.uint8)
        extra = np.zeros(layout.num_blocks, np.uint32)
        offsets = np.zeros(layout.num_blocks + 1, np.int64)
        parts: list[bytes] = []
        for index in range(layout.num_blocks):
            layer, begin, end = layout.block(index)
            tokens = begin + np.flatnonzero(~unknown_LT[layer, begin:end])
            mode, width, unary, data = encode_block(dense_TLI[tokens, layer, :], layout.visible(tokens))
            modes[index], bits[index], extra[index] = mode, width, unary
            offsets[index + 1] = offsets[index] + len(data)
            parts.append(data)
        return cls(
            layers=layer_tuple, index_topk=index_topk, start=start, num_tokens=layout.num_tokens,
            block_rows=block_rows, unknown=pack_unknown(unknown_LT), modes=modes, bits=bits, extra=extra,
            offsets=offsets, payload=b"".join(parts),
        )  # fmt: skip

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.num_tokens, self.num_layers, self.index_topk, self.start, self.block_rows)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the compact form (payload, block table, unknown-row bits)."""
        unknown = 0 if self._unknown is None else self._unknown.nbytes
        table = self._modes.nbytes + self._bits.nbytes + self._extra.nbytes + self._offsets.nbytes
        return len(self._payload) + table + unknown

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense int32 form: T * L * I * 4."""
        return self.num_tokens * self.num_layers * self.index_topk * 4

    def unknown_rows(self) -> np.ndarray:
        """(T, L) bool: rows whose choices are unknown (all -1; replay computes them live)."""
        unknown_LT = unpack_unknown(self._unknown, self.num_layers, self.num_tokens)
        if unknown_LT is None:
            return np.zeros((self.num_tokens, self.num_layers), np.bool_)
        return unknown_LT.T.copy()

    def to_dense(self) -> np.ndarray:
        """The canonical (T, L, I) int32 array: sorted positions, -1 padding, all -1 for unknown rows."""
        return self._dense_rows(0, self.num_tokens)

    def slice(self, begin: int, end: int) -> IndexerTrace:
        """Rows begin .. end - 1 (tokens start + begin ..), as a trace of their own."""
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= self.num_tokens):
            raise ConfigError(
                f"slice({begin!r}, {end!r}) must satisfy 0 <= begin <= end <= num_tokens={self.num_tokens}"
            )
        return IndexerTrace.from_dense(
            self._dense_rows(begin, end), self.layers, self.index_topk, self.start + begin, block_rows=self.block_rows
        )

    def padded(self, num_tokens: int) -> IndexerTrace:
        """This trace extended to `num_tokens` rows, the new rows unknown (all -1), built compactly: the
        payload is shared, each layer gains empty blocks and the unknown bits grow by L bits a row - never
        the dense form (equal to `merged_indexer(self, None, self.start, num_tokens)`)."""
        if not (isinstance(num_tokens, int) and self.num_tokens <= num_tokens <= MAX_POSITION + 1 - self.start):
            raise ConfigError(f"padded({num_tokens!r}) must be an int in [{self.num_tokens}, 2^31 - start]")
        if num_tokens == self.num_tokens:
            return self
        old, new = self.layout, BlockLayout(num_tokens, self.num_layers, self.index_topk, self.start, self.block_rows)
        unknown_LT = np.ones((self.num_layers, num_tokens), np.bool_)
        held_LT = unpack_unknown(self._unknown, self.num_layers, self.num_tokens)
        unknown_LT[:, : self.num_tokens] = False if held_LT is None else held_LT
        modes = np.zeros(new.num_blocks, np.uint8)
        bits = np.zeros(new.num_blocks, np.uint8)
        extra = np.zeros(new.num_blocks, np.uint32)
        lengths = np.zeros(new.num_blocks, np.int64)
        if old.num_blocks:  # then first_stored is the same: layer l's blocks keep their order, new ones are empty
            at = (np.arange(self.num_layers)[:, None] * new.blocks_per_layer + np.arange(old.blocks_per_layer)).ravel()
            modes[at], bits[at], extra[at], lengths[at] = self._modes, self._bits, self._extra, np.diff(self._offsets)
        offsets = np.zeros(new.num_blocks + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return IndexerTrace(
            layers=self.layers, index_topk=self.index_topk, start=self.start, num_tokens=num_tokens,
            block_rows=self.block_rows, unknown=pack_unknown(unknown_LT), modes=modes, bits=bits, extra=extra,
            offsets=offsets, payload=self._payload,
        )  # fmt: skip

    def encode(self) -> bytes:
        """The versioned, checksummed blob of this trace (`IndexerTrace.decode` reads it back)."""
        return pack_blob(
            IndexerParts(
                self.layers, self.index_topk, self.start, self.num_tokens, self.block_rows, self._unknown,
                self._modes, self._bits, self._extra, self._offsets, self._payload,
            )
        )  # fmt: skip

    @classmethod
    def decode(
        cls, blob: bytes | bytearray | memoryview, limits: IndexerLimits | None = DEFAULT_INDEXER_LIMITS
    ) -> IndexerTrace:
        """The trace of an `encode` blob, every length and row checked before it is trusted; its shape within
        `limits` (None: the defaults), its dense form at most `limits.max_expansion` entries a blob byte."""
        p = parse_blob(blob, checked_indexer_limits(limits))
        return cls(
            layers=p.layers, index_topk=p.index_topk, start=p.start, num_tokens=p.num_tokens, block_rows=p.block_rows,
            unknown=p.unknown, modes=p.modes, bits=p.bits, extra=p.extra, offsets=p.offsets, payload=p.payload,
        )  # fmt: skip

    def _dense_rows(self, begin: int, end: int) -> np.ndarray:
        layout, index_topk = self.layout, self.index_topk
        out_TLI = np.full((end - begin, self.num_layers, index_topk), -1, np.int32)
        implicit_end = min(end, layout.first_stored)
        if begin < implicit_end:  # queries seeing <= I keys pick every one: 0 .. p
            visible = layout.visible(np.arange(begin, implicit_end))
            slots = np.arange(index_topk, dtype=np.int32)
            out_TLI[: implicit_end - begin] = np.where(slots < visible[:, None], slots, -1)[:, None, :]
        unknown_LT = unpack_unknown(self._unknown, self.num_layers, self.num_tokens)
        if unknown_LT is not None and begin < implicit_end:
            out_TLI[: implicit_end - begin][unknown_LT[:, begin:implicit_end].T] = -1
        rows = self.block_rows
        for layer in range(self.num_layers):
            first = max(0, (begin - layout.first_stored) // rows)
            for j in range(first, layout.blocks_per_layer):
                index = layer * layout.blocks_per_layer + j
                _, block_begin, block_end = layout.block(index)
                if block_begin >= end:
                    break
                tokens = np.arange(block_begin, block_end)
                if unknown_LT is not None:
                    tokens = tokens[~unknown_LT[layer, block_begin:block_end]]
                positions_CI = self.block_positions(index, tokens)
                keep = (tokens >= begin) & (tokens < end)
                out_TLI[tokens[keep] - begin, layer, :] = positions_CI[keep]
        return out_TLI

    def block_positions(self, index: int, tokens: np.ndarray) -> np.ndarray:
        """The (C, I) positions stored in block `index` for its known rows `tokens`."""
        data = memoryview(self._payload)[int(self._offsets[index]) : int(self._offsets[index + 1])]
        return decode_block(
            data, int(self._modes[index]), int(self._bits[index]), int(self._extra[index]), self.layout.visible(tokens),
            self.index_topk,
            f"indexer block {index}",
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexerTrace):
            return NotImplemented
        same_shape = (self.layers, self.index_topk, self.start, self.num_tokens) == (
            other.layers, other.index_topk, other.start, other.num_tokens,
        )  # fmt: skip
        if not same_shape:
            return False
        if self.block_rows == other.block_rows and self._payload == other._payload:
            if all(np.array_equal(a, b) for a, b in zip(self._table(), other._table(), strict=True)):
                return np.array_equal(self.unknown_rows(), other.unknown_rows())
        return bool(np.array_equal(self.to_dense(), other.to_dense()))

    def _table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._modes, self._bits, self._extra

    def __repr__(self) -> str:
        return (
            f"IndexerTrace(tokens={self.num_tokens}, layers={list(self.layers)[:8]}, index_topk={self.index_topk}, "
            f"start={self.start}, nbytes={self.nbytes}, dense_nbytes={self.dense_nbytes})"
        )


def check_indexer(indexer: Any, start: int, num_rows: int) -> IndexerTrace | None:
    """The indexer choices a `RouteTrace` carries: None, or an `IndexerTrace` of exactly its rows."""
    if indexer is None:
        return None
    if not isinstance(indexer, IndexerTrace):
        raise ConfigError(f"indexer must be an IndexerTrace or None, got {type(indexer).__name__}")
    if indexer.start != start or indexer.num_tokens != num_rows:
        raise ConfigError(
            f"indexer choices cover tokens [{indexer.start}, {indexer.start + indexer.num_tokens}) but the routes "
            f"cover [{start}, {start + num_rows}); slice them to the same rows"
        )
    return indexer


def merged_indexer(
    first: IndexerTrace | None, second: IndexerTrace | None, start: int, num_rows: int
) -> IndexerTrace | None:
    """Indexer choices of a merged trace covering [start, start + num_rows): a row comes from `first` where it
    is known there, else from `second`; rows neither knows stay unknown (all -1)."""
    given = [t for t in (first, second) if t is not None]
    if not given:
        return None
    if len({(t.layers, t.index_topk) for t in given}) != 1:
        raise ConfigError(
            f"cannot merge indexer choices of layers/index_topk {[(t.layers, t.index_topk) for t in given]}"
        )
    dense_TLI = np.full((num_rows, len(given[0].layers), given[0].index_topk), -1, np.int32)
    for trace in (second, first):  # first last: its known rows win
        if trace is None:
            continue
        rows_TLI = trace.to_dense()
        known_TL = rows_TLI[:, :, 0] >= 0
        at = trace.start - start
        target_TLI = dense_TLI[at : at + trace.num_tokens]
        target_TLI[known_TL] = rows_TLI[known_TL]
    return IndexerTrace.from_dense(dense_TLI, given[0].layers, given[0].index_topk, start)


def checked_layers(layers: Any) -> tuple[int, ...]:
    """Distinct global layer numbers in [0, 2^32) as a tuple (ConfigError otherwise)."""
    if isinstance(layers, (str, bytes, dict)) or not isinstance(layers, (Sequence, np.ndarray, range)):
        raise ConfigError(f"layers must be a sequence of global layer numbers, got {type(layers).__name__}")
    if len(layers) > DEFAULT_INDEXER_LIMITS.max_layers:
        raise ConfigError(f"layers names {len(layers)} layers, above {DEFAULT_INDEXER_LIMITS.max_layers}")
    out = tuple(_checked(x, f"layers[{i}]", 0, (1 << 32) - 1) for i, x in enumerate(layers))
    if len(set(out)) != len(out):
        raise ConfigError(f"layers={list(out)[:16]} names a layer twice; global layer numbers are distinct")
    return out


def _checked(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be an int in [{low}, {high}]")
    return int(value)


__all__ = ["DEFAULT_BLOCK_ROWS", "MAX_BLOCK_ROWS", "IndexerTrace", "check_indexer", "checked_layers", "merged_indexer"]
