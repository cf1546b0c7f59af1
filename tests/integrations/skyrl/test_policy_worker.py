"""routereplay R3 / R2 on SkyRL 0.4.0's own FSDP policy worker (`FSDPPolicyWorkerBase`), one gloo rank.

The worker runs SkyRL's own passes: `forward` (the old-log-prob pass, micro-batched by SkyRL's iterator) and
`forward_backward` + `optim_step` (updates), on batches SkyRL's preprocessing builds (`worker_case.py`). The
truth is a probe on the experts modules: the expert ids each MoE layer's experts receive, per call, in both
layouts SkyRL's `HFModelWrapper` feeds the model (packed `remove_microbatch_padding` and padded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.integrations.skyrl.worker_case import (
    MOE_LAYERS,
    TOP_K,
    WORKER_MARKS,
    build_worker,
    dispatched,
    expected_rows,
    random_routes,
    sequences,
    sorted_rows,
    tiny_model,
    token_rows,
    trainer_config,
    training_batch,
)

pytestmark = WORKER_MARKS

LAYOUTS = pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])


@pytest.fixture
def cpu(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL moves micro-batches to `torch.cuda.current_device()`; on this CPU machine that is "cpu"."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.delenv("ROUTEREPLAY_SKYRL_ROUTER_REPLAY", raising=False)


@contextmanager
def gate_choices(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Per MoE layer and call, (T, K) top-k of the router's own logits: the live choice, whatever is forced."""
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in MOE_LAYERS}
    handles = []
    for layer in MOE_LAYERS:
        gate = model.model.layers[layer].mlp.gate

        def hook(_m: torch.nn.Module, _a: tuple, out: tuple, layer: int = layer) -> None:
            seen[layer].append(out[0].detach().topk(TOP_K, dim=-1).indices)

        handles.append(gate.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def one_pass(worker, model, data, *, update: bool, remove_padding: bool) -> dict[int, torch.Tensor]:
    """Run SkyRL's forward pass or one update (forward_backward + optim_step); (N, K) sorted probe rows per layer."""
    with dispatched(model) as calls:
        if update:
            worker.forward_backward(data)
            worker.optim_step()
        else:
            worker.forward(data)
    mask = data["attention_mask"]
    return {layer: sorted_rows(token_rows(mask, remove_padding, calls[layer])) for layer in MOE_LAYERS}


@LAYOUTS
def test_r3_replays_rollout_routes_in_old_log_prob_pass_and_two_updates(cpu: None, remove_padding: bool) -> None:
    seqs = sequences()
    routes = random_routes(seqs)
    data = training_batch(seqs, routes)
    expected = {layer: sorted_rows(expected_rows(routes, seqs, layer)) for layer in MOE_LAYERS}
    routed = ~(expected[MOE_LAYERS[0]] < 0).any(-1)  # every token but each trajectory's final one

    model = tiny_model()
    natural = one_pass(build_worker(model, trainer_config(r3=False), remove_padding=remove_padding), model, data,
                       update=False, remove_padding=remove_padding)  # fmt: skip
    assert all(int((natural[la][routed] != expected[la][routed]).any(-1).sum()) > 0 for la in MOE_LAYERS)

    worker = build_worker(model, trainer_config(), remove_padding=remove_padding)
    before = [p.detach().clone() for p in model.parameters()]
    passes = [one_pass(worker, model, data, update=u, remove_padding=remove_padding) for u in (False, True, True)]
    for seen in passes:
        for layer in MOE_LAYERS:
            disagree = int((seen[layer][routed] != expected[layer][routed]).any(-1).sum())
            assert disagree == 0, f"layer {layer}: {disagree} tokens off the rollout's routes"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # it trained
    stats = worker.routing().replayer.stats
    finals, micro_batches = len(seqs), 2
    assert stats.fallback_rows == 3 * finals * len(MOE_LAYERS)  # 3 passes, the final tokens only, counted
    assert stats.replayed_rows == 3 * int(routed.sum()) * len(MOE_LAYERS)
    assert stats.forwards == 3 * micro_batches


@LAYOUTS
def test_r3_rows_without_a_captured_route_route_live_never_as_skyrl_dummy_experts(
    cpu: None, remove_padding: bool
) -> None:
    """SkyRL packs dummy experts 0..K-1 on each trajectory's uncaptured final token (router_padding_mask True);
    the replayer gets -1 there and the experts receive the router's own live top-k."""
    seqs = sequences()
    routes = random_routes(seqs)
    data = training_batch(seqs, routes)
    final_N = (sorted_rows(expected_rows(routes, seqs, MOE_LAYERS[0])) < 0).any(-1)
    packed = data["rollout_expert_indices"]
    assert int(data["router_padding_mask"][data["attention_mask"].bool()].sum()) == len(seqs)
    dummy = packed.values[packed.cu_seqlens[1:].long() - 1][:, list(MOE_LAYERS)]
    assert dummy.tolist() == [[[0, 1], [0, 1]]] * len(seqs)  # what SkyRL's Megatron path forces there

    model = tiny_model()
    worker = build_worker(model, trainer_config(), remove_padding=remove_padding)
    with gate_choices(model) as live, dispatched(model) as calls:
        worker.forward(data)
    mask = data["attention_mask"]
    for layer in MOE_LAYERS:
        got = sorted_rows(token_rows(mask, remove_padding, calls[layer]))[final_N]
        want = sorted_rows(token_rows(mask, remove_padding, live[layer]))[final_N]
        assert torch.equal(got, want), f"layer {layer}: the final tokens did not route live"
        assert (got != torch.arange(TOP_K)).any(-1).any()  # not SkyRL's dummy 0..K-1 (live routing differs)
    assert worker.routing().replayer.stats.fallback_rows_by_layer == {la: len(seqs) for la in MOE_LAYERS}


def test_r3_packed_and_padded_micro_batches_dispatch_identically(cpu: None) -> None:
    seqs = sequences()
    data = training_batch(seqs, random_routes(seqs))
    runs = {}
    for remove_padding in (True, False):
        model = tiny_model()
        worker = build_worker(model, trainer_config(), remove_padding=remove_padding)
        with dispatched(model) as calls:
            logprobs = worker.forward(data).loss_fn_outputs
            worker.forward_backward(data)
        rows = {la: token_rows(data["attention_mask"], remove_padding, calls[la][:2]) for la in MOE_LAYERS}
        update = {la: token_rows(data["attention_mask"], remove_padding, calls[la][2:]) for la in MOE_LAYERS}
        runs[remove_padding] = (rows, update, logprobs)
    for layer in MOE_LAYERS:
        assert torch.equal(sorted_rows(runs[True][0][layer]), sorted_rows(runs[False][0][layer]))
        assert torch.equal(sorted_rows(runs[True][1][layer]), sorted_rows(runs[False][1][layer]))
    response_mask = data["response_mask"].bool()
    for b, (packed_out, padded_out) in enumerate(zip(runs[True][2], runs[False][2], strict=True)):
        keep = response_mask[b]  # padding positions differ by construction: packed leaves 0 there
        got, want = torch.tensor(packed_out["logprobs"])[keep], torch.tensor(padded_out["logprobs"])[keep]
        assert torch.allclose(got, want, atol=1e-5)


@LAYOUTS
def test_r2_records_in_the_forward_pass_and_replays_it_in_two_updates(
    cpu: None, monkeypatch: pytest.MonkeyPatch, remove_padding: bool
) -> None:
    seqs = sequences()
    data = training_batch(seqs, None)  # R2: the rollout returns no routes

    def run(mode: str) -> list[dict[int, torch.Tensor]]:
        monkeypatch.setenv("ROUTEREPLAY_SKYRL_ROUTER_REPLAY", mode)
        model = tiny_model()
        worker = build_worker(model, trainer_config(r3=False), remove_padding=remove_padding, lr=5e-2)
        return [one_pass(worker, model, data, update=u, remove_padding=remove_padding) for u in (False, True, True)]

    natural = run("disabled")
    drift = sum(int((natural[2][la] != natural[0][la]).any(-1).sum()) for la in MOE_LAYERS)
    assert drift > 0, "the updates must move natural routing, or R2 shows nothing"
    recorded = run("R2")
    for seen in recorded[1:]:
        for layer in MOE_LAYERS:
            assert torch.equal(seen[layer], recorded[0][layer]), f"layer {layer}: R2 drifted"
    assert all(torch.equal(recorded[0][la], natural[0][la]) for la in MOE_LAYERS)  # it recorded natural routing


@LAYOUTS
def test_r3_replay_spans_backward_so_activation_checkpointing_recomputes_the_same_routes(
    cpu: None, remove_padding: bool
) -> None:
    """SkyRL's `gradient_checkpointing` (HF checkpointing, use_reentrant False): backward re-runs each decoder
    layer's forward; the recomputed routers replay the same rollout routes because the context spans backward."""
    seqs = sequences()
    routes = random_routes(seqs)
    data = training_batch(seqs, routes)
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    worker = build_worker(model, trainer_config(micro_batch_size=len(seqs)), remove_padding=remove_padding)
    with dispatched(model) as calls:
        worker.forward_backward(data)
    stats = worker.routing().replayer.stats
    assert stats.recompute_calls == len(MOE_LAYERS)  # one micro-batch: each MoE router re-ran once in backward
    mask = data["attention_mask"]
    for layer in MOE_LAYERS:
        assert len(calls[layer]) == 2  # the forward, and its recomputation
        want = sorted_rows(expected_rows(routes, seqs, layer))
        routed = (want >= 0).all(-1)
        first, again = (sorted_rows(token_rows(mask, remove_padding, [c])) for c in calls[layer])
        assert torch.equal(first[routed], want[routed]) and torch.equal(again, first)


def test_r3_through_skyrls_own_fsdp2_sharding(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's `FSDPStrategy.prepare` (what its `init_model` runs: meta move, `fully_shard` per decoder layer and
    root, full state dict loaded, AdamW + scheduler) on a one-rank CPU mesh; routereplay binds the sharded model
    at its first pass and replays as on the unsharded one. Its `_sync_non_persistent_buffers` calls `.cuda()`; on
    one rank it has nothing to broadcast, so it is skipped here."""
    import skyrl.backends.skyrl_train.distributed.fsdp_utils as fsdp_utils
    from skyrl.train.config.config import MixedPrecisionConfig
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.setattr(fsdp_utils, "_sync_non_persistent_buffers", lambda model, full_sd: None)
    seqs = sequences()
    routes = random_routes(seqs)
    data = training_batch(seqs, routes)
    cfg = trainer_config()
    cfg.policy.fsdp_config.mixed_precision = MixedPrecisionConfig(param_dtype="fp32", reduce_dtype="fp32")
    worker = build_worker(tiny_model(), cfg, remove_padding=True)
    worker.strategy.device_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    worker.strategy.total_training_steps = 2
    worker.model, worker.optimizer, worker.scheduler = worker.strategy.prepare((worker.model, None, None))
    model = worker.model.model
    assert isinstance(model, FSDPModule)
    passes = [one_pass(worker, model, data, update=u, remove_padding=True) for u in (False, True, True)]
    for layer in MOE_LAYERS:
        want = sorted_rows(expected_rows(routes, seqs, layer))
        routed = (want >= 0).all(-1)
        for seen in passes:
            assert torch.equal(seen[layer][routed], want[routed]), f"layer {layer}"
    assert worker.routereplay_stats()["fallback_rows"] == 3 * len(seqs) * len(MOE_LAYERS)


def test_r2_one_recording_spans_every_forward_until_the_next_update(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's default `recompute_old_logprobs_per_minibatch` forwards each policy mini-batch separately, all before
    the first update: the forwards add to one recording (each update finds its samples, whichever mini-batch
    recorded them), and the first forward after an update starts the next recording (the last one's dropped)."""
    monkeypatch.setenv("ROUTEREPLAY_SKYRL_ROUTER_REPLAY", "R2")
    seqs = sequences()
    data = training_batch(seqs, None)
    model = tiny_model()
    worker = build_worker(model, trainer_config(r3=False), remove_padding=True)
    first, second = data[0:2], data[2:4]  # SkyRL's mini-batches: contiguous slices, in order
    with dispatched(model) as calls:
        worker.forward(first)
        worker.forward(second)
    assert worker.routereplay_stats()["recorded_samples"] == len(seqs)
    recorded = {la: token_rows(data["attention_mask"], True, calls[la]) for la in MOE_LAYERS}
    for mini_batch in (second, first):  # an update per mini-batch, in any order
        with dispatched(model) as calls:
            worker.forward_backward(mini_batch)
            worker.optim_step()
        replayed = {la: token_rows(mini_batch["attention_mask"], True, calls[la]) for la in MOE_LAYERS}
        offset = 0 if mini_batch is first else int(first["attention_mask"].sum())
        for layer in MOE_LAYERS:
            want = recorded[layer][offset : offset + len(replayed[layer])]
            assert torch.equal(sorted_rows(replayed[layer]), sorted_rows(want)), f"layer {layer}"
    worker.forward(second)  # the next train batch's first old-log-prob pass
    assert worker.routereplay_stats()["recorded_samples"] == len(second["sequences"])
