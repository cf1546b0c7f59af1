"""Generation routes on TRL's batch layout (issue 14): cut from generate's forwards, placed as TRL pads.

No TRL here: `generation_traces` and `engine_routes` work on tensors. Routes are synthetic and name
their own position: row (b, s) of a forward routes experts {code, code + 1} with code = 10 b + s, so a
misplaced row shows up as another code.
"""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import MissingRoutesError, RowCountError, TokenMismatchError
from routereplay.integrations.trl.layout import engine_routes, generation_traces

LAYERS, TOP_K, EXPERTS = (0, 1), 2, 64


def coded(batch: int, positions: int, offset: int = 0) -> torch.Tensor:
    """(B, S, L, K) routes whose row (b, s) routes experts {10 b + s + offset, + 1} in every layer."""
    code_BS = 10 * torch.arange(batch)[:, None] + torch.arange(positions)[None, :] + offset
    return torch.stack([code_BS, code_BS + 1], dim=-1)[:, :, None, :].expand(-1, -1, len(LAYERS), -1).contiguous()


def codes(trace_or_routes: torch.Tensor) -> list[int]:
    return trace_or_routes[..., 0, 0].tolist()


def test_generation_traces_cut_prompt_and_fed_completion_tokens() -> None:
    """Misplaced routes (issue 14): generate's prefill covers the left-padded prompts, then one position
    per decoding step; each completion's trace is its own prompt columns (padding dropped) then its fed
    completion tokens, without the last sampled token, with the fed token ids attached."""
    prompts = [[5, 6], [7, 8, 9]]  # padded to P = 3: row 0 starts at column 1
    completions = [[1], [4, 4, 1]]  # row 0 stopped at once (EOS), row 1 generated three tokens
    steps = [coded(2, 3), coded(2, 1, offset=3), coded(2, 1, offset=4)]  # prefill, then two decoding steps
    traces = generation_traces(steps, prompts, completions, layers=LAYERS, num_experts=EXPERTS, policy_version=7)
    assert [codes(torch.from_numpy(t.experts.astype("int64"))) for t in traces] == [[1, 2], [10, 11, 12, 13, 14]]
    assert [t.token_ids.tolist() for t in traces if t.token_ids is not None] == [[5, 6], [7, 8, 9, 4, 4]]
    assert traces[1].segments[0].policy_version == 7


def test_generation_without_kv_cache_is_refused() -> None:
    """Silent misroute (issue 14): a generate that re-runs the whole sequence every step (no KV cache)
    does not lay its routes out as prefill plus one position per step, so it is refused, not cut wrong."""
    steps = [coded(2, 3), coded(2, 4)]
    with pytest.raises(MissingRoutesError, match=r"generate must use its KV cache"):
        generation_traces(steps, [[5, 6], [7, 8, 9]], [[1, 2], [3, 1]], layers=LAYERS, num_experts=EXPERTS)


def _batch() -> tuple[list, torch.Tensor, torch.Tensor]:
    """Two generations as TRL scores them: P = 3 (left-padded), C = 3 (right-padded)."""
    prompts, completions = [[5, 6], [7, 8, 9]], [[1], [4, 4, 1]]
    steps = [coded(2, 3), coded(2, 1, offset=3), coded(2, 1, offset=4)]
    traces = generation_traces(steps, prompts, completions, layers=LAYERS, num_experts=EXPERTS)
    ids_BS = torch.tensor([[0, 5, 6, 1, 0, 0], [7, 8, 9, 4, 4, 1]])
    mask_BS = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    return traces, ids_BS, mask_BS


def test_engine_routes_follow_trls_padding() -> None:
    """Misplaced routes (issue 14): prompts are left-padded and completions right-padded in TRL's batch;
    each row's routes land on its own tokens, with -1 on padding and on the last sampled token, and on a
    completion TRL masked out (mask_truncated_completions)."""
    traces, ids_BS, mask_BS = _batch()
    routes_BSLK = engine_routes(traces, ids_BS, mask_BS, 3, layers=LAYERS, top_k=TOP_K)
    assert codes(routes_BSLK) == [[-1, 1, 2, -1, -1, -1], [10, 11, 12, 13, 14, -1]]

    masked_BS = mask_BS.clone()
    masked_BS[1, 3:] = 0  # TRL zeroes a truncated completion's mask
    routes_BSLK = engine_routes(traces, ids_BS, masked_BS, 3, layers=LAYERS, top_k=TOP_K)
    assert codes(routes_BSLK)[1] == [10, 11, 12, -1, -1, -1]


def test_engine_routes_refuse_other_tokens_and_other_lengths() -> None:
    """Silent misroute (issue 14): a batch holding other tokens than the generation routed (another
    order, a re-tokenisation) is a TokenMismatchError, and a trace longer than its completion's room a
    RowCountError, both naming the completion."""
    traces, ids_BS, mask_BS = _batch()
    other_BS = ids_BS.clone()
    other_BS[1, 3] = 9  # another first completion token than generate sampled
    mismatch = r"sequence 1: token 3 .* is id 9 in the batch but the trace routed id 4"
    with pytest.raises(TokenMismatchError, match=mismatch):
        engine_routes(traces, other_BS, mask_BS, 3, layers=LAYERS, top_k=TOP_K)
    with pytest.raises(RowCountError, match=r"completion 1: its trace routes 5 tokens, so 3 completion tokens"):
        engine_routes(traces, ids_BS[:, :5], mask_BS[:, :5], 2, layers=LAYERS, top_k=TOP_K)
