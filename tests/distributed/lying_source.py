"""A lying `scatter_bundles` source (`python -m tests.distributed.worker lying_source DIR`, 2 ranks).

Rank 0 is a real process that speaks the documented wire format by hand and lies in it; rank 1
calls `scatter_bundles(None, src=0)` each time, and checks with `pytest.raises` (a failed check
ends the job) that it raises a `DeliveryError` instead of a raw ValueError or made-up bytes:

1. a header whose status word is 7, a status no release sends;
2. a header announcing 100 bytes for rank 1, then a payload of 50 bytes (gloo completes the receive
   with the buffer's last bytes never written);
3. a header announcing 100 bytes, then exactly 100 bytes and no size trailer (an older sender);
4. then an honest `scatter_bundles` on both ranks: the group still delivers.

A payload longer than announced is not played: gloo aborts the receiving process in its own thread
(documented in `routereplay.transport.distributed`), which no receiver can turn into an exception.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from routereplay.errors import DeliveryError
from routereplay.transport.distributed import scatter_bundles

UNKNOWN_STATUS = 7
ANNOUNCED = 100


def lie(_: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    assert world == 2, f"the lying-source case runs on 2 ranks, got {world}"
    if rank == 0:
        _send_header(UNKNOWN_STATUS, 0)
        _send_header(0, ANNOUNCED)
        dist.isend(torch.arange(ANNOUNCED // 2, dtype=torch.uint8), dst=1).wait()
        _send_header(0, ANNOUNCED)
        dist.isend(torch.arange(ANNOUNCED, dtype=torch.uint8), dst=1).wait()
    else:
        with pytest.raises(DeliveryError, match="sent status 7, which this release does not know"):
            scatter_bundles(None, src=0)
        for _ in range(2):
            with pytest.raises(DeliveryError, match="announced 100 bytes for this rank .* did not end with their"):
                scatter_bundles(None, src=0)
    honest = scatter_bundles([b"", b"routes"] if rank == 0 else None, src=0)
    return {"checked": 3 if rank == 1 else 0, "honest_delivered": honest == (b"routes" if rank == 1 else b"")}


def _send_header(status: int, size_for_rank_1: int) -> None:
    """The documented header, int64 (1 + W,): status, then each rank's size in bytes."""
    dist.broadcast(torch.tensor([status, 0, size_for_rank_1], dtype=torch.int64), src=0)
