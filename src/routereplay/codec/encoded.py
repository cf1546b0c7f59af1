"""`EncodedRoutes`: one trace kept resident as a codec blob, decoded on demand, rows at random.

A `RouteStore` keeps every sample's routes as these (set codec by default, 5.13 B per (token, layer)
row for top-8 of 128 experts, against 16 B of int16 ids), and decodes only what is asked for:

- `rows(begin, end)` decodes token positions [begin, end) in time proportional to those rows, not to
  the sample: routed row n of a set-mode payload sits at bit n * b, and a block index (the routed rows
  before every `BLOCK_ROWS` (token, layer) rows, built once) finds n for any row in O(1) plus one
  block's popcount;
- `span(begin, end)` cuts the encoded bytes of those rows (validity bits and packed values) without
  decoding them, for shipping to the rank that needs them (`routereplay.transport.bundle`);
- `trace()` decodes the whole trace.

The blob is checked once, when it is made or parsed (CRC, header, lengths, padding bits); a zstd blob
is inflated once and kept raw, so random access never inflates. Token ids are not kept (the store
holds the sample's tokens).

Legend: T = tokens, L = layers, K = top-k, R = T * L (token, layer) rows, n = routed rows (not -1),
B = index blocks, b = bits per routed row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from routereplay.codec import blob as codec
from routereplay.codec.header import parse_header
from routereplay.codec.limits import CodecLimits, checked_limits
from routereplay.codec.rows import PayloadDecoder, payload_streams, rank_bits
from routereplay.codec.subsets import SubsetUnranker, binomial_table
from routereplay.enums import CodecMode
from routereplay.errors import ConfigError, RowCountError
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype

BLOCK_ROWS = 4096  # (token, layer) rows per index entry: one block's bitmap is 512 bytes
POPCOUNT_U8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)


@dataclass(frozen=True, slots=True)
class StreamCut:
    """The bytes of one packed stream holding routed rows [first, first + count): `data` starts at the
    group of 8 values holding `first` (8 values of b bits fill b whole bytes), so `skip` = first % 8."""

    data: bytes
    skip: int


@dataclass(frozen=True, slots=True)
class EncodedSpan:
    """Encoded rows of token positions [begin, end) of one trace, cut without decoding.

    `bitmap` holds the validity bits of rows [begin, end) from bit `bitmap_skip` (None: every row is
    routed); `streams` the packed values of its `num_routed` routed rows."""

    begin: int
    end: int
    num_routed: int
    bitmap: bytes | None
    bitmap_skip: int
    streams: tuple[StreamCut, ...]

    @property
    def nbytes(self) -> int:
        return len(self.bitmap or b"") + sum(len(s.data) for s in self.streams)


class EncodedRoutes:
    """A checked codec blob of one trace, with random access to its rows (see the module docstring)."""

    __slots__ = ("_decoder", "_index_B", "_raw", "_unrankers", "blob", "header", "routed_by_segment", "routed_tokens")

    def __init__(
        self,
        blob: bytes,
        *,
        limits: CodecLimits | None = None,
        unrankers: UnrankerCache | None = None,
        verify_crc: bool = True,
    ) -> None:
        """Check `blob` (a `codec.encode` output) once; `limits` bound its declared shape as in `decode`.
        `unrankers` shares the set-mode unranker (about 100 KB for top-8 of 128) between the pieces of a store.
        `verify_crc=False` is for a blob `codec.encode` returned in this process (`EncodedRoutes.encode`):
        every check but the CRC pass runs."""
        if not isinstance(blob, bytes):
            raise ConfigError(f"EncodedRoutes needs the blob as bytes, got {type(blob).__name__}")
        limits = checked_limits(limits)
        view = memoryview(blob)
        head, offset = parse_header(view, limits, verify_crc=verify_crc)
        T, L, K, E = head.num_tokens, head.num_layers, head.top_k, head.num_experts
        limits.check_shape(T, L, K, canonical_dtype(E).itemsize, len(blob))
        self.blob, self.header = blob, head
        stored = view[offset : offset + head.stored_payload_bytes]
        raw = codec._zstd_decompress(stored, head.raw_payload_bytes, offset) if head.compressed else stored
        self._raw = memoryview(raw)
        streams = payload_streams(E, K, head.mode, limits, "blob")
        self._decoder = PayloadDecoder(self._raw, E, K, head.mode, streams)
        rows = T * L
        self._index_B = np.zeros(1, np.int64)
        num_valid = rows
        if head.has_missing_rows:
            bitmap_R8 = np.frombuffer(self._raw, np.uint8, -(-rows // 8))
            counts = np.add.reduceat(
                POPCOUNT_U8[bitmap_R8].astype(np.int64), np.arange(0, len(bitmap_R8), BLOCK_ROWS // 8)
            )
            self._index_B = np.concatenate([[0], np.cumsum(counts)])
            num_valid = int(self._index_B[-1])
        # checks lengths and padding bits: what decode() checks before it unpacks a row
        self._decoder._check_streams(-(-rows // 8) if head.has_missing_rows else 0, num_valid)
        self._unrankers = unrankers or UnrankerCache()
        self.routed_tokens, self.routed_by_segment = self._summary()

    @classmethod
    def encode(
        cls, trace: RouteTrace, *, mode: CodecMode | str = CodecMode.SET, unrankers: UnrankerCache | None = None
    ) -> EncodedRoutes:
        """Encode `trace` (its token ids and combine weights are dropped) and keep it resident."""
        if trace.token_ids is not None or trace.weights is not None:
            trace = RouteTrace(
                trace.experts, trace.num_experts, trace.layers, trace.start, trace.segments, slots=trace.slots
            )
        return trusted(codec.encode(trace, mode=mode), unrankers=unrankers, fresh=True)

    # --- what it holds ------------------------------------------------------------------------
    @property
    def start(self) -> int:
        return self.header.start

    @property
    def stop(self) -> int:
        return self.header.start + self.header.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def mode(self) -> CodecMode:
        return self.header.mode

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.header.segments

    @property
    def nbytes(self) -> int:
        """Resident bytes: the blob, the raw payload when it was inflated, and the block index."""
        inflated = self.header.raw_payload_bytes if self.header.compressed else 0
        return len(self.blob) + inflated + self._index_B.nbytes

    def routed_before(self, row: int) -> int:
        """Routed (token, layer) rows before flat row `row` in [0, T * L] (O(1) + one block's popcount)."""
        rows = self.header.num_tokens * self.header.num_layers
        if not isinstance(row, (int, np.integer)) or isinstance(row, (bool, np.bool_)):
            raise ConfigError(f"routed_before needs a flat (token, layer) row as an int, got {type(row).__name__}")
        if not 0 <= row <= rows:
            raise RowCountError(
                f"routed_before({row}): flat rows of these routes are 0..{rows} ({self.header.num_tokens} tokens x "
                f"{self.header.num_layers} layers, counted from token position {self.start}); pass a row in that range"
            )
        row = int(row)
        if not self.header.has_missing_rows:
            return row
        block = row // BLOCK_ROWS
        first_byte = block * BLOCK_ROWS // 8
        partial = POPCOUNT_U8[np.frombuffer(self._raw, np.uint8, row // 8 - first_byte, first_byte)].sum(dtype=np.int64)
        tail = 0
        if row % 8:
            tail = bin(self._raw[row // 8] & ((1 << (row % 8)) - 1)).count("1")
        return int(self._index_B[block]) + int(partial) + tail

    # --- decoding -----------------------------------------------------------------------------
    def rows(self, begin: int, end: int, *, chunk_rows: int = 1 << 15) -> np.ndarray:
        """(end - begin, L, K) ids of token positions [begin, end) (absolute), -1 where unrouted; decoded
        `chunk_rows` (token, layer) rows per step (a positive int: it bounds the working set, not the output)."""
        if not isinstance(chunk_rows, (int, np.integer)) or isinstance(chunk_rows, (bool, np.bool_)) or chunk_rows < 1:
            raise ConfigError(
                f"chunk_rows={chunk_rows!r} must be a positive int: the (token, layer) rows decoded per step "
                "(the default, 32768, keeps the working set to a few MiB)"
            )
        self._check_range(begin, end)
        L, K = self.header.num_layers, self.header.top_k
        r0, r1 = (begin - self.start) * L, (end - self.start) * L
        out_RK = np.empty((r1 - r0, K), canonical_dtype(self.header.num_experts))
        self._decoder.unranker = self._unrankers.get(self.header.num_experts, K, self.header.mode)
        routed = self.routed_before(r0)
        for c0 in range(r0, r1, chunk_rows):
            c1 = min(r1, c0 + chunk_rows)
            block_CK = out_RK[c0 - r0 : c1 - r0]
            if not self.header.has_missing_rows:
                self._decoder._rows_into(routed, block_CK)
                routed += c1 - c0
                continue
            valid_C = self._valid(c0, c1)
            n = int(np.count_nonzero(valid_C))
            block_CK[...] = -1
            if n:
                dense_nK = np.empty((n, K), out_RK.dtype)
                self._decoder._rows_into(routed, dense_nK)
                block_CK[valid_C] = dense_nK
                routed += n
        return out_RK.reshape(end - begin, L, K)

    def trace(self, begin: int | None = None, end: int | None = None) -> RouteTrace:
        """The routes of [begin, end) (default: all) as a `RouteTrace`, provenance clipped to the range."""
        begin = self.start if begin is None else begin
        end = self.stop if end is None else end
        experts_TLK = self.rows(begin, end)
        segments = tuple(
            dataclasses.replace(s, begin=max(s.begin, begin), end=min(s.end, end))
            for s in self.segments
            if s.begin < end and s.end > begin
        )
        head = self.header
        return RouteTrace(
            experts_TLK,
            head.num_experts,
            head.layers,
            begin,
            segments,
            slots=head.slots,
            ordered=head.mode is CodecMode.ORDERED,
        )

    def span(self, begin: int, end: int) -> EncodedSpan:
        """The encoded bytes of token positions [begin, end), cut without decoding (see `EncodedSpan`)."""
        self._check_range(begin, end)
        L = self.header.num_layers
        r0, r1 = (begin - self.start) * L, (end - self.start) * L
        first = self.routed_before(r0)
        count = self.routed_before(r1) - first
        bitmap, bitmap_skip = None, 0
        if self.header.has_missing_rows:
            bitmap = bytes(self._raw[r0 // 8 : -(-r1 // 8)])
            bitmap_skip = r0 % 8
        cuts = []
        for stream, (per_row, bits) in enumerate(self._decoder.streams):
            values0, values1 = first * per_row, (first + count) * per_row
            group0 = values0 // 8
            byte0 = self._decoder.starts[stream] + group0 * bits
            byte1 = self._decoder.starts[stream] + -(-values1 * bits // 8)
            cuts.append(StreamCut(bytes(self._raw[byte0:byte1]), values0 - 8 * group0))
        return EncodedSpan(begin, end, count, bitmap, bitmap_skip, tuple(cuts))

    # --- internals ----------------------------------------------------------------------------
    def _valid(self, r0: int, r1: int) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self._raw, np.uint8, -(-r1 // 8) - r0 // 8, r0 // 8), bitorder="little")
        return bits[r0 % 8 : r0 % 8 + r1 - r0].view(bool)

    def _check_range(self, begin: int, end: int) -> None:
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in (begin, end)):
            raise ConfigError(f"token positions must be ints, got {type(begin).__name__}, {type(end).__name__}")
        if not self.start <= begin <= end <= self.stop:
            raise RowCountError(
                f"rows [{begin}, {end}) are outside the routes held for token positions [{self.start}, {self.stop}); "
                "ask for positions within them (the last token of a sample is never routed)"
            )

    def _summary(self) -> tuple[int, tuple[int, ...]]:
        """Tokens routed in every layer, overall and per segment (for store statistics), in bounded steps."""
        head = self.header
        T, L = head.num_tokens, head.num_layers
        if not head.has_missing_rows:
            return T, tuple(s.end - s.begin for s in head.segments)
        routed_T = np.empty(T, bool)
        step = max(1, (1 << 20) // L)
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            routed_T[t0:t1] = self._valid(t0 * L, t1 * L).reshape(t1 - t0, L).all(axis=1)
        cumulative = np.concatenate([[0], np.cumsum(routed_T)])
        by_segment = tuple(
            int(cumulative[s.end - head.start] - cumulative[s.begin - head.start]) for s in head.segments
        )
        return int(cumulative[-1]), by_segment

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EncodedRoutes):
            return NotImplemented
        return self.blob == other.blob

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = self.header
        return (
            f"EncodedRoutes(tokens [{self.start}, {self.stop}), {head.num_layers} layers, top-{head.top_k} of "
            f"{head.num_experts}, {head.mode}, {self.nbytes} bytes)"
        )

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return (trusted, (self.blob,))


class UnrankerCache:
    """The set-mode unranker of one (E, K), built on first use and shared by every piece that holds it."""

    __slots__ = ("_key", "_unranker")

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._unranker: SubsetUnranker | None = None

    def get(self, num_experts: int, top_k: int, mode: CodecMode) -> SubsetUnranker | None:
        count = math.comb(num_experts, top_k)
        if mode is not CodecMode.SET or rank_bits(count) == 0:
            return None
        if self._key != (num_experts, top_k) or self._unranker is None:
            self._unranker = SubsetUnranker(binomial_table(num_experts, top_k, count), count)
            self._key = (num_experts, top_k)
        return self._unranker


def trusted(blob: bytes, *, unrankers: UnrankerCache | None = None, fresh: bool = False) -> EncodedRoutes:
    """`EncodedRoutes` of a blob this process (or a pickle of it) wrote: checked, with limits sized to it.

    `fresh`: `codec.encode` returned it in this process just now, so its CRC is not recomputed."""
    if fresh:
        head = codec.fresh_header(blob)
    else:
        head = codec.header_info(blob, limits=CodecLimits(max_set_table=1 << 62))
    entries = max(head.num_tokens * head.num_layers * head.top_k, 1)
    limits = CodecLimits(max_entries=entries, max_expansion=1 << 62, max_set_table=1 << 62)
    return EncodedRoutes(blob, limits=limits, unrankers=unrankers, verify_crc=not fresh)


__all__ = ["BLOCK_ROWS", "EncodedRoutes", "EncodedSpan", "StreamCut", "UnrankerCache", "trusted"]
