"""Per-rank route delivery: each trainer rank receives exactly its rows, as encoded bytes.

Files:
- `bundle.py`       `RankBundle`: one rank's rows cut from encoded pieces, checked like a codec blob,
                    decoded in bounded chunks
- `buffers.py`      what a bundle reads and writes: its own copy of a refillable buffer, a checked
                    `out=` (aligned, plain, apart from the bundle's bytes)
- `spans.py`        `bundles_for`: a layout plan (token numbers per rank) as spans of samples, cut
                    from a `RouteStore` without decoding
- `distributed.py`  `scatter_bundles` / `exchange_bundles` / `broadcast_dense` over torch.distributed
                    (gloo or NCCL): sizes first, checked, then the bytes

`docs/cluster-scale.md` shows the whole path.
"""

from routereplay.transport.bundle import RankBundle
from routereplay.transport.distributed import (
    DEFAULT_MAX_BYTES,
    Refusal,
    broadcast_dense,
    exchange_bundles,
    scatter_bundles,
)
from routereplay.transport.spans import bundles_for, spans_of

__all__ = [
    "DEFAULT_MAX_BYTES",
    "RankBundle",
    "Refusal",
    "broadcast_dense",
    "bundles_for",
    "exchange_bundles",
    "scatter_bundles",
    "spans_of",
]
