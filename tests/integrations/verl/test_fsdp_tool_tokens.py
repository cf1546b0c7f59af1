"""R3 on verl's FSDP engine with multi-turn tool samples: tool-response tokens have no route (-1) and route live.

A sample's routes come from `RolloutRoutes` as an agent loop merges them: engine calls decoded from
vLLM's wire form (every decoder layer, the dense one zero-filled, no row for a call's last token) and
tool responses added with `add_tokens`. So -1 rows sit on attended positions that are not a
sequence's last: after the last engine call (sample 0) and between two calls (sample 1, whose second
call returns routes from `start` on, as `routed_experts_prompt_start` / SGLang's `start_len` make it).

verl's `use_remove_padding=False` hands the engine a padded micro-batch with an attention mask;
with it on, one packed row. Both must dispatch the same experts: the probe on each experts module
is the truth, for routereplay's compact column and its dense -1 form of `routed_experts`.

Legend: N = tokens of the batch (all samples back to back), L = MoE layers, K = top-k, T = rows of one call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integrations.verl import fsdp_case as case

pytestmark = pytest.mark.verl

# per sample: ("call", tokens after the call, first routed row) or ("tool", tokens after the tool response)
PLANS: tuple[tuple[tuple, ...], ...] = (
    (("call", 7, 0), ("tool", 9)),  # p5 r4: the tool response ends the sample
    (("call", 5, 0), ("tool", 7), ("call", 9, 7)),  # p3 r6: a tool response between two calls
    (("call", 8, 0),),  # p7 r1
    (("call", 5, 0),),  # p2 r3
)
# what verl's own agent loop can lay out: the last call's rows from the prompt's first token, zeros after them
VERL_PLANS = (PLANS[0], (("call", 5, 0), ("tool", 7), ("call", 9, 0)), *PLANS[2:])
GENERATED = [2, 6, 1, 3]  # response tokens the engine generated (verl's response_mask 1), tool tokens after them


def _verl_batch(seqs: list, traces: list, form: str, remove_padding: bool) -> object:
    """The batch in one of three forms: routereplay's compact column, its dense -1 form with the token digest,
    or verl's own agent-loop `routed_experts` (each sample's last call's rows, zeros elsewhere)."""
    if form != "verl":
        return case.verl_batch(
            seqs, None, remove_padding=remove_padding, micro_batch_size=len(seqs), traces=traces, traces_form=form
        )
    full = case.rollout_routes(case.rollout_model(case.tiny_model()), seqs)
    last_calls = [full[b][: plan[-1][1] - 1] if plan[-1][0] == "call" else full[b][: plan[-2][1] - 1]
                  for b, plan in enumerate(VERL_PLANS)]  # fmt: skip
    return case.verl_batch(
        seqs, last_calls, remove_padding=remove_padding, micro_batch_size=len(seqs), generated=GENERATED
    )


def _multi_turn_traces(
    rollout: torch.nn.Module, seqs: list[tuple[torch.Tensor, torch.Tensor]], plans: tuple = PLANS
) -> list:
    from routereplay.integrations.verl import RolloutRoutes, RouteGeometry

    config = rollout.config
    geometry = RouteGeometry(
        num_experts=config.num_experts,
        num_layers=config.num_hidden_layers,
        top_k=case.TOP_K,
        moe_layers=case.MOE_LAYERS,
    )
    routes = RolloutRoutes(geometry)
    full = case.rollout_routes(rollout, seqs)  # per sample (N - 1, all layers, K): what one call over it returns
    for b, ((prompt, response), plan) in enumerate(zip(seqs, plans, strict=True)):
        ids = torch.cat([prompt, response]).tolist()
        assert plan[-1][1] == len(ids)
        for step in plan:
            if step[0] == "tool":
                routes.add_tokens(b, ids[: step[1]])
                continue
            _, end, start = step
            wire_TPK = full[b][start : end - 1].numpy().astype(np.uint8)  # vLLM >= 0.22: uint8 rows from start
            routes.add_call(b, ids[:end], wire_TPK, start=start, policy_version=0)
    return routes.traces(list(range(len(seqs))))


def _token_routes(traces: list) -> torch.Tensor:
    """(N, L, K): each token's route from its trace, -1 where it has none (tool tokens, each final token)."""
    parts = []
    for trace, (prompt, response) in zip(traces, case.sequences(), strict=True):
        rows = torch.full((prompt.numel() + response.numel(), len(case.MOE_LAYERS), case.TOP_K), -1)
        rows[trace.start : trace.stop] = torch.from_numpy(trace.experts.astype(np.int64))
        parts.append(rows)
    return torch.cat(parts)


@pytest.mark.parametrize("form", ["compact", "dense", "verl"])
def test_tool_tokens_route_live_and_remove_padding_on_and_off_dispatch_identically(
    cpu_engine_module: None, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if form == "verl":  # verl's own form has no digest: replayed only with the documented opt-out
        from routereplay.integrations.verl.route_checks import UNCHECKED_ENV

        monkeypatch.setenv(UNCHECKED_ENV, "1")
    model, seqs = case.tiny_model(), case.sequences()
    traces = _multi_turn_traces(case.rollout_model(model), seqs, VERL_PLANS if form == "verl" else PLANS)
    want_NLK = _token_routes(traces)
    routed_N = want_NLK[:, 0, 0] >= 0
    last_N = case.last_token_mask(_verl_batch(seqs, traces, form, True))
    assert int((~routed_N & ~last_N).sum()) == (2 if form == "verl" else 5), "-1 rows that are not a final token"

    engine = case.build_engine(model, "R3")
    dispatched, fallbacks = {}, {}
    for remove_padding in (True, False):
        data = _verl_batch(seqs, traces, form, remove_padding)
        rows = case.token_rows(data, remove_padding)
        before = engine.routing().replayer.stats.fallback_rows if engine.routing().replayer else 0
        with case.dispatched(model) as seen:
            engine.infer_batch(data)  # the old-log-prob pass
        dispatched[remove_padding] = [case.sorted_rows(rows(seen[m][0])) for m in case.MOE_LAYERS]
        fallbacks[remove_padding] = engine.routing().replayer.stats.fallback_rows - before
    for i, m in enumerate(case.MOE_LAYERS):
        for remove_padding, per_layer in dispatched.items():
            assert torch.equal(per_layer[i][routed_N], case.sorted_rows(want_NLK[routed_N, i])), (
                f"layer {m}, remove_padding={remove_padding}: routed tokens must get the rollout's experts"
            )
        assert torch.equal(dispatched[True][i], dispatched[False][i]), f"layer {m}: packed and padded differ"
    live = int((~routed_N).sum()) * len(case.MOE_LAYERS)
    assert fallbacks == {True: live, False: live}, "every -1 (token, layer) row routes live and is counted once"

    engine.routing().close_and_detach()
    with case.dispatched(model) as seen:
        case.build_engine(model, "disabled").infer_batch(data)
    natural_NK = case.sorted_rows(case.token_rows(data, False)(seen[case.MOE_LAYERS[0]][0]))
    assert not torch.equal(natural_NK[routed_N], case.sorted_rows(want_NLK[routed_N, 0])), (
        "the rollout model must route differently from the trainer, or replay proves nothing"
    )


def test_engine_checks_the_dense_forms_token_digest(cpu_engine_module: None) -> None:
    """The engine reads `routed_experts` through `routed_experts_for_batch`: routereplay's dense form carries a
    token digest, so rows of two equal-length samples swapped apart from their tokens are refused by name."""
    from routereplay.errors import TokenMismatchError

    model, seqs = case.tiny_model(), case.sequences()
    traces = _multi_turn_traces(case.rollout_model(model), seqs)
    data = case.verl_batch(
        seqs, None, remove_padding=True, micro_batch_size=len(seqs), traces=traces, traces_form="dense"
    )
    parts = list(data["routed_experts"].unbind())
    assert parts[0].shape == parts[1].shape, "samples 0 and 1 have equal lengths, so a swap keeps every shape"
    data["routed_experts"] = torch.nested.as_nested_tensor([parts[1], parts[0], *parts[2:]], layout=torch.jagged)
    engine = case.build_engine(model, "R3")
    with case.dispatched(model) as seen, pytest.raises(TokenMismatchError, match="sample 0"):
        engine.infer_batch(data)
    assert all(not calls for calls in seen.values()), "refused before any forward"
