"""Top-k order in replay: `order="engine"` forces the routes' own order, `order="set"` the live order.

The order of a row's K ids is the order of the routing weights' renormalisation sum and of the
experts' combine, so it changes the logits. On CPU these tiny models show it in fp32 (HF's
renormalisation sums in fp32 and casts to bf16, which hides the reorder at this size); PhiMoE's two
picks are ordered by construction (pick 1 is masked for pick 2), so it shows it in bf16. DeepSeek-V3
selects with `topk(sorted=False)`: its natural order is not by score.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from routereplay.codec import blob as codec
from routereplay.errors import ConfigError, OrderLostError
from routereplay.runtime import Replayer
from routereplay.store.route_store import RouteStore
from routereplay.trace.route_trace import RouteTrace
from tests.runtime.models import experts_inputs, random_routes

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)

FAMILIES = ["qwen3_moe", "deepseek_v3", "phimoe"]


def _model(model_type: str) -> nn.Module:
    """A tiny model where order shows: top-4 renormalised in fp32, or PhiMoE's two picks in bf16."""
    import transformers

    if model_type == "phimoe":
        return hf_tiny.tiny_model("phimoe", dtype=torch.bfloat16)
    config = hf_tiny.tiny_config(model_type)
    config.num_experts_per_tok, config.norm_topk_prob = 4, True
    if model_type == "deepseek_v3":
        config.n_group, config.topk_group = 1, 1  # every expert selectable: the top-4 is over all 8
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@dataclass(slots=True)
class Runs:
    """A model, its batch, the natural run and an engine run (the natural sets, each row reversed)."""

    model: nn.Module
    replayer: Replayer
    inputs: dict[str, torch.Tensor]
    natural_logits: torch.Tensor
    natural_routes: torch.Tensor
    natural_traces: list[RouteTrace]
    engine_logits: torch.Tensor
    engine_routes: torch.Tensor
    engine_traces: list[RouteTrace]

    def logits(self, routes: torch.Tensor | list[RouteTrace], **kwargs: object) -> torch.Tensor:
        """The model's logits under replay of `routes` (RouteTraces placed by the batch's mask)."""
        with self.replayer.replay(routes, self.inputs["attention_mask"], **kwargs), torch.no_grad():  # type: ignore[arg-type]
            return self.model(**self.inputs).logits


def _runs(model_type: str) -> Runs:
    from routereplay.runtime import attach

    model = _model(model_type)
    replayer = attach(model)
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with replayer.record() as rec, torch.no_grad():
        natural_logits = model(**inputs).logits
    with replayer.replay(rec.routes.flip(-1), order="engine") as used, torch.no_grad():
        engine_logits = model(**inputs).logits
    mask = inputs["attention_mask"]
    return Runs(
        model=model,
        replayer=replayer,
        inputs=inputs,
        natural_logits=natural_logits,
        natural_routes=rec.routes,
        natural_traces=rec.traces(mask),
        engine_logits=engine_logits,
        engine_routes=used.routes,
        engine_traces=used.traces(mask),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def runs(request: pytest.FixtureRequest) -> Runs:
    return _runs(request.param)


def test_engine_order_reaches_the_combine(runs: Runs) -> None:
    """Guards against order="engine" losing the given order on its way to the combine (a sort, or the
    live order): the reversed rows are the routes used, and the logits are not the natural ones."""
    assert torch.equal(runs.engine_routes, runs.natural_routes.flip(-1))
    assert not torch.equal(runs.engine_logits, runs.natural_logits)


def test_ordered_codec_replays_the_engine_run_bit_for_bit(runs: Runs) -> None:
    """Guards against order="engine" not reproducing a recorded engine run from ordered-codec traces, and
    against order="set" keeping the stored order instead of the live order of the (natural) set."""
    decoded = [codec.decode(codec.encode(trace, mode="ordered")) for trace in runs.engine_traces]
    assert all(trace.ordered for trace in decoded)
    assert torch.equal(runs.logits(decoded, order="engine"), runs.engine_logits)
    assert torch.equal(runs.logits(decoded), runs.natural_logits)


def test_ordered_store_replays_the_engine_run_bit_for_bit(runs: Runs) -> None:
    """Guards against an ordered RouteStore losing the id order that order="engine" needs."""
    store = RouteStore(codec_mode="ordered")
    ids = runs.inputs["input_ids"]
    for index, trace in enumerate(runs.engine_traces):
        store.add_turn(index, [*ids[index].tolist(), 0], trace)  # the engine's next token: every row is kept
    stored = [store.trace(index) for index in range(len(runs.engine_traces))]
    assert all(trace.ordered for trace in stored)
    assert torch.equal(runs.logits(stored, order="engine"), runs.engine_logits)
    assert torch.equal(runs.logits(stored, order="set"), runs.natural_logits)


def test_set_codec_routes_replay_the_natural_run_bit_for_bit(runs: Runs) -> None:
    """Guards against set-codec routes (rows sorted ascending) being forced in sorted order: set replay
    must give the natural logits and routes (DeepSeek-V3's unsorted top-k order too), and order="engine"
    must refuse traces that kept only the set."""
    traces = [codec.decode(codec.encode(trace, mode="set")) for trace in runs.natural_traces]
    assert not any(trace.ordered for trace in traces)
    sorted_routes = runs.natural_routes.sort(dim=-1).values
    assert not torch.equal(sorted_routes, runs.natural_routes), "the natural order must not be ascending"
    with runs.replayer.replay(traces, runs.inputs["attention_mask"]) as used, torch.no_grad():
        logits = runs.model(**runs.inputs).logits
    assert torch.equal(logits, runs.natural_logits)
    assert torch.equal(used.routes, runs.natural_routes)
    assert not torch.equal(runs.logits(sorted_routes, order="engine"), runs.natural_logits)
    with pytest.raises(OrderLostError, match="keep only the expert set"):
        runs.logits(traces, order="engine")


def test_a_bad_order_is_refused(runs: Runs) -> None:
    """Guards against an unknown order silently replaying in some order."""
    with pytest.raises(ConfigError, match="order='sorted'"):
        runs.logits(runs.natural_routes, order="sorted")


def test_set_order_takes_other_sets_by_live_score_descending() -> None:
    """Guards against set order forcing a non-natural set in its stored order (or in the order of the
    natural row): such a row reaches the experts by router score descending, a natural set in the
    natural order."""
    runs = _runs("qwen3_moe")
    batch, positions, layers, top_k = runs.natural_routes.shape
    other = random_routes(batch, positions, layers, top_k, 8, seed=3).to(runs.natural_routes.dtype)
    natural_row = (torch.arange(positions) % 2 == 0).reshape(1, positions, 1, 1)
    forced = torch.where(natural_row, runs.natural_routes, other).sort(dim=-1).values
    router = runs.model.model.layers[0].mlp.gate
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = router.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        with runs.replayer.replay(forced) as used, experts_inputs(runs.model) as received, torch.no_grad():
            runs.model(**runs.inputs)
    finally:
        handle.remove()
    logits_TE, _, indices_TK = seen[0]
    forced_TK, natural_TK = forced[:, :, 0].reshape(-1, top_k), runs.natural_routes[:, :, 0].reshape(-1, top_k)
    assert torch.equal(indices_TK, used.routes[:, :, 0].reshape(-1, top_k).long())
    assert torch.equal(received[0][0], indices_TK), "the experts receive the router's order"
    assert torch.equal(indices_TK.sort(dim=-1).values, forced_TK.long()), "the forced sets are replayed"
    same_T = (forced_TK == natural_TK.sort(dim=-1).values).all(dim=-1)
    assert same_T.any() and not same_T.all()
    assert torch.equal(indices_TK[same_T], natural_TK[same_T].long())
    scores_TK = logits_TE.gather(-1, indices_TK)[~same_T]
    assert (scores_TK[:, :-1] >= scores_TK[:, 1:]).all(), "other sets go by live score, descending"
    assert not torch.equal(indices_TK[~same_T], forced_TK[~same_T].long()), "the ascending order is not kept"


def test_product_keys_take_the_live_grid_order_of_a_sorted_set() -> None:
    """Guards against Doge's set order ignoring the grid (positions, not ids, are what its top-k sorts):
    natural sets stored sorted come back in the natural order, other sets by grid value descending."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("doge")
    replayer = attach(model)
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 8), generator=torch.Generator().manual_seed(1))
    with replayer.record() as rec, torch.no_grad():
        model(input_ids=ids)
    natural = rec.routes
    assert not torch.equal(natural.sort(dim=-1).values, natural)
    with replayer.replay(natural.sort(dim=-1).values) as used, torch.no_grad():
        model(input_ids=ids)
    assert torch.equal(used.routes, natural)
    swapped = natural.clone()
    swapped[..., 1] = (natural.max(dim=-1).values + 1) % model.config.num_experts  # mostly not the natural set
    swapped = torch.where((swapped[..., :1] == swapped[..., 1:]).all(-1, keepdim=True), natural, swapped)
    block = model.model.layers[0].mlp
    seen: list[torch.Tensor] = []
    handle = block.router_gate.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    try:
        with replayer.replay(swapped.sort(dim=-1).values) as used, torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    keys = block.num_keys
    logits_2TN = seen[0].view(2, -1, keys)
    chosen_TK = used.routes[:, :, 0].reshape(-1, 2).long()
    grid_TK = logits_2TN[0].gather(-1, chosen_TK // keys) + logits_2TN[1].gather(-1, chosen_TK % keys)
    assert (grid_TK[:, 0] >= grid_TK[:, 1]).all(), "each pair goes by grid value, descending"
    assert torch.equal(chosen_TK.sort(dim=-1).values, swapped[:, :, 0].reshape(-1, 2).sort(dim=-1).values.long())


def test_sparsemixer_training_set_order_goes_by_logit() -> None:
    """Guards against PhiMoE's set order in training following the Gumbel scores (or the stored order)
    instead of the logits: the first pick of each forced pair is its higher-logit expert."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model("phimoe").train()
    replayer = attach(model)
    router = model.model.layers[0].mlp.router
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 8), generator=torch.Generator().manual_seed(1))
    forced = random_routes(2, 8, len(replayer.layers), 2, router.num_experts, seed=5)
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = router.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        with replayer.replay(forced) as used, torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    logits_TC, _, experts_TK = seen[0]
    assert torch.equal(experts_TK, used.routes[:, :, 0].reshape(-1, 2).long())
    assert torch.equal(experts_TK.sort(dim=-1).values, forced[:, :, 0].reshape(-1, 2).sort(dim=-1).values)
    picked_TK = logits_TC.gather(-1, experts_TK)
    assert (picked_TK[:, 0] >= picked_TK[:, 1]).all()
    assert not torch.equal(experts_TK, forced[:, :, 0].reshape(-1, 2)), "the stored order is not kept"
