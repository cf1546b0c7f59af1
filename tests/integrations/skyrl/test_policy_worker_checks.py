"""What routereplay's SkyRL worker refuses, and how it follows SkyRL's micro-batching: the switch (SkyRL's
Megatron key for R3, `ROUTEREPLAY_SKYRL_ROUTER_REPLAY` for R2), missing or contradicting routes, a model input
laid out otherwise than the routes, bad rows refused before the model runs, token-based micro-batches, install."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from routereplay.errors import ConfigError, ExpertIdRangeError, MissingRoutesError, TokenMismatchError
from tests.integrations.skyrl import worker_case as case

pytestmark = case.WORKER_MARKS
MODE_ENV = "ROUTEREPLAY_SKYRL_ROUTER_REPLAY"


@pytest.fixture
def cpu(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.delenv(MODE_ENV, raising=False)


def test_the_switch_is_skyrls_megatron_key_for_r3_and_one_variable_for_r2(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("skyrl")
    from routereplay.integrations.skyrl.policy_worker import replay_mode

    monkeypatch.delenv(MODE_ENV, raising=False)
    assert replay_mode(case.trainer_config(r3=True)) == "R3"
    assert replay_mode(case.trainer_config(r3=False)) == "disabled"
    monkeypatch.setenv(MODE_ENV, "R2")
    assert replay_mode(case.trainer_config(r3=False)) == "R2"
    conflict = r"moe_enable_routing_replay=true asks for R3 .* but ROUTEREPLAY_SKYRL_ROUTER_REPLAY=R2"
    with pytest.raises(ConfigError, match=conflict):
        replay_mode(case.trainer_config(r3=True))
    monkeypatch.setenv(MODE_ENV, "r3")
    with pytest.raises(ConfigError, match=r"ROUTER_REPLAY='r3'; use one of"):
        replay_mode(case.trainer_config(r3=False))


@pytest.mark.parametrize("update", [False, True], ids=["forward", "update"])
def test_r3_without_rollout_routes_is_refused(cpu: None, update: bool) -> None:
    seqs = case.sequences()
    data = case.training_batch(seqs, None)
    worker = case.build_worker(case.tiny_model(), case.trainer_config(), remove_padding=True)
    with pytest.raises(MissingRoutesError, match="enable_return_routed_experts=true"):
        worker.forward_backward(data) if update else worker.forward(data)


@pytest.mark.parametrize("update", [False, True], ids=["forward", "update"])
def test_r2_with_rollout_routes_on_the_batch_is_refused(
    cpu: None, monkeypatch: pytest.MonkeyPatch, update: bool
) -> None:
    monkeypatch.setenv(MODE_ENV, "R2")
    seqs = case.sequences()
    data = case.training_batch(seqs, case.random_routes(seqs))
    worker = case.build_worker(case.tiny_model(), case.trainer_config(r3=False), remove_padding=True)
    with pytest.raises(ConfigError, match="R2 with the rollout's routes on the batch"):
        worker.forward_backward(data) if update else worker.forward(data)


def test_r2_update_needs_the_forward_pass_of_the_same_batch(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "R2")
    worker = case.build_worker(case.tiny_model(), case.trainer_config(r3=False), remove_padding=True)
    with pytest.raises(MissingRoutesError, match="no routes recorded on this worker"):
        worker.forward_backward(case.training_batch(case.sequences(), None))
    worker.forward(case.training_batch(case.sequences(seed=0), None))
    with pytest.raises(MissingRoutesError, match="sample 0 of a training micro-batch .* was not in the forward pass"):
        worker.forward_backward(case.training_batch(case.sequences(seed=1), None))


def test_a_model_input_laid_out_otherwise_than_the_routes_is_refused(
    cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If SkyRL fed the model another layout than the one routereplay placed routes for (here: routereplay is told
    'padded' while the wrapper packs), the first forward stops before any expert runs with the misplaced routes."""
    import routereplay.integrations.skyrl.policy_worker as policy_worker
    from routereplay.integrations.skyrl.micro_batch import ModelInputLayout

    def padded_layout(model: object, mask: torch.Tensor) -> ModelInputLayout:
        return ModelInputLayout(attention_mask=mask.to(torch.bool), remove_padding=False)

    monkeypatch.setattr(policy_worker, "layout_of", padded_layout)
    seqs = case.sequences()
    model = case.tiny_model()
    worker = case.build_worker(model, case.trainer_config(), remove_padding=True)
    with case.dispatched(model) as calls, pytest.raises(TokenMismatchError, match="laid the micro-batch out as"):
        worker.forward(case.training_batch(seqs, case.random_routes(seqs)))
    assert all(not calls.get(layer) for layer in case.MOE_LAYERS)


def test_rows_naming_experts_the_model_lacks_are_refused_before_the_model_runs(cpu: None) -> None:
    seqs = case.sequences()
    routes = case.random_routes(seqs)
    routes[2][1, case.MOE_LAYERS[1]] = [3, 16]  # E = 16: id 16 does not exist
    model = case.tiny_model()
    worker = case.build_worker(model, case.trainer_config(), remove_padding=True)
    refusal = r"trajectory 2, token 1 .* layer 2: expert ids \[3, 16\] outside \[0, 16\)"
    with case.dispatched(model) as calls, pytest.raises(ExpertIdRangeError, match=refusal):
        worker.forward(case.training_batch(seqs, routes))
    assert all(not calls.get(layer) for layer in case.MOE_LAYERS)


def test_r3_follows_skyrls_token_based_micro_batches(cpu: None) -> None:
    """`max_tokens_per_microbatch` > 0: SkyRL's TokenBasedBatchIterator packs samples out of order; each sample's
    routes travel with it (PackedTensor segments), so every routed token still gets its rollout route."""
    seqs = case.sequences()
    routes = case.random_routes(seqs)
    data = case.training_batch(seqs, routes)
    model = case.tiny_model()
    worker = case.build_worker(model, case.trainer_config(max_tokens=12), remove_padding=True)
    with case.dispatched(model) as calls:
        worker.forward(data)
    assert len(calls[case.MOE_LAYERS[0]]) > 2  # more micro-batches than the 2 of micro_batch_size=2
    lengths = [len(p) + len(r) for p, r in seqs]
    for layer in case.MOE_LAYERS:
        # samples are packed out of order: compare multisets of rows. Every rollout row is dispatched, and the
        # only other rows are the final tokens' live ones
        want = case.sorted_rows(case.expected_rows(routes, seqs, layer))
        routed = Counter(map(tuple, want[(want >= 0).all(-1)].tolist()))
        got = Counter(map(tuple, case.sorted_rows(torch.cat(calls[layer])).tolist()))
        assert not routed - got
        assert (got - routed).total() == len(seqs)
    with case.dispatched(model) as calls:
        worker.forward_backward(data)
    for layer in case.MOE_LAYERS:
        want = case.sorted_rows(case.expected_rows(routes, seqs, layer))
        routed = Counter(map(tuple, want[(want >= 0).all(-1)].tolist()))
        assert not routed - Counter(map(tuple, case.sorted_rows(torch.cat(calls[layer])).tolist()))
    replayer_stats = worker.routing().replayer.stats
    assert replayer_stats.fallback_rows == 2 * len(seqs) * len(case.MOE_LAYERS)  # two passes, final tokens only
    assert replayer_stats.replayed_rows == 2 * (sum(lengths) - len(seqs)) * len(case.MOE_LAYERS)


def test_install_makes_skyrls_fsdp_entrypoint_build_this_worker() -> None:
    pytest.importorskip("skyrl")
    from ray.actor import ActorClass
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    from routereplay.integrations.skyrl.policy_worker import install, policy_worker_class

    original = fsdp_worker.PolicyWorker
    try:
        cls = install()
        assert cls is policy_worker_class() and issubclass(cls, fsdp_worker.FSDPPolicyWorkerBase)
        actor = fsdp_worker.PolicyWorker
        assert actor is not original and isinstance(actor, ActorClass)  # a Ray actor class, like SkyRL's own
        assert install() is cls and fsdp_worker.PolicyWorker is actor  # idempotent
    finally:
        fsdp_worker.PolicyWorker = original


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_skyrls_padding_micro_batch_routes_live(cpu: None, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """DP ranks with fewer token-based micro-batches get SkyRL's padding micro-batch (random tokens, loss mask 0,
    one attended token; under R3 a dummy route marked in router_padding_mask). It routes live under both modes,
    counted, rather than replaying SkyRL's dummy experts (R3) or failing to find a recording (R2)."""
    from skyrl.backends.skyrl_train.workers.worker_utils import TokenBasedBatchIterator

    original = TokenBasedBatchIterator._sync_num_microbatches
    monkeypatch.setattr(TokenBasedBatchIterator, "_sync_num_microbatches", lambda self: original(self) + 1)
    seqs = case.sequences()
    r3 = mode == "R3"
    if not r3:
        monkeypatch.setenv(MODE_ENV, "R2")
    data = case.training_batch(seqs, case.random_routes(seqs) if r3 else None)
    worker = case.build_worker(case.tiny_model(), case.trainer_config(max_tokens=12, r3=r3), remove_padding=True)
    worker.forward(data)
    before = worker.routereplay_stats()
    out = worker.forward_backward(data)
    after = worker.routereplay_stats()
    assert out.metrics["num_padding_microbatches"] == 1.0
    live = after["fallback_rows"] - before["fallback_rows"]
    assert live == ((len(seqs) if r3 else 0) + 1) * len(case.MOE_LAYERS)  # (R3: final tokens) + the padding token


def test_a_config_that_disagrees_with_the_bound_routers_is_refused(cpu: None) -> None:
    """The routes' geometry comes from the HF config (SkyRL's rows carry every hidden layer); if the routers
    routereplay bound differ from it (here top-k), nothing is replayed against a guessed layout."""
    seqs = case.sequences()
    model = case.tiny_model()
    model.config.num_experts_per_tok = 3  # the routers were built with top-2
    worker = case.build_worker(model, case.trainer_config(), remove_padding=True)
    with pytest.raises(ConfigError, match=r"config names experts/top-k/MoE layers 16/3/\[1, 2\] but routereplay bound"):
        worker.forward(case.training_batch(seqs, case.random_routes(seqs)))
