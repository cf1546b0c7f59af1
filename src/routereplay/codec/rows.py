"""The payload of a codec blob: routed rows <-> packed bit streams, decoded in bounded steps.

Raw payload (see `routereplay.codec` for the whole layout): an optional validity bitmap of R bits
(bit r = row r routed, `np.packbits(bitorder="little")`), then the routed rows in row-major order.
SET mode: one stream of N ranks of b bits (b > 64: one stream per 64-bit word of the ranks, low
word first). ORDERED mode: one stream of N * K ids of ceil(log2 E) bits.

Encoding ranks and packs `RANK_CHUNK_ROWS` rows at a time (`ranker.SubsetRanker`, then
`bitpack.pack_lanes_into` at the chunk's byte offset: a multiple of 8 rows ends on a byte), so its
working set is one chunk's columns and ranks; ordered ids are packed in the same chunks.
Decoding writes straight into the one output array. The bitmap, the streams and the ids are
walked `chunk_entries` ids at a time (`CodecLimits.chunk_entries`): each step unpacks, checks and
unranks a few uint64 arrays of one step's length, so the working set is fixed (about
`WORKING_BYTES_PER_ENTRY * chunk_entries` bytes) and the peak is the output plus that, whatever T.
Legend: R = T * L (token, layer) rows, N = routed rows, K = top-k, E = experts, b = bits per row,
C = rows of one step, n = routed rows of one step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from routereplay.bitpack import MAX_VIEW_BITS, MIN_LANE_PACK_BITS, pack_bits, pack_lanes_into, unpack_bits
from routereplay.codec.limits import CodecLimits
from routereplay.codec.native import UnrankPlan, can_unrank_into, may_unrank, unrank_plan, unrank_set_rows
from routereplay.codec.ranker import RANK_CHUNK_ROWS, SubsetRanker
from routereplay.codec.subsets import U64_MAX, SubsetUnranker, binomial_table
from routereplay.enums import CodecMode
from routereplay.errors import CodecFormatError
from routereplay.trace.validation import canonical_dtype

WIDE_ENTRY_WORDS = 6  # 8-byte words a Python-int table entry costs on top of its digits
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def id_bits(num_experts: int) -> int:
    return (num_experts - 1).bit_length()


def rank_bits(count: int) -> int:
    return (count - 1).bit_length() if count > 1 else 0


def payload_streams(
    num_experts: int, top_k: int, mode: CodecMode, limits: CodecLimits, what: str
) -> list[tuple[int, int]]:
    """(values per row, bits per value) of each packed stream; set mode checks its table first."""
    if mode is CodecMode.ORDERED:
        return [(top_k, id_bits(num_experts))]
    limits.check_set_table(num_experts, top_k, 1, what)  # bounds the cost of C(E, K) itself
    bits = rank_bits(math.comb(num_experts, top_k))
    words = max(1, -(-bits // 64))
    if words > 1:  # Python-int table entries: about 40 + 4 * words bytes each (measured)
        limits.check_set_table(num_experts, top_k, WIDE_ENTRY_WORDS + words, what)
    if bits <= 64:
        return [(1, bits)]
    return [(1, min(64, bits - 64 * q)) for q in range(words)]


def payload_bytes(num_rows: int, streams: list[tuple[int, int]]) -> int:
    return sum(-(-num_rows * per_row * bits // 8) for per_row, bits in streams)


def encode_rows(
    experts_NK: np.ndarray, num_experts: int, top_k: int, mode: CodecMode, streams: list[tuple[int, int]]
) -> bytes:
    """Pack routed rows into the streams of `payload_streams`: ordered ids, or set ranks."""
    if mode is CodecMode.ORDERED:  # chunks of a multiple of 8 ids end on a byte: packed apart, joined
        return b"".join(
            pack_bits(experts_NK[r0 : r0 + RANK_CHUNK_ROWS].astype(np.uint64), streams[0][1])
            for r0 in range(0, len(experts_NK), RANK_CHUNK_ROWS)
        )
    count = math.comb(num_experts, top_k)
    if len(experts_NK) == 0 or rank_bits(count) == 0:
        return b""
    ranker = SubsetRanker(binomial_table(num_experts, top_k, count))
    bits = streams[0][1]
    if ranker.fast and len(streams) == 1 and MIN_LANE_PACK_BITS <= bits <= MAX_VIEW_BITS:
        return _encode_ranks_chunked(experts_NK, ranker, bits)
    ranks_N = ranker.rank(experts_NK)
    words = [ranks_N] if len(streams) == 1 else [((ranks_N >> (64 * q)) & U64_MAX) for q in range(len(streams))]
    return b"".join(pack_bits(word.astype(np.uint64), bits) for word, (_, bits) in zip(words, streams, strict=True))


def _encode_ranks_chunked(experts_NK: np.ndarray, ranker: SubsetRanker, bits: int) -> bytes:
    """Rank and pack `RANK_CHUNK_ROWS` rows at a time into one stream (working set: one chunk)."""
    num_rows = len(experts_NK)
    size = -(-num_rows * bits // 8)
    out_B = np.zeros(-(-num_rows // 8) * bits + 8, np.uint8)  # 8 bytes past the last group's window
    ranks_C = np.empty(min(num_rows, RANK_CHUNK_ROWS), np.uint64)
    for r0 in range(0, num_rows, RANK_CHUNK_ROWS):  # a multiple of 8 rows: chunks start on a byte
        chunk_C = ranks_C[: min(RANK_CHUNK_ROWS, num_rows - r0)]
        ranker.rank_into(experts_NK[r0 : r0 + RANK_CHUNK_ROWS], chunk_C)
        pack_lanes_into(chunk_C, bits, out_B, r0 * bits // 8)
    return out_B[:size].tobytes()


class PayloadDecoder:
    """Decodes one raw payload into a (R, K) id array, `chunk_entries` ids per step."""

    __slots__ = (
        "count",
        "dtype",
        "mode",
        "native",
        "num_experts",
        "raw",
        "starts",
        "streams",
        "top_k",
        "unranker",
    )

    def __init__(
        self,
        raw: memoryview,
        num_experts: int,
        top_k: int,
        mode: CodecMode,
        streams: list[tuple[int, int]],
        *,
        native: bool = True,
    ) -> None:
        """`native=False` keeps to the numpy paths (the reference the C kernel is tested against)."""
        self.raw, self.num_experts, self.top_k, self.mode, self.streams = raw, num_experts, top_k, mode, streams
        self.dtype = canonical_dtype(num_experts)
        self.count = math.comb(num_experts, top_k) if mode is CodecMode.SET else 0
        self.starts: list[int] = []
        self.unranker: SubsetUnranker | None = None
        self.native = native

    def decode(self, num_rows: int, has_missing: bool, chunk_entries: int) -> np.ndarray:
        """All R = `num_rows` rows; unrouted rows (bitmap bit 0) are -1."""
        K, raw = self.top_k, self.raw
        bitmap_R8: np.ndarray | None = None
        pos, num_valid = 0, num_rows
        if has_missing:
            pos = -(-num_rows // 8)
            bitmap_R8 = np.frombuffer(raw, np.uint8, pos)
            if num_rows % 8 and int(bitmap_R8[-1]) >> (num_rows % 8):
                raise CodecFormatError(f"validity bitmap has padding bits set past row {num_rows}: corrupt payload")
            num_valid = sum(
                int(_POPCOUNT[bitmap_R8[i : i + chunk_entries]].sum(dtype=np.int64))
                for i in range(0, pos, chunk_entries)
            )
            if num_valid == num_rows:
                raise CodecFormatError("flags bit 1 says some rows are all -1 but the validity bitmap marks none")
        self._check_streams(pos, num_valid)
        if num_valid and self.mode is CodecMode.SET and rank_bits(self.count) > 0:
            table_JE = binomial_table(self.num_experts, K, self.count)
            # the low-id table pays only on the numpy path: the kernel walks float columns instead
            kernel = self.native and len(self.streams) == 1 and may_unrank(self.count, K)
            low_table_rows = 0 if kernel else num_valid
            self.unranker = SubsetUnranker(table_JE, self.count, rows=low_table_rows)
        plan = self._kernel_plan()
        if plan is not None:  # one pass over the bitmap and the ranks, straight into the output
            out_RK = np.empty((num_rows, K), self.dtype)
            bad = unrank_set_rows(plan, raw, out_RK, self.streams[0][1], stream_offset=self.starts[0], bitmap_bytes=pos)
            if bad != -1:
                self._refuse_rank(0, bad)
            return out_RK
        out_RK = np.full((num_rows, K), -1, self.dtype) if has_missing else np.empty((num_rows, K), self.dtype)
        step = max(1, chunk_entries // K)  # rows per step: <= max(chunk_entries, K) ids
        routed = 0
        for r0 in range(0, num_rows, step):
            r1 = min(num_rows, r0 + step)
            if bitmap_R8 is None:
                self._rows_into(routed, out_RK[r0:r1])
                routed += r1 - r0
                continue
            bits_C = np.unpackbits(bitmap_R8[r0 // 8 : -(-r1 // 8)], bitorder="little")
            valid_C = bits_C[r0 % 8 : r0 % 8 + r1 - r0].view(bool)
            n = int(np.count_nonzero(valid_C))
            if n:
                block_nK = np.empty((n, K), self.dtype)
                self._rows_into(routed, block_nK)
                out_RK[r0:r1][valid_C] = block_nK
                routed += n
        return out_RK

    def _check_streams(self, pos: int, num_valid: int) -> None:
        """The payload length, then each stream's zero padding; records where each stream starts."""
        expected = pos + payload_bytes(num_valid, self.streams)
        if expected != len(self.raw):
            bits = sum(per_row * b for per_row, b in self.streams)
            raise CodecFormatError(
                f"raw payload is {len(self.raw)} bytes but {num_valid} routed rows of {bits} bits "
                f"(+ {pos} bitmap bytes) need {expected}: corrupt payload; re-export the trace"
            )
        for per_row, bits in self.streams:
            nbits = num_valid * per_row * bits
            if nbits % 8 and self.raw[pos + nbits // 8] >> (nbits % 8):
                raise CodecFormatError(f"payload stream has padding bits set after bit {nbits}: corrupt payload")
            self.starts.append(pos)
            pos += -(-nbits // 8)

    def _values(self, stream: int, first: int, count: int) -> np.ndarray:
        bits = self.streams[stream][1]
        return unpack_bits(self.raw[self.starts[stream] :], count, bits, self._position(stream, first))

    def _position(self, stream: int, first: int) -> int:
        """Where routed row `first` sits in `stream`, in values from `starts[stream]`."""
        return first

    def _kernel_plan(self) -> UnrankPlan | None:
        """The C kernel's plan for the current unranker, or None (numpy path: see `codec.native`)."""
        if not self.native or self.unranker is None or len(self.streams) != 1 or self.mode is not CodecMode.SET:
            return None
        return unrank_plan(self.unranker, self.count)

    def _refuse_rank(self, first: int, bad: int) -> None:
        """Raise for the kernel's verdict `bad` on routed rows from `first` (see `unrank_set_rows`)."""
        if bad == -2:
            raise CodecFormatError("payload stream ends before its routed rows do: corrupt payload")
        rank = int(self._values(0, first + bad, 1)[0])
        E, K = self.num_experts, self.top_k
        raise CodecFormatError(f"routed row {first + bad} has set rank {rank} >= C({E}, {K}): corrupt")

    def _rows_into(self, first: int, out_nK: np.ndarray) -> None:
        """Routed rows first .. first + n - 1 into `out_nK` (n, K), checked."""
        n, K, E = out_nK.shape[0], self.top_k, self.num_experts
        if self.mode is CodecMode.ORDERED:
            ids = self._values(0, first * K, n * K)
            if ids.size and int(ids.max()) >= E:
                row = first + int(np.flatnonzero(ids >= E)[0]) // K
                raise CodecFormatError(f"routed row {row} holds expert id {int(ids.max())} >= E={E}: corrupt")
            out_nK[...] = ids.reshape(n, K)
            return
        if self.count == 0:
            raise CodecFormatError(f"blob has routed rows but top_k={K} > num_experts={E}: corrupt header")
        if self.unranker is None:  # C(E, K) = 1 (K == E): every routed row is all the experts
            out_nK[...] = np.arange(K, dtype=self.dtype)
            return
        plan = self._kernel_plan()
        if plan is not None and can_unrank_into(out_nK):
            bits, position = self.streams[0][1], self._position(0, first)
            bad = unrank_set_rows(plan, self.raw, out_nK, bits, stream_offset=self.starts[0], first=position)
            if bad != -1:
                self._refuse_rank(first, bad)
            return
        ranks_n: Any = self._values(0, first, n)
        if len(self.streams) > 1:
            ranks_n = ranks_n.astype(object)
            for q in range(1, len(self.streams)):
                ranks_n = ranks_n + (self._values(q, first, n).astype(object) << (64 * q))
        if n and int(ranks_n.max()) >= self.count:  # one pass; the row is looked for only when one is bad
            wide = self.count > U64_MAX or len(self.streams) > 1
            row = int(np.flatnonzero(ranks_n >= (self.count if wide else np.uint64(self.count)))[0])
            raise CodecFormatError(f"routed row {first + row} has set rank {ranks_n[row]} >= C({E}, {K}): corrupt")
        self.unranker.unrank(ranks_n, out_nK)


__all__ = ["PayloadDecoder", "encode_rows", "id_bits", "payload_bytes", "payload_streams", "rank_bits"]
