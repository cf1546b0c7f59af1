"""Sampling-time routes across SGLang's retraction: the rows a request had before it was retracted are the rows it
gets back at finish.

SGLang 0.5.23 keys captured routes by KV slot (`state_capturer/base.py`): each forward writes its rows into a host
buffer at the tokens' KV slots, and a finished request reads `host[req_to_token[row][start:seqlen-1]]`
(`BatchResultProcessor._maybe_collect_routed_experts`). Retraction (KV memory pressure, priority preemption,
`pause_generation(mode="retract")`) frees the request's slots (`release_req` -> `release_kv_cache`, then
`Req.reset_for_retract`) and the request is prefilled again later, which writes new rows: at finish the request
returns the re-prefill's routes beside the log-probs of tokens sampled with the earlier ones. vLLM emits each row
once, when first computed; this makes SGLang do the same.

Two hooks on SGLang's `HookRegistry`, both methods of `SamplingTimeRoutes` (the state they share):
- BEFORE `schedule_batch.release_req` (every retraction goes through it; `Req.reset_for_retract` runs only after
  `release_kv_cache` has given the request's `req_to_token` row back, `req.kv.req_pool_idx` is then None, so the
  rows are read here, while the row still names the slots): rows `[routed_experts_start_len, end)` with
  `end = min(kv_committed_len, seqlen - 1)` (positions whose KV, hence whose routes, were computed) are read
  through the capturer's own `get_topk` and kept for the request. A second retraction keeps the first one's rows
  and adds only the positions computed since.
- AFTER `SchedulerBatchResultProcessor._maybe_collect_routed_experts` (finish): the kept rows are written back over
  the rows SGLang read, position by position; rows first computed after the last retraction stay as read.

What is kept lives here, keyed weakly by SGLang's `Req` (freed with the request, also when it is aborted).
`sampling_rows(req)` hands the kept rows to whoever forces the re-prefill with them (route forcing, `forcing/`).
Counted in `RetractionStats`: requests and rows kept, rows written back, and how many of those had a different
expert set in the re-prefill (what SGLang alone would have returned).

Shapes: N rows (token positions), L layers (all decoder layers, as SGLang's capturer holds them), K top-k.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

RELEASE_TARGET = "sglang.srt.managers.schedule_batch.release_req"
FINISH_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_routed_experts"
)


@dataclass(slots=True)
class SavedRows:
    """Rows of one request as first computed: `rows_NLK[i]` is absolute position `start + i`."""

    start: int
    rows_NLK: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + int(self.rows_NLK.shape[0])


@dataclass(slots=True)
class RetractionStats:
    """What the retraction hooks did in this process."""

    retractions: int = 0  # retractions of requests that return routes
    rows_saved: int = 0  # rows read from the host buffer at retraction (new positions only)
    requests_spliced: int = 0  # finished requests whose returned rows were rewritten
    rows_spliced: int = 0  # rows written back at finish
    rows_changed: int = 0  # of those, rows whose re-prefill expert set differed from the sampling-time set


class SamplingTimeRoutes:
    """The rows each retracted request had before retraction, and the two hooks that keep and restore them."""

    __slots__ = ("_saved", "stats")

    def __init__(self) -> None:
        self._saved: weakref.WeakKeyDictionary[Any, SavedRows] = weakref.WeakKeyDictionary()
        self.stats = RetractionStats()

    def install(self, registry: Any) -> None:
        """Register both hooks on SGLang's `HookRegistry` (applied by `load_plugins()` or `apply_hooks()`)."""
        from sglang.srt.plugins.hook_registry import HookType

        registry.register(RELEASE_TARGET, self.before_release, HookType.BEFORE)
        registry.register(FINISH_TARGET, self.after_collect, HookType.AFTER)

    def sampling_rows(self, req: Any) -> SavedRows | None:
        """The rows `req` had before its retraction(s), or None if it was never retracted with routes."""
        return self._saved.get(req)

    def before_release(self, *args: Any, **kwargs: Any) -> None:
        """BEFORE `release_req(*, req, req_to_token_pool, ...)`: keep the request's computed rows."""
        req = kwargs.get("req")
        pool = kwargs.get("req_to_token_pool")
        if req is None or pool is None or not getattr(req, "return_routed_experts", False):
            return
        if req.kv.req_pool_idx is None:
            return
        from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

        capturer = get_global_experts_capturer()
        if capturer is None:
            return
        start = int(req.routed_experts_start_len)
        end = min(int(req.kv.kv_committed_len), req.seqlen - 1)
        self.stats.retractions += 1
        kept = self._saved.get(req)
        if kept is not None and kept.start != start:
            # routed_experts_start_len is fixed at admission (scheduler.py); never mix rows of two origins
            logger.warning(
                "routereplay: request %s changed routed_experts_start_len (%d -> %d) across retractions; "
                "its earlier sampling-time rows are dropped",
                req.rid,
                kept.start,
                start,
            )
            del self._saved[req]
            kept = None
        known = kept.end if kept is not None else start
        if end <= known:
            return
        # SGLang's own read (the one finish uses): rows [start, end) through req_to_token, a copy
        rows_NLK = capturer.get_topk(
            req_pool_idx=req.kv.req_pool_idx, seqlen=end + 1, req_to_token_pool=pool, start_len=start
        )
        if kept is not None:
            import torch

            rows_NLK = torch.cat([kept.rows_NLK, rows_NLK[known - start :]])
        self._saved[req] = SavedRows(start=start, rows_NLK=rows_NLK)
        self.stats.rows_saved += end - known

    def after_collect(self, result: Any, processor: Any, req: Any, *args: Any, **kwargs: Any) -> None:
        """AFTER `_maybe_collect_routed_experts(self, req)`: write the kept rows back over the re-prefill's."""
        kept = self._saved.pop(req, None)
        returned_NLK = getattr(req, "routed_experts", None)
        if kept is None or returned_NLK is None:
            return
        first = int(req.routed_experts_start_len)
        lo = max(kept.start, first)
        hi = min(kept.end, first + int(returned_NLK.shape[0]))
        if hi <= lo:
            return
        mine_NLK = kept.rows_NLK[lo - kept.start : hi - kept.start]
        theirs_NLK = returned_NLK[lo - first : hi - first]
        changed = (mine_NLK.sort(dim=-1).values != theirs_NLK.sort(dim=-1).values).flatten(1).any(dim=1)
        theirs_NLK.copy_(mine_NLK)
        self.stats.requests_spliced += 1
        self.stats.rows_spliced += hi - lo
        self.stats.rows_changed += int(changed.sum())
        logger.debug(
            "routereplay: request %s returns its sampling-time routes for positions [%d, %d) (%d rows differed "
            "in the re-prefill)",
            req.rid,
            lo,
            hi,
            int(changed.sum()),
        )
