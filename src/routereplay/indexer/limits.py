"""Bounds on what an indexer blob or an engine payload may declare, checked before any allocation.

An indexer trace is small on the wire but large when dense: rows whose query sees at most
`index_topk` keys cost no payload bits at all (the choice is "every causal key"), so a blob of a
few hundred bytes can honestly declare a (T, L, I) array of gigabytes. `IndexerLimits` bounds the
declared axes and their product before anything is allocated or looped over; the defaults sit far
above real models (DeepSeek-V3.2: 61 indexer layers, index_topk 2048, 128k context).
Legend: T = query tokens (rows), L = DSA layers, I = index_topk.
"""

from __future__ import annotations

from dataclasses import dataclass

from routereplay.errors import CodecLimitError, ConfigError, PayloadLimitError

DEFAULT_MAX_TOKENS = 1 << 24  # 16.7 M query positions in one sequence
DEFAULT_MAX_LAYERS = 1024  # real DSA models: < 100 layers
DEFAULT_MAX_INDEX_TOPK = 1 << 16  # real models: 2048
DEFAULT_MAX_ENTRIES = 1 << 32  # T * L * I of the dense int32 form: 16 GiB
MAX_POSITION = (1 << 31) - 1  # positions are int32 in the canonical form


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerLimits:
    """Largest (T, L, I) an indexer decoder accepts; raise a bound for a trusted, genuinely larger trace."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    max_layers: int = DEFAULT_MAX_LAYERS
    max_index_topk: int = DEFAULT_MAX_INDEX_TOPK
    max_entries: int = DEFAULT_MAX_ENTRIES

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_layers", "max_index_topk", "max_entries"):
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

    def check_payload(self, num_tokens: int, num_layers: int, index_topk: int, what: str) -> None:
        """Refuse an engine payload's shape beyond the bounds (PayloadLimitError)."""
        problem = self.violation(num_tokens, num_layers, index_topk)
        if problem:
            raise PayloadLimitError(
                f"{what}: shape (T, L, I) = ({num_tokens}, {num_layers}, {index_topk}): {problem}; refused before "
                "allocating. Check num_layers / index_topk, or pass limits=IndexerLimits(...) if it is genuine"
            )


DEFAULT_INDEXER_LIMITS = IndexerLimits()

__all__ = ["DEFAULT_INDEXER_LIMITS", "MAX_POSITION", "IndexerLimits"]
