"""Moving encoded routes to the trainer ranks that replay them, each rank only its own.

- `distributed`: over `torch.distributed` (gloo, NCCL): `scatter_bundles` from one rank,
  `exchange_bundles` all-to-all between colocated rollout workers and trainer ranks, and
  `broadcast_dense`, the whole-batch broadcast they replace (the benchmark's baseline).

Over Ray's object store: `routereplay.integrations.ray_routes` (extra `ray`).
"""

from routereplay.transport.distributed import (
    DEFAULT_MAX_BYTES,
    Refusal,
    broadcast_dense,
    exchange_bundles,
    scatter_bundles,
)

__all__ = ["DEFAULT_MAX_BYTES", "Refusal", "broadcast_dense", "exchange_bundles", "scatter_bundles"]
