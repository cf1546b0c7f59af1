"""Fixed-address forcing state that every wrapped router of one model reads: graph-safe route forcing.

A CUDA graph replays kernels against the addresses it captured, so the forced ids and the per-token
mask live in device tensors allocated once, sized by the engine's largest step (`max_tokens`, vLLM's
`max_num_batched_tokens`), and never reallocated: each step overwrites them in place. The wrapped
routers (`forcing.router`) read `ids_TLK[:n, column]` and `mask_TL[:n, column]` with tensor ops only,
so the same code is right eagerly, under `torch.compile`, and replayed from a graph.

`load` stages a step's forced rows in host memory (pinned when the device is a GPU) and copies them into
the device tensors with `non_blocking` copies on the current stream: the step's forward, queued after
them on the same stream, sees them, and nothing on the device side waits for the host. The only wait is
on the host, before the staging memory is overwritten, for the previous step's copy (long finished by
then). Rows not listed in a step are unforced (mask False); their ids are whatever an earlier step left,
always a valid expert id or 0, and never read (the routers pick ids with `where` before any gather).
Only the rows up to the highest one written in this step or the one before are copied, so a step that
forces a few early rows copies a few rows.

With `capture_weights`, the wrapped routers also write the combine weights they return (after forcing) into
`weights_TLK` (float32, fixed address, rows [0, n) of each step), so a worker can hand back the engine's
own weights beside vLLM's routed-experts capture. Rows past the step's n keep an earlier step's values.

`forced` is a host flag for the worker's own bookkeeping (is anything forced this step); the routers
never branch on it, because a graph replays whatever branch was taken at capture.

Legend: T = token rows of the largest step (`max_tokens`), N = rows a step forces, L = MoE layers
forced (`moe_layers`, in that order), K = top-k.
"""

from __future__ import annotations

import numpy as np
import torch

from routereplay.errors import ForcedRoutesError


class ForcingBuffers:
    """Fixed-address forcing state every wrapped router of one model reads (graph-safe)."""

    __slots__ = (
        "_event",
        "_high",
        "_staged_ids_TLK",
        "_staged_mask_TL",
        "column",
        "forced",
        "ids_TLK",
        "mask_TL",
        "max_tokens",
        "moe_layers",
        "num_experts",
        "top_k",
        "weights_TLK",
    )

    def __init__(
        self,
        max_tokens: int,
        moe_layers: tuple[int, ...],
        top_k: int,
        device: torch.device | str,
        *,
        capture_weights: bool = False,
        num_experts: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """`num_experts` (ids must be below it) and `num_layers` (the model's decoder layers, which the MoE layer
        numbers must lie in) are checked when given; everything is checked before anything is allocated."""
        if not isinstance(moe_layers, (tuple, list)):
            raise ForcedRoutesError(
                f"ForcingBuffers(moe_layers={moe_layers!r}): pass the model's MoE layer numbers as a tuple of "
                "integers (its global decoder-layer numbers, ServedRouting.moe_layers)"
            )
        optional = tuple(n for n in (num_experts, num_layers) if n is not None)
        sizes = (max_tokens, top_k, *moe_layers, *optional)
        if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in sizes):
            raise ForcedRoutesError(
                f"ForcingBuffers(max_tokens={max_tokens!r}, moe_layers={moe_layers!r}, top_k={top_k!r}, "
                f"num_experts={num_experts!r}, num_layers={num_layers!r}): sizes and layer numbers must be integers"
            )
        called = (
            f"ForcingBuffers(max_tokens={max_tokens}, moe_layers={tuple(moe_layers)}, top_k={top_k}, "
            f"num_experts={num_experts})"
        )
        if max_tokens < 1 or not moe_layers:
            raise ForcedRoutesError(
                f"{called}: need at least one token row and one MoE layer; pass the engine's max_num_batched_tokens "
                "and the model's MoE layer numbers"
            )
        if num_experts is not None and num_experts < 1:
            raise ForcedRoutesError(f"{called}: num_experts must be >= 1; pass the model's routed expert count")
        if top_k < 1 or (num_experts is not None and top_k > num_experts):
            bound = "num_experts" if num_experts is not None else "the model's num_experts"
            raise ForcedRoutesError(
                f"{called}: need 1 <= top_k <= {bound}; pass the model's top-k (num_experts_per_tok) and its "
                "routed expert count"
            )
        if len(set(moe_layers)) != len(moe_layers):
            raise ForcedRoutesError(f"ForcingBuffers: MoE layer numbers {moe_layers} repeat; pass each layer once")
        if num_layers is not None and num_layers < 1:
            raise ForcedRoutesError(f"ForcingBuffers(num_layers={num_layers}): pass the model's decoder layer count")
        outside = [int(layer) for layer in moe_layers if layer < 0 or (num_layers is not None and layer >= num_layers)]
        if outside:
            within = f"[0, {num_layers})" if num_layers is not None else ">= 0"
            raise ForcedRoutesError(
                f"ForcingBuffers(moe_layers={tuple(moe_layers)}): MoE layer numbers {outside} are not decoder layers "
                f"of the model (global layer numbers are {within}); pass ServedRouting.moe_layers, the model's own"
            )
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ForcedRoutesError(
                f"ForcingBuffers(device={device!r}): not a torch device ({exc}); pass the model's device, e.g. "
                "'cpu', 'cuda:0' or a torch.device"
            ) from None
        self.max_tokens = int(max_tokens)
        self.moe_layers = tuple(int(layer) for layer in moe_layers)
        self.top_k = int(top_k)
        self.num_experts = None if num_experts is None else int(num_experts)  # ids must be below it, when given
        self.column = {layer: i for i, layer in enumerate(self.moe_layers)}
        shape = (self.max_tokens, len(self.moe_layers), self.top_k)
        self.ids_TLK = torch.zeros(shape, dtype=torch.int32, device=device)
        self.mask_TL = torch.zeros(shape[:2], dtype=torch.bool, device=device)
        # the combine weights the wrapped routers returned this step (float32), when asked for
        self.weights_TLK = torch.zeros(shape, dtype=torch.float32, device=device) if capture_weights else None
        pin = device.type == "cuda"
        self._staged_ids_TLK = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self._staged_mask_TL = torch.zeros(shape[:2], dtype=torch.bool, pin_memory=pin)
        self._event = torch.cuda.Event() if pin else None
        self._high = 0  # rows [0, _high) of the device tensors may hold a forced row
        self.forced = False

    def load(self, rows_N: np.ndarray, experts_NLK: np.ndarray) -> None:
        """Force `experts_NLK[i]` on token row `rows_N[i]` of this step (a layer's row of -1: live there); every
        other row routes live. Staged on the host, copied in place without a device-side wait."""
        rows_N = np.asarray(rows_N)
        experts_NLK = np.asarray(experts_NLK)
        if rows_N.size == 0 and experts_NLK.size == 0 and experts_NLK.shape[1:] in ((), self.ids_TLK.shape[1:]):
            self.clear()
            return
        self._check(rows_N, experts_NLK)
        self._wait_for_staging()
        high = int(rows_N.max()) + 1
        span = max(high, self._high)
        staged_ids_TLK = self._staged_ids_TLK.numpy()
        staged_mask_TL = self._staged_mask_TL.numpy()
        staged_ids_TLK[:span] = 0
        staged_mask_TL[:span] = False
        mask_NL = experts_NLK[:, :, 0] >= 0
        staged_mask_TL[rows_N] = mask_NL
        staged_ids_TLK[rows_N] = np.maximum(experts_NLK, 0)  # a live (row, layer) is all -1: its ids become 0
        self._copy(span)
        self._high = high
        self.forced = bool(mask_NL.any())

    def clear(self) -> None:
        """No forced rows this step (nothing to do when already clear)."""
        if self._high:
            self.mask_TL[: self._high].zero_()
            self._high = 0
        self.forced = False

    def _check(self, rows_N: np.ndarray, experts_NLK: np.ndarray) -> None:
        shape = (rows_N.shape[0], len(self.moe_layers), self.top_k) if rows_N.ndim == 1 else None
        if shape is None or experts_NLK.shape != shape:
            raise ForcedRoutesError(
                f"ForcingBuffers.load: rows {rows_N.shape} and experts {experts_NLK.shape} do not fit; pass N row "
                f"indices and an (N, {len(self.moe_layers)}, {self.top_k}) array (MoE layers {self.moe_layers})"
            )
        if rows_N.dtype.kind not in "iu" or experts_NLK.dtype.kind not in "iu":  # numpy files timedelta64 as integer
            raise ForcedRoutesError(
                f"ForcingBuffers.load: rows ({rows_N.dtype}) and experts ({experts_NLK.dtype}) must be integers "
                "(signed or unsigned; not bool, float, timedelta64 or datetime64)"
            )
        if rows_N.min() < 0 or rows_N.max() >= self.max_tokens:
            raise ForcedRoutesError(
                f"ForcingBuffers.load: token rows {rows_N.min()}..{rows_N.max()} are outside the step's "
                f"[0, {self.max_tokens}) rows; size the buffers by the engine's max_num_batched_tokens"
            )
        seen_T = np.zeros(self.max_tokens, dtype=bool)  # a scatter, not np.unique's sort
        seen_T[rows_N] = True
        if int(seen_T.sum()) != len(rows_N):
            raise ForcedRoutesError("ForcingBuffers.load: a token row is listed twice; list each row once")
        live_NLK = experts_NLK < 0  # a row's first id says live or forced; every id must agree (no K-axis reductions,
        mixed = (live_NLK != live_NLK[:, :, :1]).any()  # which numpy runs 5-15x slower than a broadcast compare)
        # the int32 buffers would wrap a larger id; with the model's expert count known, ids must be below it
        ceiling = np.iinfo(np.int32).max if self.num_experts is None else self.num_experts
        if experts_NLK.max() >= ceiling:
            bound = "int32's range" if self.num_experts is None else f"the model's {self.num_experts} experts"
            raise ForcedRoutesError(
                f"ForcingBuffers.load: expert id {int(experts_NLK.max())} is not below {bound}; pass the model's "
                "logical expert ids"
            )
        if mixed or (experts_NLK < -1).any():
            raise ForcedRoutesError(
                "ForcingBuffers.load: a (row, layer) mixes -1 with expert ids, or holds an id below -1; a layer's "
                "row is either all expert ids (forced) or all -1 (live)"
            )
        twice_NL = _names_an_expert_twice(experts_NLK)
        if twice_NL.any():
            n, column = (int(i) for i in np.argwhere(twice_NL)[0])
            raise ForcedRoutesError(
                f"ForcingBuffers.load: token row {int(rows_N[n])}, MoE layer {self.moe_layers[column]} names an "
                f"expert twice ({experts_NLK[n, column].tolist()}; {int(twice_NL.sum())} such (row, layer)); a "
                "route is a set of top_k distinct expert ids (zero padding is not 'no route': use -1)"
            )

    def _wait_for_staging(self) -> None:
        """The previous step's copy out of the staging memory has finished (host-side wait, outside a forward)."""
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, span: int) -> None:
        self.ids_TLK[:span].copy_(self._staged_ids_TLK[:span], non_blocking=True)
        self.mask_TL[:span].copy_(self._staged_mask_TL[:span], non_blocking=True)
        if self._event is not None:
            self._event.record()


def _names_an_expert_twice(experts_NLK: np.ndarray) -> np.ndarray:
    """(N, L) bool: forced (row, layer)s naming an expert twice (a live one is all -1, never counted). Pairwise
    compares of contiguous top-k columns: 0.4 ms for 2,048 rows x 48 layers x top-8 on one EPYC core, where a
    sort along K takes 5 ms and shifted compares reduced along K 13 ms."""
    num_rows, num_layers, top_k = experts_NLK.shape
    columns_KR = np.ascontiguousarray(experts_NLK.reshape(-1, top_k).T)  # R = N * L
    twice_R = np.zeros(columns_KR.shape[1], dtype=bool)
    for i in range(top_k):
        for j in range(i + 1, top_k):
            twice_R |= columns_KR[i] == columns_KR[j]
    return (twice_R & (columns_KR[0] >= 0)).reshape(num_rows, num_layers)


__all__ = ["ForcingBuffers"]
