"""R2 on SkyRL's FSDP worker: the routes the old-log-prob pass recorded, found again by each sample's tokens.

SkyRL 0.4.0's trainer keeps only the log-probs of the policy's forward pass (`trainer.py`
`_execute_forward_pass(..., key="logprobs")`), and re-splits the batch for the updates (mini-batches, DP
shards, token-based micro-batches that reorder samples). So what R2 records cannot ride the batch back the way
verl's `routed_experts` does; the worker keeps it instead, keyed by each sample's attended token ids (16 bytes
of SHA-256), and every update finds each sample's rows by its own tokens: a sample is never given another's
routes, whichever micro-batch or rank it lands on. With several DP ranks, each rank's recordings are
all-gathered over SkyRL's `dp` group at the end of the forward pass (every rank then holds the whole batch's
routes, in the narrowest dtype that holds E: 1 byte per (token, MoE layer, slot) up to 256 experts). One
recording spans every forward call until the next update (SkyRL's default `recompute_old_logprobs_per_minibatch`
forwards each policy mini-batch separately, all before the first update): each call adds its samples, and
shares only those it added.

Samples with equal tokens share one entry (the first recorded): R2 replays the trainer's routing of those
tokens, which is the same function of the same tokens. Legend: B samples, S padded positions, N attended
tokens of one sample, M MoE layers, K top-k.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from routereplay.errors import MissingRoutesError, RowCountError

KEY_TAG = b"routereplay.skyrl.r2.v1"


def sample_key(ids_N: torch.Tensor) -> bytes:
    """16 bytes naming a sample by its attended token ids (int64, in order)."""
    h = hashlib.sha256(KEY_TAG)
    h.update(ids_N.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).data)
    return h.digest()[:16]


def _compact_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 1 << 15 else torch.int32


@dataclass(slots=True)
class RecordedRoutes:
    """What this worker's last R2 recording pass saw: per sample key, its (N, M, K) routes."""

    num_experts: int = 0
    rows: dict[bytes, torch.Tensor] = field(default_factory=dict)
    unshared: list[bytes] = field(default_factory=list)  # keys remembered since the last `share`

    def clear(self) -> None:
        self.rows.clear()
        self.unshared.clear()

    def __len__(self) -> int:
        return len(self.rows)

    def remember(self, sequences_BS: torch.Tensor, mask_BS: torch.Tensor, routes_BSMK: torch.Tensor) -> None:
        """Keep each sample's recorded rows at its attended positions (every one a route: -1 is refused)."""
        dtype = _compact_dtype(self.num_experts)
        keep_BS = mask_BS.to(torch.bool).cpu()
        for b in range(int(keep_BS.shape[0])):
            keep_S = keep_BS[b]
            rows_NMK = routes_BSMK[b].cpu()[keep_S]
            if bool((rows_NMK < 0).any()):
                raise RowCountError(
                    f"sample {b}: the recording pass left attended tokens without a route; the model's layout is "
                    "not the one routereplay read back (report this with the SkyRL version)"
                )
            key = sample_key(sequences_BS[b].cpu()[keep_S])
            if key not in self.rows:
                self.rows[key] = rows_NMK.to(dtype)
                self.unshared.append(key)

    def routes_for(self, sequences_BS: torch.Tensor, mask_BS: torch.Tensor, *, live: bool = False) -> torch.Tensor:
        """(B, S, M, K) int64 routes of a training micro-batch, -1 off the attended positions. `live` (SkyRL's
        padding micro-batch: random tokens, no loss) gives -1 everywhere, routed live; otherwise a sample the
        recording pass never saw is a `MissingRoutesError`."""
        if not self.rows:
            raise MissingRoutesError(
                "R2: no routes recorded on this worker; the policy's forward pass (old log-probs) records them and "
                "must run before every update (do not skip it: trainer.algorithm settings that skip the policy "
                "forward pass leave R2 nothing to replay)"
            )
        shape = next(iter(self.rows.values())).shape[1:]
        keep_BS = mask_BS.to(torch.bool).cpu()
        out_BSMK = torch.full((*keep_BS.shape, *shape), -1, dtype=torch.int64)
        if live:
            return out_BSMK
        for b in range(int(keep_BS.shape[0])):
            key = sample_key(sequences_BS[b].cpu()[keep_BS[b]])
            rows_NMK = self.rows.get(key)
            if rows_NMK is None:
                raise MissingRoutesError(
                    f"R2: sample {b} of a training micro-batch ({int(keep_BS[b].sum())} tokens) was not in the "
                    "forward pass that recorded routes (its tokens differ from every recorded sample's); R2 "
                    "replays what the policy's forward pass recorded for the same batch: run it on this batch"
                )
            out_BSMK[b, keep_BS[b]] = rows_NMK.to(torch.int64)
        return out_BSMK

    def share(self, group: dist.ProcessGroup | None) -> None:
        """All-gather the recordings every rank added since its last `share` over `group` (SkyRL's dp group), so
        any rank can serve any sample of the recording."""
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        added, self.unshared = self.unshared, []
        if world <= 1:
            return
        mine = {key: self.rows[key].numpy() for key in added}
        gathered: list[dict[bytes, np.ndarray] | None] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        for other in gathered:
            for key, rows in (other or {}).items():
                self.rows.setdefault(key, torch.from_numpy(rows))


__all__ = ["RecordedRoutes", "sample_key"]
