"""A per-sample digest that ties verl's dense `routed_experts` to the batch's token ids.

The compact column's blobs carry each sample's token ids, and the readers check them against the batch
(`batch._check_tokens`). verl's dense `routed_experts` tensor carries none: the same tensor shifted by one
position, with a middle row dropped, or put on a batch whose equal-length samples swapped places replays
silently. So wherever routereplay writes the dense form (`put_routes(..., form="dense")`) it also writes
`non_tensor_batch[DIGEST_KEY]`: per sample, the first 16 bytes of a SHA-256 of its attended token ids (int64)
together with its route rows (int16, as verl holds them: all layers and slots) at those positions, in order.
The column rides verl's splitting like the compact column (`DataProto.chunk` / `select_idxs`, `to_tensordict`,
`rearrange_micro_batches`), and `left_right_2_no_padding` keeps exactly the attended positions of both
tensors, so a micro-batch's digest is computed the same way from its jagged `input_ids` and `routed_experts`.

Legend: B samples, S padded positions, N tokens of one sample, P payload layers, K top-k.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.errors import BatchFieldError, RowCountError, TokenMismatchError

if TYPE_CHECKING:
    import torch

DIGEST_KEY = "routereplay_routes_digest"  # non-tensor batch key: one digest (bytes) per sample
DIGEST_TAG = b"routereplay.verl.dense.v1"
DIGEST_SIZE = 16  # bytes kept of the SHA-256


def route_digest(ids_N: torch.Tensor, routes_NPK: torch.Tensor) -> bytes:
    """The digest of one sample: its N token ids with its N route rows, position by position."""
    import torch

    h = hashlib.sha256(DIGEST_TAG)  # SHA-NI: ~3x BLAKE2b on x86
    h.update(np.asarray(routes_NPK.shape, dtype="<i8").tobytes())
    h.update(ids_N.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).data)
    h.update(routes_NPK.detach().to("cpu", torch.int16).contiguous().numpy().astype("<i2", copy=False).data)
    return h.digest()[:DIGEST_SIZE]


def sample_rows(
    routes: torch.Tensor, input_ids: torch.Tensor, attention_mask_BS: torch.Tensor | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample (ids_N, routes_NPK) at its tokens: the attended positions of a padded batch (mask needed), or
    the jagged rows after `left_right_2_no_padding`; a sample whose route rows are not its tokens' is refused."""
    import torch

    if routes.is_nested != input_ids.is_nested or routes.size(0) != input_ids.size(0):
        raise BatchFieldError(
            f"routed_experts ({'jagged' if routes.is_nested else 'padded'}, {routes.size(0)} samples) and input_ids "
            f"({'jagged' if input_ids.is_nested else 'padded'}, {input_ids.size(0)} samples) are not one batch's; "
            "keep both in the batch verl built (left_right_2_no_padding converts both)"
        )
    if input_ids.is_nested:
        ids_cu = input_ids.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]
        routes_cu = routes.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]
        ids_values, routes_values = input_ids.values(), routes.values()
        for b in range(input_ids.size(0)):
            n, m = int(ids_cu[b + 1] - ids_cu[b]), int(routes_cu[b + 1] - routes_cu[b])
            if n != m:
                raise RowCountError(
                    f"sample {b}: routed_experts holds {m} rows for {n} tokens; the routes were cut or extended apart "
                    "from input_ids (a dropped or repeated row): rebuild them from the rollout"
                )
            yield ids_values[ids_cu[b] : ids_cu[b + 1]], routes_values[routes_cu[b] : routes_cu[b + 1]]
        return
    if attention_mask_BS is None or tuple(routes.shape[:2]) != tuple(input_ids.shape):
        raise BatchFieldError(
            f"routed_experts of shape {tuple(routes.shape)} for input_ids of shape {tuple(input_ids.shape)} (mask "
            f"{'given' if attention_mask_BS is not None else 'missing'}): a padded batch's routes are (batch, "
            "positions, layers, top_k) like its input_ids, with its attention_mask"
        )
    keep_BS = attention_mask_BS.to("cpu", torch.bool)
    counts_B = keep_BS.sum(1).tolist()
    firsts_B = keep_BS.to(torch.int8).argmax(1).tolist()
    for b in range(input_ids.size(0)):
        first, count = int(firsts_B[b]), int(counts_B[b])
        if bool(keep_BS[b, first : first + count].all()):  # verl's layout: one run of tokens, sliced (no copy)
            yield input_ids[b, first : first + count], routes[b, first : first + count]
        else:
            yield input_ids[b][keep_BS[b].to(input_ids.device)], routes[b][keep_BS[b].to(routes.device)]


def route_digests(
    routes: torch.Tensor, input_ids: torch.Tensor, attention_mask_BS: torch.Tensor | None = None
) -> np.ndarray:
    """(B,) object array of digests: the `non_tensor_batch[DIGEST_KEY]` column of a dense batch."""
    digests = [
        route_digest(ids_N, routes_NPK) for ids_N, routes_NPK in sample_rows(routes, input_ids, attention_mask_BS)
    ]
    column = np.empty(len(digests), dtype=object)
    column[:] = digests
    return column


def checked_digest_column(column: Any, batch_size: int) -> list[Any]:
    """The digest column as a list of `batch_size` digests (bytes of `DIGEST_SIZE`), or `BatchFieldError`."""
    if type(column).__module__.startswith("tensordict") and hasattr(column, "tolist"):
        column = column.tolist()  # tensordict's NonTensorStack (DataProto.to_tensordict)
    is_vector = isinstance(column, (list, tuple)) or (isinstance(column, np.ndarray) and column.ndim == 1)
    if not is_vector or len(column) != batch_size:
        shape = getattr(column, "shape", None)
        size = f"{len(column)} entries" if is_vector else "no sequence" if shape is None else f"shape {tuple(shape)}"
        raise BatchFieldError(
            f"the '{DIGEST_KEY}' column is a {type(column).__name__} ({size}) for {batch_size} samples; it "
            "holds one digest per sample, as put_routes(..., form='dense') wrote it: keep it in that batch"
        )
    for b, digest in enumerate(column):
        if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_SIZE:
            raise BatchFieldError(
                f"the '{DIGEST_KEY}' column: sample {b} holds a {type(digest).__name__}"
                f"{f' of {len(digest)} bytes' if isinstance(digest, (bytes, bytearray)) else ''}, not a "
                f"{DIGEST_SIZE}-byte digest; the column is put_routes(..., form='dense')'s, not to be edited"
            )
    return list(column)


def check_route_digests(
    column: Any, routes: torch.Tensor, input_ids: torch.Tensor, attention_mask_BS: torch.Tensor | None = None
) -> None:
    """`TokenMismatchError` naming the first sample whose routes and tokens are not the pair that was written; a
    column that is not one 16-byte digest per sample (a number, a 0-d array or tensor, str) is a `BatchFieldError`."""
    column = checked_digest_column(column, int(input_ids.size(0)))
    for b, (ids_N, routes_NPK) in enumerate(sample_rows(routes, input_ids, attention_mask_BS)):
        if route_digest(ids_N, routes_NPK) != column[b]:
            raise TokenMismatchError(
                f"sample {b}: its routed_experts rows and input_ids ({ids_N.shape[0]} tokens) are not the pair "
                "put_routes wrote (digest differs): the routes were shifted, cut, edited or reordered apart from the "
                "tokens; keep routed_experts, input_ids and the digest column in one batch and move them together"
            )


__all__ = [
    "DIGEST_KEY",
    "DIGEST_SIZE",
    "check_route_digests",
    "checked_digest_column",
    "route_digest",
    "route_digests",
    "sample_rows",
]
