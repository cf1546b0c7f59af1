"""Bounds on what an indexer blob or an engine payload may declare, checked before any allocation.

An indexer trace is small on the wire but large when dense: rows whose query sees at most
`index_topk` keys cost no payload bits at all (the choice is "every causal key"), so a blob of a
few hundred bytes can honestly declare a (T, L, I) array of gigabytes. `IndexerLimits` bounds the
declared axes and their product before anything is allocated or looped over; the defaults sit far
above real models (DeepSeek-V3.2: 61 indexer layers, index_topk 2048, 128k context).

`max_expansion` bounds the dense entries (T * L * I) per byte of blob, as `CodecLimits.max_expansion`
does for routes, so a blob of n bytes never stands for more than 4 * max_expansion * n dense bytes.
Measured on honest blobs (`routereplay bench indexer` shapes, the tests' random choices): stored rows
cost at least I / 8 bytes a row (3 to 11 entries a byte measured), an unknown row one bit (8 * I),
a block of 0-bit gaps (every row picks the latest I keys) 6 table bytes for up to B rows (B * I / 6:
21,845 for B = 128, I = 1024). Only implicit rows are free: a trace of T <= I rows from token 0
costs 40 + 4 * L bytes for T * L * I entries, under I^2 / 4 a byte - 900,889 for DeepSeek-V3.2
(T = I = 2048, L = 61), 1,038,435 for L = 1024, 4,036,623 for I = 4096, L = 256. The default
2^22 keeps 4x above the I = 2048 models and admits every honest trace of I <= 4096; a blob above
it is forged, or (larger I, B * I / 6 above it) trusted only if it came from this library: raise
the bound for it.
Legend: T = query tokens (rows), L = DSA layers, I = index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from routereplay.errors import CodecLimitError, ConfigError, PayloadLimitError

DEFAULT_MAX_TOKENS = 1 << 24  # 16.7 M query positions in one sequence
DEFAULT_MAX_LAYERS = 1024  # real DSA models: < 100 layers
DEFAULT_MAX_INDEX_TOPK = 1 << 16  # real models: 2048
DEFAULT_MAX_ENTRIES = 1 << 32  # T * L * I of the dense int32 form: 16 GiB
DEFAULT_MAX_EXPANSION = 1 << 22  # dense entries per blob byte: honest blobs of I <= 4096 stay below (I^2 / 4)
MAX_POSITION = (1 << 31) - 1  # positions are int32 in the canonical form
MAX_BLOCK_ROWS = 4096  # rows per block of an IndexerTrace: a blob declaring more is corrupt


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerLimits:
    """Largest (T, L, I) an indexer decoder accepts; raise a bound for a trusted, genuinely larger trace."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    max_layers: int = DEFAULT_MAX_LAYERS
    max_index_topk: int = DEFAULT_MAX_INDEX_TOPK
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_expansion: int = DEFAULT_MAX_EXPANSION

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_layers", "max_index_topk", "max_entries", "max_expansion"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"IndexerLimits.{name}={value!r} must be an int >= 1")

    def violation(self, num_tokens: int, num_layers: int, index_topk: int) -> str | None:
        """The first bound a declared (T, L, I) breaks, as message text, or None when it fits."""
        for value, bound, name in (
            (num_tokens, self.max_tokens, "max_tokens"),
            (num_layers, self.max_layers, "max_layers"),
            (index_topk, self.max_index_topk, "max_index_topk"),
            (num_tokens * num_layers * index_topk, self.max_entries, "max_entries"),
        ):
            if value > bound:
                what = "T * L * I" if name == "max_entries" else name.removeprefix("max_")
                return f"{what} = {value} is above IndexerLimits.{name}={bound}"
        return None

    def check_blob(self, num_tokens: int, num_layers: int, index_topk: int) -> None:
        """Refuse a blob header's shape beyond the bounds (CodecLimitError)."""
        problem = self.violation(num_tokens, num_layers, index_topk)
        if problem:
            raise CodecLimitError(
                f"indexer blob declares (T, L, I) = ({num_tokens}, {num_layers}, {index_topk}): {problem}; refused "
                "before allocating. A forged or corrupt header - or pass limits=IndexerLimits(...) if it is trusted"
            )

    def check_expansion(self, num_tokens: int, num_layers: int, index_topk: int, nbytes: int, what: str) -> None:
        """Refuse T * L * I dense entries above `max_expansion` x the `nbytes` that declare them (CodecLimitError)."""
        entries = num_tokens * num_layers * index_topk
        if entries > self.max_expansion * nbytes:
            raise CodecLimitError(
                f"{what}: (T, L, I) = ({num_tokens}, {num_layers}, {index_topk}) is {entries} dense entries from "
                f"{nbytes} bytes ({entries // max(nbytes, 1)} a byte), above IndexerLimits.max_expansion="
                f"{self.max_expansion}; refused before allocating. Honest blobs of index_topk <= 4096 stay below it "
                "(only rows whose query sees <= index_topk keys are free): a forged or corrupt header - or, if it "
                "is trusted, raise IndexerLimits(max_expansion=...) (IndexerTrace.decode(blob, limits=...), "
                "RouteStore.load(path, indexer_limits=...))"
            )

    def check_payload(self, num_tokens: int, num_layers: int, index_topk: int, what: str) -> None:
        """Refuse an engine payload's shape beyond the bounds (PayloadLimitError)."""
        problem = self.violation(num_tokens, num_layers, index_topk)
        if problem:
            raise PayloadLimitError(
                f"{what}: shape (T, L, I) = ({num_tokens}, {num_layers}, {index_topk}): {problem}; refused before "
                "allocating. Check num_layers / index_topk, or pass limits=IndexerLimits(...) if it is genuine"
            )


DEFAULT_INDEXER_LIMITS = IndexerLimits()


def checked_indexer_limits(limits: Any) -> IndexerLimits:
    """`limits` itself, `DEFAULT_INDEXER_LIMITS` for None, or a ConfigError for anything else."""
    if limits is None:
        return DEFAULT_INDEXER_LIMITS
    if not isinstance(limits, IndexerLimits):
        raise ConfigError(
            f"indexer limits must be a routereplay.indexer.IndexerLimits or None, got {type(limits).__name__}; "
            "e.g. IndexerLimits(max_expansion=1 << 24)"
        )
    return limits


__all__ = ["DEFAULT_INDEXER_LIMITS", "MAX_BLOCK_ROWS", "MAX_POSITION", "IndexerLimits", "checked_indexer_limits"]
