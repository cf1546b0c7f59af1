"""Generation routes laid out the way TRL's `GRPOTrainer` pads its batch (no TRL import here).

TRL scores `prompt_completion_ids = cat(prompt_ids, completion_ids)`: prompts left-padded to one width P,
completions right-padded to one width C (`grpo_trainer.py` l.2442-2461 in TRL 1.16.0), attention mask
`cat(prompt_mask, completion_mask)`. A generation's routes are one `RouteTrace` per completion with
`len(prompt) + len(completion) - 1` rows: every fed token; the last sampled token is never fed, so it
has no route and replays live (a counted fallback row).

- `generation_traces`: the routes `model.generate` used, cut from a `Recording` of its forwards (a
  prefill over the left-padded prompts, then one position per decoding step with the KV cache).
- `engine_routes`: per-completion traces placed on TRL's (B, P + C) layout, token ids checked, -1
  where the attention mask is 0 (padding, and completions TRL masks with `mask_truncated_completions`).

Legend: B = completions, P = padded prompt width, C = padded completion width, S = P + C (or the
generation's P + steps), L = bound layers, K = top-k, T = rows of one trace.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from routereplay.enums import Source
from routereplay.errors import MissingRoutesError, RowCountError
from routereplay.runtime.alignment import check_tokens
from routereplay.runtime.routes import traces_to_routes
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype


def generation_traces(
    steps: Sequence[torch.Tensor],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    layers: Sequence[int],
    num_experts: int,
    policy_version: int | None = None,
    slots: Sequence[str] | None = None,
) -> list[RouteTrace]:
    """One trace per completion from the recorded forwards of one `model.generate` call.

    `steps` are `Recording.steps`: the prefill (B, P, L, K) over the left-padded prompts, then one
    (B, 1, L, K) per decoding step. Row b's trace is its prompt's P - len(prompt) .. P - 1 columns, then
    its first len(completion) - 1 generated columns, with the fed token ids (`MissingRoutesError` when
    the forwards are not laid out like that: a generate without KV cache, or another call recorded)."""
    if not steps:
        raise MissingRoutesError(
            "no forward was recorded while the trainer generated, so the completions have no routes; R3 with "
            "use_vllm=False records model.generate's forwards (was generate replaced, or run on another model?)"
        )
    prefill_BPLK, decode = steps[0], list(steps[1:])
    batch, width = int(prefill_BPLK.shape[0]), int(prefill_BPLK.shape[1])
    odd = [tuple(s.shape[:2]) for s in decode if tuple(s.shape[:2]) != (batch, 1)]
    if odd or batch != len(prompt_ids) or batch != len(completion_ids):
        raise MissingRoutesError(
            f"the recorded generation forwards are (B, S) = {(batch, width)} then {odd[:3] or 'one token each'} for "
            f"{len(prompt_ids)} prompts and {len(completion_ids)} completions; routes are cut from a prefill plus "
            "one position per decoding step, so generate must use its KV cache (generation_kwargs "
            "use_cache=True) and be the only model call in the record context"
        )
    routes_BSLK = torch.cat([prefill_BPLK, *decode], dim=1).cpu()
    dtype = canonical_dtype(num_experts)
    traces = []
    for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        fed = [*prompt, *completion][:-1]
        generated = max(len(completion) - 1, 0)
        if len(prompt) > width or width + generated > routes_BSLK.shape[1]:
            raise RowCountError(
                f"completion {b}: prompt of {len(prompt)} tokens and {len(completion)} completion tokens need "
                f"{len(prompt)} prefill columns and {generated} decoding steps, but generate recorded {width} and "
                f"{routes_BSLK.shape[1] - width}; the completions do not come from this generate call"
            )
        prompt_TLK = routes_BSLK[b, width - len(prompt) : width]
        response_TLK = routes_BSLK[b, width : width + generated]
        experts_TLK = torch.cat([prompt_TLK, response_TLK])[: len(fed)].numpy().astype(dtype)
        segments = (Segment(0, len(fed), Source.HF, policy_version),) if fed else ()
        traces.append(RouteTrace(experts_TLK, num_experts, tuple(layers), 0, segments, fed, slots=slots))
    return traces


def engine_routes(
    traces: Sequence[RouteTrace],
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
    completion_width: int,
    *,
    layers: Sequence[int],
    top_k: int,
    slots: Sequence[str] | None = None,
) -> torch.Tensor:
    """(B, S, L, K) routes of `traces` on TRL's batch: prompt rows at the left-padded prompt columns,
    completion rows from column P = S - C on; -1 on the last token, padding and masked completions.

    The batch's token ids are checked against the traces' (`TokenMismatchError`), and a trace that does
    not fit its completion is a `RowCountError`."""
    batch, positions = int(input_ids_BS.shape[0]), int(input_ids_BS.shape[1])
    if len(traces) != batch:
        raise RowCountError(
            f"{len(traces)} generation traces for a batch of {batch} completions; the routes of every completion "
            "are needed, in the batch's order"
        )
    prompt_width = positions - completion_width
    mask_BS = attention_mask_BS.detach().cpu().bool()
    prompt_lengths = mask_BS[:, :prompt_width].sum(dim=1).tolist()
    fed_BS = torch.zeros((batch, positions), dtype=torch.bool)
    fed_BS[:, :prompt_width] = mask_BS[:, :prompt_width]
    for b, (trace, prompt) in enumerate(zip(traces, prompt_lengths, strict=True)):
        completion = trace.stop + 1 - prompt  # the trace routes prompt + completion - 1 tokens
        if not 0 <= completion <= completion_width:
            raise RowCountError(
                f"completion {b}: its trace routes {trace.stop} tokens, so {completion} completion tokens after "
                f"its {prompt}-token prompt, but the batch has room for {completion_width}; the traces belong to "
                "other completions (another order, or a tool call added tokens)"
            )
        fed_BS[b, prompt_width : prompt_width + completion] = True
    fed = fed_BS.numpy()
    check_tokens(traces, fed, input_ids_BS)
    routes_BSLK = traces_to_routes(traces, fed_BS, layers, top_k, slots=slots)
    routes_BSLK[~mask_BS] = -1
    return routes_BSLK.to(attention_mask_BS.device)


__all__ = ["engine_routes", "generation_traces"]
