"""verl's FSDP engine with routereplay: R3 replays the rollout's routes, R2 records then replays them.

The engine is verl 0.9.1's `FSDPEngineWithLMHead` subclass, built like verl's CPU tests build
engines (`fsdp_case.py`), driven through verl's own `infer_batch` / `train_batch` /
`forward_backward_batch` on batches made by verl's `left_right_2_no_padding`, on one gloo rank.
A probe on every experts module records the expert ids it is dispatched (what the model computed
with, not what routereplay says it forced).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import free_port
from tests.integrations.verl import fsdp_case as case

pytestmark = pytest.mark.verl


def _disagreement(got_NK: torch.Tensor, want_NK: torch.Tensor) -> float:
    """Fraction of token rows whose expert set differs."""
    return float((case.sorted_rows(got_NK) != case.sorted_rows(want_NK)).any(-1).float().mean())


def _rollout(seed: int = 0) -> tuple[torch.nn.Module, list, list[torch.Tensor]]:
    model = case.tiny_model(seed)
    seqs = case.sequences(seed)
    return model, seqs, case.rollout_routes(case.rollout_model(model), seqs)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_r3_replays_the_rollout_routes_in_the_old_log_prob_pass_and_every_update(
    cpu_engine_module: None, unchecked_verl_routes: None, remove_padding: bool
) -> None:
    from routereplay.integrations.verl.micro_batch import rollout_routes

    model, seqs, routes = _rollout()
    model.gradient_checkpointing_enable()
    data = case.verl_batch(seqs, routes, remove_padding=remove_padding, micro_batch_size=len(seqs))
    want_NPK = rollout_routes(data["routed_experts"], data["input_ids"])
    routed = ~case.last_token_mask(data)  # the rollout never routed a sequence's final token
    rows = case.token_rows(data, remove_padding)

    natural = case.build_engine(model, "disabled")
    with case.dispatched(model) as seen:
        natural.infer_batch(case.verl_batch(seqs, routes, remove_padding=remove_padding, micro_batch_size=4))
    assert max(_disagreement(rows(seen[m][0])[routed], want_NPK[routed, m]) for m in case.MOE_LAYERS) > 0, (
        "the rollout model must route differently from the trainer, or replay proves nothing"
    )

    engine = case.build_engine(model, "R3")
    with case.dispatched(model) as seen:
        engine.infer_batch(data)  # old-log-prob pass
        for _ in range(2):  # updates: forward, and the checkpoint recompute in backward
            engine.train_batch(
                case.verl_batch(seqs, routes, remove_padding=remove_padding, micro_batch_size=4), case.log_prob_loss
            )
    for m in case.MOE_LAYERS:
        assert len(seen[m]) == 5, f"layer {m}: 1 old-log-prob forward + 2 x (forward + recompute), got {len(seen[m])}"
        for call, ids_TK in enumerate(seen[m]):
            assert _disagreement(rows(ids_TK)[routed], want_NPK[routed, m]) == 0.0, f"layer {m} call {call}"
    assert engine.routing().replayer.stats.fallback_rows > 0  # the final tokens routed live, counted


@pytest.mark.parametrize("remove_padding", [True, False], ids=["packed", "padded"])
def test_r2_records_in_compute_log_prob_and_updates_replay_it_with_zero_drift(
    cpu_engine_module: None, remove_padding: bool
) -> None:
    model, seqs, _ = _rollout()
    model.gradient_checkpointing_enable()
    engine = case.build_engine(model, "R2")
    data = case.verl_batch(seqs, None, remove_padding=remove_padding, micro_batch_size=2)
    output = engine.infer_batch(data)
    recorded = output["model_output"]["routed_experts"]
    assert recorded.is_nested and recorded.dtype == torch.int16
    assert torch.equal(recorded.offsets(), data["input_ids"].offsets())
    recorded_NLK = recorded.values().to(torch.int64)
    assert recorded_NLK.shape[1:] == (len(case.MOE_LAYERS), case.TOP_K) and bool((recorded_NLK >= 0).all())

    rows = case.token_rows(data, remove_padding)
    with case.dispatched(model) as seen:
        for _ in range(2):
            update = case.verl_batch(seqs, None, remove_padding=remove_padding, micro_batch_size=len(seqs))
            update["routed_experts"] = recorded  # verl's trainer unions compute_log_prob's output into the batch
            engine.train_batch(update, case.log_prob_loss)
    for i, m in enumerate(case.MOE_LAYERS):
        assert len(seen[m]) == 4
        for call, ids_TK in enumerate(seen[m]):
            assert _disagreement(rows(ids_TK), recorded_NLK[:, i]) == 0.0, f"R2 drift: layer {m} call {call}"

    with case.dispatched(model) as seen:
        case.build_engine(model, "disabled").infer_batch(
            case.verl_batch(seqs, None, remove_padding=remove_padding, micro_batch_size=len(seqs))
        )
    drift = max(_disagreement(rows(seen[m][0]), recorded_NLK[:, i]) for i, m in enumerate(case.MOE_LAYERS))
    assert drift > 0, "two updates must move natural routing, or zero replay drift proves nothing"


def test_remove_padding_on_and_off_give_the_same_routes_and_log_probs(
    cpu_engine_module: None, unchecked_verl_routes: None
) -> None:
    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    log_probs, dispatched = {}, {}
    for remove_padding in (True, False):
        data = case.verl_batch(seqs, routes, remove_padding=remove_padding, micro_batch_size=len(seqs))
        rows = case.token_rows(data, remove_padding)
        with case.dispatched(model) as seen:
            out = engine.infer_batch(data)
        log_probs[remove_padding] = out["model_output"]["log_probs"].values()
        dispatched[remove_padding] = [case.sorted_rows(rows(seen[m][0])) for m in case.MOE_LAYERS]
    for packed, padded in zip(dispatched[True], dispatched[False], strict=True):
        assert torch.equal(packed, padded)
    torch.testing.assert_close(log_probs[True], log_probs[False], rtol=1e-5, atol=1e-5)


def test_dynamic_batch_size_regrouping_records_and_replays_per_sequence(
    cpu_engine_module: None, unchecked_verl_routes: None
) -> None:
    """verl's dynamic batch size re-groups sequences into micro-batches by token count; the routes move
    with their rows and the recorded routes come back in the batch's order."""
    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R2")
    one = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=len(seqs)))
    regrouped = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True, dynamic_bsz=True))
    assert torch.equal(
        one["model_output"]["routed_experts"].values(), regrouped["model_output"]["routed_experts"].values()
    )
    engine.routing().close_and_detach()

    r3 = case.build_engine(model, "R3")
    batches = [
        case.verl_batch(seqs, routes, remove_padding=True, dynamic_bsz=dyn, micro_batch_size=4) for dyn in (0, 1)
    ]
    outs = [r3.infer_batch(data)["model_output"]["log_probs"].values() for data in batches]
    used = ~case.last_token_mask(batches[0])  # verl's rolled label of a final token is its neighbour's first token
    torch.testing.assert_close(outs[0][used], outs[1][used], rtol=1e-5, atol=1e-5)


def test_pad_to_length_bucket_pad_replays_the_rollout_routes(
    cpu_engine_module: None, unchecked_verl_routes: None
) -> None:
    from routereplay.integrations.verl.micro_batch import rollout_routes

    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    engine.pad_to_length, engine.pad_to_length_bucket = True, 16
    data = case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=len(seqs))
    want_NPK = rollout_routes(data["routed_experts"], data["input_ids"])
    routed = ~case.last_token_mask(data)
    with case.dispatched(model) as seen:
        engine.infer_batch(data)
    for m in case.MOE_LAYERS:
        assert seen[m][0].shape[0] % 16 == 0
        assert _disagreement(case.token_rows(data, True)(seen[m][0])[routed], want_NPK[routed, m]) == 0.0


def test_mode_given_as_hydra_dict_and_disabled_is_verls_engine(
    cpu_engine_module: None, unchecked_verl_routes: None
) -> None:
    model, seqs, routes = _rollout()
    engine = case.build_engine(model, "R3")
    case.set_mode(engine, {"mode": "R3"})  # `+...fsdp_config.router_replay.mode=R3` gives a dict
    data = case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=len(seqs))
    replayed = engine.infer_batch(data)["model_output"]["log_probs"].values()
    case.set_mode(engine, {"mode": "disabled"})
    natural = engine.infer_batch(data)["model_output"]["log_probs"].values()
    assert "routed_experts" not in engine.infer_batch(data)["model_output"]
    assert not torch.allclose(replayed, natural), "the rollout's routes must change the log-probs"


def test_r3_without_routes_is_refused_by_name(cpu_engine_module: None) -> None:
    from routereplay.errors import MissingRoutesError

    model, seqs, _ = _rollout()
    engine = case.build_engine(model, "R3")
    with pytest.raises(MissingRoutesError, match="enable_rollout_routing_replay"):
        engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))
    r2 = case.build_engine(model, "R2")
    with pytest.raises(MissingRoutesError, match="routes compute_log_prob recorded"):
        r2.train_batch(case.verl_batch(seqs, None, remove_padding=True), case.log_prob_loss)
    case.set_mode(engine, {"mode": "R4"})
    with pytest.raises(ValueError, match="router_replay.mode='R4'"):
        engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))


def test_routes_of_other_lengths_or_tokens_are_refused(world: None) -> None:
    from routereplay.errors import RowCountError, TokenMismatchError
    from routereplay.integrations.verl.micro_batch import MicroBatchLayout, rollout_routes

    ids = torch.nested.nested_tensor_from_jagged(torch.arange(10), offsets=torch.tensor([0, 4, 10]))
    routes = torch.nested.nested_tensor_from_jagged(torch.zeros(12, 3, 2, dtype=torch.int16), torch.tensor([0, 5, 12]))
    with pytest.raises(RowCountError, match="sequence 0 of the micro-batch has 5 route rows for 4 tokens"):
        rollout_routes(routes, ids)
    layout = MicroBatchLayout(remove_padding=True, cu_seqlens=torch.tensor([0, 4, 10]), sp_size=2, sp_rank=1)
    fed = layout.place(ids.values(), fill=0)
    layout.check_tokens(ids, fed)
    with pytest.raises(TokenMismatchError, match=r"position \(0, 1\) holds token 99"):
        layout.check_tokens(ids, fed.index_fill(1, torch.tensor([1]), 99))
    with pytest.raises(TokenMismatchError, match="shape"):
        layout.check_tokens(ids, torch.cat([fed, fed], dim=1))


def test_engine_registers_for_this_vendor_and_verl_selects_it(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from routereplay.integrations.verl.fsdp_engine import engine_class, register_engine

    table = {
        model: {backend: dict(keys) for backend, keys in by.items()} for model, by in EngineRegistry._engines.items()
    }
    for backend in ("fsdp", "fsdp2"):
        for key in [k for k in table["language_model"][backend] if isinstance(k, tuple)]:
            del table["language_model"][backend][key]  # an earlier import in this process may have registered
    monkeypatch.setattr(EngineRegistry, "_engines", table)
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    monkeypatch.delenv("VERL_ENGINE_VENDOR", raising=False)
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    cls = register_engine()
    assert cls is engine_class() and issubclass(cls, FSDPEngineWithLMHead)
    assert register_engine() is cls  # idempotent: verl's external_lib may import it in every worker
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is cls
    assert EngineRegistry.get_engine_cls("value_model", "fsdp") is not cls


def test_ulysses_sp_two_ranks_replay_and_record_like_one_rank(tmp_path: object, unchecked_verl_routes: None) -> None:
    """verl's Ulysses slicing and gathering on 2 gloo ranks: each rank's experts get its shard of the
    rollout's routes, and the gathered log-probs and recorded routes equal one rank's."""
    pytest.importorskip("verl")
    import torch.multiprocessing as mp

    from routereplay import layout
    from tests.integrations.verl import fsdp_ulysses

    mp.spawn(fsdp_ulysses.rank_main, args=(free_port(), str(tmp_path)), nprocs=fsdp_ulysses.SP_SIZE, join=True)
    ranks = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(fsdp_ulysses.SP_SIZE)]
    cu = ranks[0]["cu_seqlens"]
    used = torch.ones(int(cu[-1]), dtype=torch.bool)
    used[cu[1:] - 1] = False  # final tokens: live in R3, and verl's rolled label there is a neighbour's
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["sp_log_probs"][used], result["one_log_probs"][used], rtol=1e-5, atol=1e-5)
        assert torch.equal(result["sp_recorded"], result["one_recorded"])
        for m in case.MOE_LAYERS:
            one_NK = result["one_dispatched"][m][: int(cu[-1])]
            want_sK = layout.ulysses_shard(case.sorted_rows(one_NK), fsdp_ulysses.SP_SIZE, rank)
            mine_sK = layout.ulysses_shard(used, fsdp_ulysses.SP_SIZE, rank, fill=0).bool()
            got_sK = case.sorted_rows(result["sp_dispatched"][m])
            assert got_sK.shape == want_sK.shape, f"rank {rank} layer {m}: its shard of the packed row"
            assert torch.equal(got_sK[mine_sK], want_sK[mine_sK]), f"rank {rank} layer {m}"


def test_r3_from_routereplays_compact_column_checks_token_ids(
    cpu_engine_module: None, unchecked_verl_routes: None
) -> None:
    """The rollout side's compact column (blobs with token ids) replays like verl's `routed_experts`,
    through verl's micro-batching, and routes of another sample are refused by token id."""
    from routereplay.errors import TokenMismatchError

    model, seqs, routes = _rollout()
    traces = case.rollout_traces(case.rollout_model(model), seqs)
    engine = case.build_engine(model, "R3")
    dense = case.verl_batch(seqs, routes, remove_padding=True, micro_batch_size=2)
    compact = case.verl_batch(seqs, None, remove_padding=True, micro_batch_size=2, traces=traces)
    used = ~case.last_token_mask(dense)
    lp_dense = engine.infer_batch(dense)["model_output"]["log_probs"].values()
    lp_compact = engine.infer_batch(compact)["model_output"]["log_probs"].values()
    torch.testing.assert_close(lp_compact[used], lp_dense[used], rtol=0, atol=0)

    swapped = case.verl_batch(
        seqs, None, remove_padding=True, micro_batch_size=2, traces=[traces[1], traces[0], *traces[2:]]
    )
    with pytest.raises(TokenMismatchError, match="sample 0"):
        engine.infer_batch(swapped)


def test_megatron_attach_stands_in_for_verls_router_replay_patch_on_its_helper_path(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's Megatron R3 path (align + replay mask + set_router_replay_data) yields, per router, the
    targets routereplay computes from the same micro-batch; `attach_megatron` replays them through
    Megatron's own routing, masked rows live."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    import routereplay
    from routereplay.integrations.verl.micro_batch import bound_layers, rollout_routes
    from tests.integrations.verl import fsdp_megatron as mega

    rr_utils = pytest.importorskip("verl.utils.megatron.router_replay_utils")
    monkeypatch.setattr(rr_utils, "device_name", "cpu")  # verl resolved "cuda" at import on this CPU machine
    parallel_state.initialize_model_parallel()
    try:
        block, config = mega.megatron_block()
        generator = torch.Generator().manual_seed(0)
        lengths = [5, 7, 4]
        input_ids = torch.nested.nested_tensor_from_jagged(
            torch.randint(4, 50, (sum(lengths),), generator=generator), offsets=torch.tensor([0, 5, 12, 16])
        )
        payload = [  # all decoder layers, one route per token, as verl's agent loop pads it
            torch.rand(n * mega.NUM_LAYERS, mega.EXPERTS, generator=generator).argsort(-1)[:, : mega.TOP_K]
            for n in lengths
        ]
        routed = torch.nested.as_nested_tensor(
            [p.view(n, mega.NUM_LAYERS, mega.TOP_K).to(torch.int16) for p, n in zip(payload, lengths, strict=True)],
            layout=torch.jagged,
        )
        response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
        verl_NLK = mega.verl_targets(block, config, routed, input_ids, response_mask)
        ours_NLK = bound_layers(rollout_routes(routed, input_ids), mega.NUM_LAYERS, mega.MOE_LAYERS)
        assert torch.equal(verl_NLK.to(torch.int64), ours_NLK)

        replayer = routereplay.attach_megatron(block)
        x_NH = torch.randn(verl_NLK.shape[0], mega.HIDDEN, generator=generator)
        with replayer.replay([verl_NLK]):
            maps = [router.routing(x_NH @ router.weight.t())[1] for router in mega.routers(block)]
        for i, routing_map in enumerate(maps):
            for n in range(verl_NLK.shape[0]):
                if int(verl_NLK[n, i, 0]) >= 0:
                    assert set(routing_map[n].nonzero().flatten().tolist()) == set(verl_NLK[n, i].tolist())
        assert replayer.stats.fallback_rows == len(lengths) * len(mega.MOE_LAYERS)  # final tokens, live
        replayer.detach()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
def test_gpu_engine_built_by_verls_registry_records_and_replays(tmp_path: object) -> None:
    """GPU only (never run on CPU): verl builds the engine itself -- `EngineRegistry.new` after
    `register_engine()`, FSDP2 sharding, its optimizer -- and R2 records in the forward-only pass and
    replays in the update. A full PPO trainer step (Ray, a vLLM rollout) is beyond this test."""
    import torch.distributed as dist
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.base import EngineRegistry

    from routereplay.integrations.verl.fsdp_engine import register_engine
    from routereplay.testing import word_tokenizer

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{case.free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    path = f"{tmp_path}/model"
    case.tiny_model().save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    cls = register_engine()
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=HFModelConfig(path=path, use_remove_padding=True, enable_gradient_checkpointing=True),
        engine_config=FSDPEngineConfig(
            strategy="fsdp2", use_torch_compile=False, router_replay=EngineRouterReplayConfig(mode="R2")
        ),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
        checkpoint_config=CheckpointConfig(),
    )
    assert isinstance(engine, cls)
    engine.initialize()
    seqs = case.sequences()
    with engine.eval_mode():
        recorded = engine.infer_batch(case.verl_batch(seqs, None, remove_padding=True))["model_output"]
    routes = recorded["routed_experts"]
    assert routes.is_nested and routes.values().shape[1:] == (len(case.MOE_LAYERS), case.TOP_K)
    update = case.verl_batch(seqs, None, remove_padding=True)
    update["routed_experts"] = routes.cpu()
    with engine.train_mode():
        engine.train_batch(update, case.log_prob_loss)
    assert engine.routing().replayer.stats.replayed_rows > 0
