"""DSA indexer choices (DeepSeek-V3.2 / GLM-5 sparse attention): compact storage and its blob.

`IndexerTrace` holds one sequence's (T, L, I) key positions compactly (`layout`, `blocks`), checks
the canonical dense form (`canonical`), and reads and writes a checksummed blob (`blob`) within
`IndexerLimits`. Engine payloads come in through `routereplay.wire.sglang_indexer`.
"""

from routereplay.indexer.limits import DEFAULT_INDEXER_LIMITS, IndexerLimits
from routereplay.indexer.trace import IndexerTrace

__all__ = ["DEFAULT_INDEXER_LIMITS", "IndexerLimits", "IndexerTrace"]
