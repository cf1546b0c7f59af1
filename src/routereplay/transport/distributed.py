"""Per-rank route delivery over `torch.distributed`: each trainer rank receives only its own bytes.

The usual glue (verl's router replay) broadcasts the dense padded routes of the whole batch to every
rank, (B, S, L, K) int16 ids, although a rank replays only its DP share's CP/SP/PP slice of them: at
scale that is tens of GB per step to every rank (verl #6211). Here the rank that holds the routes cuts
one `RankBundle` per rank (`routereplay.transport.spans.bundles_for`: the rows of that rank's layout plan,
still encoded) and sends each rank its own:

- `scatter_bundles`: one source rank sends `bundles[r]` to group rank r. First a header every rank
  receives, int64 (1 + W,): a status (0 = sending; otherwise the source refused, see `Refusal`), then
  each rank's size in bytes; every rank checks every size against `max_bytes` before anything is
  allocated, so an oversized (or forged) announcement makes every rank raise the same
  `DeliveryLimitError` and none is left waiting. Then each payload goes point to point (`isend` /
  `irecv` of a uint8 tensor of that size plus an 8-byte trailer, the size again, little-endian).
- `exchange_bundles`: every rank holds some samples (colocated rollout workers) and sends rank r the
  bundle of its rows it holds; an all-to-all of the sizes, an all-reduce of every rank's verdict, then
  an all-to-all of the bytes.
- `broadcast_dense`: the baseline `routereplay bench` compares with: the dense batch to every rank.

What a `scatter_bundles` receiver can and cannot defend against (the source is another process):
- a status word it does not know (another release, a stray broadcast): `DeliveryError` on every rank;
- an announced size above `max_bytes` (or negative): `DeliveryLimitError` on every rank, unallocated;
- a payload shorter than announced: gloo completes the receive without saying how many bytes came,
  so the receiver presets the trailer's bytes to the complement of the size; any short send leaves
  at least the last of them unwritten, and it raises `DeliveryError` instead of returning bytes that
  were never sent;
- wrong bytes of the right length: passed on; `RankBundle` then refuses them (CRC, lengths, bounds).
- It cannot defend against a payload longer than announced: gloo checks the length in its own I/O
  thread and aborts the receiving process (`gloo::EnforceNotMet`, "Received data size doesn't match
  expected size"; SIGABRT, no Python exception). Only a peer that is not running this function
  sends that; run the group with peers you trust to run it, and let the launcher restart the job.
  Nor can it see a source that never sends: that receive waits until the group's timeout.

Backends: gloo moves CPU tensors; NCCL moves tensors on the current CUDA device
(`torch.cuda.set_device(local_rank)` first), so on NCCL the byte tensors are staged there and copied
back to the host. `src` and the ranks a list is indexed by are ranks of `group` (the default group
when None), not global ranks. Pass the same `max_bytes` on every rank: a rank with a smaller one
refuses a size the others accept, and they then wait for it until the group's timeout.

Legend: W = ranks in the group, N = bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import IntEnum

import torch
import torch.distributed as dist

from routereplay.errors import ConfigError, DeliveryError, DeliveryLimitError

DEFAULT_MAX_BYTES = 1 << 30  # what one rank may be announced: a rank's routes of one step are far smaller
TRAILER_BYTES = 8  # after each payload: its size, int64 little-endian (proves the whole payload arrived)
Group = dist.ProcessGroup | None


class Refusal(IntEnum):
    """Status word of a `scatter_bundles` header, and a rank's verdict in `exchange_bundles`."""

    NONE = 0
    WRONG_COUNT = 1  # not one bundle per rank of the group
    NOT_BYTES = 2  # a bundle is not bytes
    TOO_LARGE = 3  # a size above max_bytes (or negative)


_REASONS = {
    Refusal.WRONG_COUNT: "its list does not hold one bundle per rank of the group",
    Refusal.NOT_BYTES: "an entry of its list is not bytes",
    Refusal.TOO_LARGE: "it was announced a size above its max_bytes",
}


def scatter_bundles(
    bundles: Sequence[bytes] | None,
    *,
    src: int = 0,
    group: Group = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    """Collective: group rank `src` passes `bundles` (one per group rank, e.g. from `bundles_for`), the
    others None; every rank returns its own `bundles[rank]`, having received exactly those bytes."""
    world, rank = _group_shape(group, src, "scatter_bundles")
    _check_max_bytes(max_bytes)
    device = _device(group)
    header_W = torch.zeros(1 + world, dtype=torch.int64)
    refusal = Refusal.NONE
    if rank == src:
        refusal = _check_outgoing(bundles, world)
        header_W[0] = refusal
        if refusal is Refusal.NONE:
            assert bundles is not None  # _check_outgoing refuses None
            header_W[1:] = torch.tensor([len(b) for b in bundles], dtype=torch.int64)
    header_W = header_W.to(device)
    dist.broadcast(header_W, src=_global(group, src), group=group)
    header = header_W.tolist()
    if header[0] not in _REASONS and header[0] != Refusal.NONE:
        raise DeliveryError(
            f"scatter_bundles: group rank {src}, the source, sent status {header[0]}, which this release does not "
            f"know (0 = sending, {min(_REASONS)}..{max(_REASONS)} = refusals): it runs another routereplay version, "
            "or something else broadcast on this group; run one release on every rank and call scatter_bundles on "
            "all of them together"
        )
    if header[0] != Refusal.NONE:
        given = f" (it was given {_describe(bundles)})" if rank == src else ""
        raise DeliveryError(
            f"scatter_bundles: group rank {src}, the source, refused to send: {_REASONS[Refusal(header[0])]}{given}; "
            f"the group has {world} ranks. On the source pass bundles_for(store, sample_ids, plans, positions) with "
            "one plan per group rank, None on the others"
        )
    sizes = header[1:]
    _check_sizes(sizes, max_bytes, rank, f"group rank {src}'s announcement")
    if rank != src:
        if sizes[rank] == 0:
            return b""
        size = sizes[rank]
        buffer_N = torch.empty(size + TRAILER_BYTES, dtype=torch.uint8, device=device)
        buffer_N[size:] = _trailer(size, absent=True).to(device)  # a short send leaves some of these bytes
        _wait([dist.irecv(buffer_N, src=_global(group, src), group=group)])
        if not torch.equal(buffer_N[size:].cpu(), _trailer(size)):
            raise DeliveryError(
                f"scatter_bundles: group rank {src}, the source, announced {size} bytes for this rank (group rank "
                f"{rank}) but its payload did not end with their {TRAILER_BYTES}-byte size trailer: fewer bytes "
                "arrived than announced, and nothing of them is returned. The source is not running this release's "
                "scatter_bundles, or its process is broken: check its log"
            )
        return _to_bytes(buffer_N[:size])
    assert bundles is not None
    sends: list[dist.Work | None] = []
    staged = []  # keep every tensor alive until its send completes
    for dest, bundle in enumerate(bundles):
        if dest != src and len(bundle):
            payload = bytearray(bundle)  # the one copy _to_tensor would make, with the trailer appended
            payload += _trailer(len(bundle)).numpy().tobytes()
            staged.append(_to_tensor(payload, device))
            sends.append(dist.isend(staged[-1], dst=_global(group, dest), group=group))
    _wait(sends)
    return bytes(bundles[src])


def exchange_bundles(
    outgoing: Sequence[bytes],
    *,
    group: Group = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[bytes]:
    """Collective: every rank sends `outgoing[r]` to group rank r (b"" for none); returns what this rank
    received from each rank, in rank order. `max_bytes` bounds what one rank receives in all."""
    world, rank = _group_shape(group, 0, "exchange_bundles")
    _check_max_bytes(max_bytes)
    device = _device(group)
    refusal = _check_outgoing(outgoing, world)
    sent_W = torch.zeros(world, dtype=torch.int64)
    if refusal is Refusal.NONE:
        sent_W[:] = torch.tensor([len(b) for b in outgoing], dtype=torch.int64)
    received_W = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(received_W, sent_W.to(device), group=group)
    received = received_W.tolist()
    if refusal is Refusal.NONE and (min(received) < 0 or sum(received) > max_bytes):
        refusal = Refusal.TOO_LARGE
    verdict_W = torch.zeros(world, dtype=torch.int64)
    verdict_W[rank] = refusal
    verdict_W = verdict_W.to(device)
    dist.all_reduce(verdict_W, group=group)  # every rank learns every verdict: all raise, or none
    verdicts = [Refusal(v) for v in verdict_W.tolist()]
    culprits = [r for r, v in enumerate(verdicts) if v is not Refusal.NONE]
    if culprits:
        first = culprits[0]
        who = f"group rank {first}{' (this rank)' if first == rank else ''}"
        if verdicts[first] is Refusal.TOO_LARGE:
            raise DeliveryLimitError(
                f"exchange_bundles: {who} was announced more than max_bytes={max_bytes} bytes in all (this rank: "
                f"{received} from each rank); every rank refused before allocating. Send fewer rows per step, or "
                "raise max_bytes on every rank for a trusted group"
            )
        raise DeliveryError(
            f"exchange_bundles: {who} refused the exchange: {_REASONS[verdicts[first]]} (world size {world}); pass "
            f"a list of {world} bytes objects on every rank (b'' for a rank that gets nothing from it)"
        )
    out_N = torch.empty(sum(received), dtype=torch.uint8, device=device)
    in_N = _to_tensor(bytearray().join(outgoing), device)
    dist.all_to_all_single(out_N, in_N, received, [len(b) for b in outgoing], group=group)
    data = _to_bytes(out_N)
    offsets = [0]
    for size in received:
        offsets.append(offsets[-1] + size)
    return [data[a:b] for a, b in itertools.pairwise(offsets)]


def broadcast_dense(
    routes: torch.Tensor | None,
    *,
    shape: Sequence[int],
    dtype: torch.dtype,
    src: int = 0,
    group: Group = None,
) -> torch.Tensor:
    """Collective: the whole batch's dense routes (e.g. (B, S, L, K) int16) from group rank `src` to every
    rank: what verl does, and what `scatter_bundles` replaces. Returns the tensor on every rank (on the
    CUDA device under NCCL). A bad `routes` raises on `src` only; the others then wait until the timeout,
    as in any collective one rank skips."""
    _, rank = _group_shape(group, src, "broadcast_dense")
    shape = tuple(int(n) for n in shape)
    device = _device(group)
    if rank == src:
        if not isinstance(routes, torch.Tensor) or tuple(routes.shape) != shape or routes.dtype != dtype:
            got = f"{tuple(routes.shape)} {routes.dtype}" if isinstance(routes, torch.Tensor) else type(routes).__name__
            raise ConfigError(
                f"broadcast_dense: group rank {src} must pass the routes as a {shape} {dtype} tensor (the shape and "
                f"dtype every rank was given), got {got}"
            )
        tensor = routes.to(device).contiguous()
    else:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    # as bytes: neither gloo nor NCCL reduces or moves int16, the dtype routes travel in
    dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=_global(group, src), group=group)
    return tensor


# --- internals ----------------------------------------------------------------------------------
def _group_shape(group: Group, src: int, what: str) -> tuple[int, int]:
    """(world size, this process's rank) of `group`, with `src` checked to be one of its ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"{what} is a collective over torch.distributed, which is not initialised in this process; call "
            "torch.distributed.init_process_group (gloo on CPU, nccl on GPU) on every rank first"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ConfigError(f"{what}: this process is not a member of the group it was given; call it on members only")
    if not isinstance(src, int) or not 0 <= src < world:
        raise ConfigError(f"{what}: src={src!r} is not a rank of the group (0..{world - 1}); pass a group rank")
    return world, rank


def _check_max_bytes(max_bytes: int) -> None:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
        raise ConfigError(f"max_bytes={max_bytes!r} must be a non-negative int (the most bytes one rank accepts)")


def _check_outgoing(bundles: Sequence[bytes] | None, world: int) -> Refusal:
    if bundles is None or isinstance(bundles, (bytes, bytearray)) or len(bundles) != world:
        return Refusal.WRONG_COUNT
    if not all(isinstance(b, (bytes, bytearray)) for b in bundles):
        return Refusal.NOT_BYTES
    return Refusal.NONE


def _describe(bundles: object) -> str:
    if isinstance(bundles, Sequence) and not isinstance(bundles, (bytes, bytearray, str)):
        return f"{len(bundles)} entries of {sorted({type(b).__name__ for b in bundles})}"
    return type(bundles).__name__


def _check_sizes(sizes: list[int], max_bytes: int, rank: int, where: str) -> None:
    bad = [r for r, n in enumerate(sizes) if not 0 <= n <= max_bytes]
    if bad:
        r = bad[0]
        mine = " (this rank)" if r == rank else ""
        raise DeliveryLimitError(
            f"{where} gives group rank {r}{mine} {sizes[r]} bytes, outside [0, max_bytes={max_bytes}]; refused "
            "before allocating, on every rank. Deliver fewer rows per step (more micro-batches), or raise max_bytes "
            "on every rank for a trusted source"
        )


def _device(group: Group) -> torch.device:
    """Where the backend moves tensors: the current CUDA device under NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _wait(works: Sequence[dist.Work | None]) -> None:
    """Wait for point-to-point works (None only for a rank outside the group, which `_group_shape` refuses)."""
    for work in works:
        assert work is not None
        work.wait()


def _trailer(size: int, *, absent: bool = False) -> torch.Tensor:
    """The 8 bytes sent after a payload of `size` bytes (int64 little-endian); `absent`: their complement,
    what the receiver presets (every byte differs, so any short send leaves a wrong byte)."""
    word = size ^ -1 if absent else size
    return torch.frombuffer(bytearray(word.to_bytes(TRAILER_BYTES, "little", signed=True)), dtype=torch.uint8)


def _to_tensor(data: bytes | bytearray, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `data` (one copy of bytes, none of a bytearray; torch.frombuffer refuses b"")."""
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=torch.uint8).to(device)


def _to_bytes(tensor_N: torch.Tensor) -> bytes:
    return tensor_N.cpu().numpy().tobytes()


__all__ = ["DEFAULT_MAX_BYTES", "TRAILER_BYTES", "Refusal", "broadcast_dense", "exchange_bundles", "scatter_bundles"]
