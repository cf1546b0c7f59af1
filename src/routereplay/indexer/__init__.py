"""DSA indexer choices (DeepSeek-V3.2 / GLM-5 sparse attention), stored compactly.

A DSA indexer picks `index_topk` key positions per query token; replay forces them like routes.
Files:
- `trace.py`      `IndexerTrace`: one sequence's (T, L, I) key positions; `from_dense`, `to_dense`,
                  `slice`, `merge`, `padded`, `encode` / `decode`
- `canonical.py`  the dense form's checks: sorted, causal, -1 padded, full rows
- `layout.py`     the block layout and the unknown-row bitmap (rows whose queries see at most I keys
                  cost nothing: they pick every key)
- `blocks.py`     one block of key positions: packed gaps, Rice-coded gaps, or a bitmap
- `blob.py`       the versioned, checksummed blob, every length checked before it is trusted
- `limits.py`     `IndexerLimits`: tokens, layers, index_topk, entries and expansion a decode accepts

Engine payloads come in through `routereplay.wire.indexer_topk`.
"""

from routereplay.indexer.limits import DEFAULT_INDEXER_LIMITS, IndexerLimits
from routereplay.indexer.trace import IndexerTrace

__all__ = ["DEFAULT_INDEXER_LIMITS", "IndexerLimits", "IndexerTrace"]
