"""Which token rows of a Model Runner V2 step are forced, to which experts: the step's rows mapped to requests.

vLLM 0.31-0.33 (Model Runner V2, `vllm/v1/worker/gpu/`) flattens a step's scheduled tokens into one
batch. Its `InputBatch` says whose tokens sit where: batch index i belongs to request `req_ids[i]`, its
tokens are rows `query_start_loc_np[i] .. query_start_loc_np[i + 1]` of the flattened step, and the first
of them is at sequence position `num_computed_tokens_np[i]`: the host mirror of the computed-token count
from which MRv2's `_prepare_pos_seq_lens_kernel` writes the device-side positions (count + offset in the
request's rows); the two are equal without speculative decoding, which forcing refuses. vLLM's own
routed-experts output maps rows to requests the same way (`AuxOutputWorkerConnector.prepare_output` keeps
`token_starts = num_computed_tokens_np` and `query_start_loc`). Everything here is host-side numpy: no
device tensor is read, so filling the forcing buffers never waits for the GPU.

`RowMap` keeps the checked forced routes of the runner's requests, keyed by request id:
- `admit` sees each request the scheduler hands the runner as new (`scheduled_new_reqs`: a first
  schedule; in MRv2 also a request resumed after preemption, kept as it was, and a streaming-input update
  whose prompt grew by a chunk). A request carrying `extra_args[XARG_KEY]` is checked once
  (`ForcedRoutes.parse`, the front end's checks against the loaded model) and kept until it finishes; a
  request that fails the check is counted in `refused_requests` and routes live (its client sees the
  capture differ: `ForcingNotAppliedError`). A streaming-input update of a session that forces routes is
  refused the same way, for the rest of the session: vLLM checks a chunk's routes against that chunk alone
  while the session's positions span every chunk, and it keeps the first chunk's cache salt, so neither the
  chunk's routes nor the first chunk's plan (re-anchored, they would force the first chunk's tokens with the
  update's experts on a recompute) can be right. The front end refuses such chunks by name (`plugin`).
- `forget` drops finished requests (`finished_req_ids`); a preempted request keeps its plan, since MRv2
  re-sends it as new, recomputing from position 0 or from its prefix-cache hit.
- `rows_of(batch)` gives the step's forced rows and their experts, or None when no row is forced.

Keying by (request, position) is what keeps every forced row right: a chunked prefill's later chunk
starts at its computed-token count; a resumed request's recompute starts again at 0; a prefix-cache hit
schedules only the tokens after the hit, so only they get rows (the KV of the hit was computed under the
same forced routes: forced prompts are salted with their routes' digest, `forced_routes.salted`);
decode steps past the forced prefix and unforced requests in the same batch get no rows.

Legend: N = forced token rows of one step, L = the model's MoE layers, K = top-k, R = requests of the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from routereplay.engines.vllm.forced_routes import XARG_KEY, ForcedRoutes, ServedRouting
from routereplay.errors import ForcedRoutesError

LOG = logging.getLogger("routereplay.vllm.forcing")
_UNFORCED = object()  # a request seen without forced routes
_ABSENT = object()  # a request not seen yet


@dataclass(frozen=True, slots=True)
class ForcedStep:
    """One step's forced rows: `rows_N` index the step's flattened tokens; `experts_NLK` (-1 in a layer = live
    there) has one column per MoE layer, in `ServedRouting.moe_layers` order."""

    rows_N: np.ndarray
    experts_NLK: np.ndarray

    @property
    def forced_rows(self) -> int:
        """(token, layer) rows that are forced (not -1)."""
        return int((self.experts_NLK[:, :, 0] >= 0).sum())


@dataclass(slots=True)
class RowMap:
    """The forced routes of one MRv2 runner's requests, and each step's forced rows."""

    served: ServedRouting
    plans: dict[str, Any] = field(default_factory=dict)  # request id -> ForcedRoutes | _UNFORCED | ForcedRoutesError
    asked: dict[str, tuple[Any, int]] = field(default_factory=dict)  # request id -> (its routes text, prompt length)
    forced_requests: int = 0
    refused_requests: int = 0
    steps_forced: int = 0
    forced_rows: int = 0

    # --- requests --------------------------------------------------------------------------------

    def admit(self, new_requests: Any) -> None:
        """Check the forced routes of requests scheduled as new (`SchedulerOutput.scheduled_new_reqs`).

        A request already known with the same routes and prompt (resumed after preemption, or after
        `reset_prefix_cache(reset_running_requests=True)`) keeps its plan. One re-sent with another prompt or
        other routes is a streaming-input update (the session's prompt grew by a chunk): if it or the session
        forces routes, the session routes live from then on, counted in `refused_requests` (the front end
        refuses such chunks by name; only a request that bypassed it lands here)."""
        for data in new_requests:
            request_id = str(data.req_id)
            extra = getattr(getattr(data, "sampling_params", None), "extra_args", None) or {}
            asked = (extra.get(XARG_KEY), len(getattr(data, "prompt_token_ids", None) or ()))
            known = self.plans.get(request_id, _ABSENT)
            if known is _ABSENT:
                self.plans[request_id] = self._parse(request_id, data)
            elif self.asked.get(request_id) != asked:
                forcing = XARG_KEY in extra or isinstance(known, ForcedRoutes | ForcedRoutesError)
                self.plans[request_id] = self._refuse_update(request_id, known) if forcing else _UNFORCED
            self.asked[request_id] = asked

    def forget(self, finished_ids: Any) -> None:
        """Drop the plans of requests that finished or were aborted (`SchedulerOutput.finished_req_ids`)."""
        for request_id in finished_ids:
            self.plans.pop(request_id, None)
            self.asked.pop(request_id, None)

    def plan_of(self, request_id: str) -> ForcedRoutes | None:
        plan = self.plans.get(request_id)
        return plan if isinstance(plan, ForcedRoutes) else None

    def _refuse_update(self, request_id: str, known: Any) -> ForcedRoutesError:
        """A streaming-input update of a session that forces routes: live from now on (counted once per request)."""
        if isinstance(known, ForcedRoutesError):
            return known
        error = ForcedRoutesError(
            f"vLLM request {request_id!r}: forced routes (extra_args {XARG_KEY!r}) on a streaming-input session: its "
            "prompt grew by a chunk, and vLLM gives a chunk's routes no session positions and keeps the first "
            "chunk's cache salt; the session routes live from here on (send the whole prompt as one request)"
        )
        self.refused_requests += 1
        LOG.error("%s (routed live)", error)
        return error

    def _parse(self, request_id: str, data: Any) -> Any:
        extra = getattr(getattr(data, "sampling_params", None), "extra_args", None) or {}
        if XARG_KEY not in extra:
            return _UNFORCED
        prompt = getattr(data, "prompt_token_ids", None)
        try:
            plan = ForcedRoutes.parse(extra[XARG_KEY], self.served, prompt, where=f"vLLM request {request_id!r}")
        except ForcedRoutesError as error:
            self.refused_requests += 1
            LOG.error("%s (routed live)", error)
            return error
        self.forced_requests += 1
        return plan

    # --- steps -----------------------------------------------------------------------------------

    def rows_of(self, batch: Any) -> ForcedStep | None:
        """The forced rows of the step MRv2's `InputBatch` describes, or None when none is forced."""
        if not any(isinstance(plan, ForcedRoutes) for plan in self.plans.values()):
            return None
        num_reqs = int(batch.num_reqs)
        starts_R = np.asarray(batch.query_start_loc_np[: num_reqs + 1], dtype=np.int64)
        computed_R = np.asarray(batch.num_computed_tokens_np[:num_reqs], dtype=np.int64)
        rows: list[np.ndarray] = []
        experts: list[np.ndarray] = []
        for index, request_id in enumerate(batch.req_ids[:num_reqs]):
            plan = self.plan_of(request_id)
            if plan is None:
                continue
            first, count = int(starts_R[index]), int(starts_R[index + 1] - starts_R[index])
            begin = int(computed_R[index])  # the position of the request's first row this step
            if count <= 0 or begin >= plan.stop or begin + count <= plan.start:
                continue  # a decode step past the forced prefix, or a chunk before it
            positions_n = np.arange(begin, begin + count, dtype=np.int64)
            inside_n, experts_nLK = plan.rows_at(positions_n)
            rows.append(first + np.flatnonzero(inside_n))
            experts.append(experts_nLK)
        if not rows:
            return None
        step = ForcedStep(np.concatenate(rows), np.concatenate(experts))
        if step.rows_N.size == 0:
            return None
        self.steps_forced += 1
        self.forced_rows += step.forced_rows
        return step

    def counters(self) -> dict[str, int]:
        """What was forced so far: requests, refused requests, forced (token, layer) rows, steps."""
        return {
            "forced_requests": self.forced_requests,
            "refused_requests": self.refused_requests,
            "forced_rows": self.forced_rows,
            "steps_forced": self.steps_forced,
        }


__all__ = ["ForcedStep", "RowMap"]
