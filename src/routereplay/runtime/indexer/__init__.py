"""Record and replay of DeepSeek Sparse Attention (DSA) indexers: `IndexerReplayer(model)`.

Files:
- `replayer.py`   `IndexerReplayer(model)`: record and replay the top-k of a model's DSA indexers
- `discovery.py`  finding a model's DSA indexers, and their choices in one canonical form (`indices_BSLI`)
- `choices.py`    DSA indexer choices between a padded batch (`indices_BSLI`) and per-sequence `IndexerTrace`s

The compact store of these choices is `routereplay.indexer`; SGLang's payload is `routereplay.wire`.
"""

from routereplay.runtime.indexer.replayer import IndexerRecording, IndexerReplayer, IndexerStats

__all__ = ["IndexerRecording", "IndexerReplayer", "IndexerStats"]
