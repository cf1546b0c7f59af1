"""DSA indexer record/replay (`runtime/indexer/replayer.py`) on tiny DeepSeek-V3.2 and GLM-MoE-DSA models.

Guarantees: replaying recorded indexer choices reproduces logits bit for bit (alone and together with
the router Replayer); forced choices are exactly the keys the attention attends; -1 rows take the
live indexer's choice and are counted; checkpoint recompute reuses the recorded / forced choice;
impossible choices raise named errors; other threads run naturally; detach leaves the model as it was.
"""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import (
    AlreadyAttachedError,
    BatchShapeError,
    ConfigError,
    DtypeError,
    IndexerRouteError,
    LayerCountError,
    RecomputeError,
    TopKMismatchError,
)

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)
from routereplay.runtime.indexer.replayer import IndexerReplayer  # noqa: E402

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
BATCH, POSITIONS = 2, 10


def _inputs(model: torch.nn.Module, padded: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(
        0, hf_tiny.text_vocab_size(model), (BATCH, POSITIONS), generator=torch.Generator().manual_seed(7)
    )
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _random_choices(ir: IndexerReplayer, seed: int) -> torch.Tensor:
    """Random causal choices: each row a random subset (1..min(I, s+1) keys) of the keys 0..s, -1 padded."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.full((BATCH, POSITIONS, len(ir.layers), ir.index_topk), -1, dtype=torch.int32)
    for b in range(BATCH):
        for s in range(POSITIONS):
            for layer in range(len(ir.layers)):
                size = int(torch.randint(1, min(ir.index_topk, s + 1) + 1, (1,), generator=generator))
                out[b, s, layer, :size] = torch.randperm(s + 1, generator=generator)[:size].to(torch.int32)
    return out


def _attended_keys(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per decoder layer, the (B, S, T) keys with attention weight > 0 in every head (eager attention)."""
    captured: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append((output[1] > 0).all(dim=1))  # attn_weights (B, H, S, T)

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    try:
        _logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_replay_of_recorded_choices_is_bit_exact(model_type: str, padded: bool) -> None:
    """Replay that changed any attention mask (order, padding fill, masked picks) would change the logits."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model, padded)
    natural = _logits(model, inputs)
    ir = IndexerReplayer(model)
    assert ir.layers == (0, 1, 2) and ir.index_topk == 4 < POSITIONS  # the indexer really selects
    with ir.record() as rec:
        assert torch.equal(_logits(model, inputs), natural), "record must not change the forward"
    indices = rec.indices
    assert indices.shape == (BATCH, POSITIONS, 3, 4) and indices.dtype == torch.int32
    assert torch.equal(indices[0, 1, 0], torch.tensor([0, 1, -1, -1], dtype=torch.int32)), "canonical: future dropped"
    valid = torch.where(indices < 0, POSITIONS, indices)
    assert torch.equal(valid.sort(dim=-1).values, valid), "canonical rows are sorted, -1 last"
    ir.stats.reset()
    with ir.replay(indices, attention_mask=inputs["attention_mask"]) as stats:
        assert torch.equal(_logits(model, inputs), natural), "replaying recorded choices must be bit-exact"
    attended_queries = int(inputs["attention_mask"].sum())
    assert stats.replayed_rows == 3 * attended_queries and stats.fallback_rows == 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_together_with_router_replayer(model_type: str) -> None:
    """`attach` binds the indexers too: routes and indexer choices recorded and replayed in one context."""
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model)
    natural = _logits(model, inputs)
    routers = attach(model)
    ir = routers.indexer
    assert ir is not None
    with pytest.raises(AlreadyAttachedError, match="already bound"):
        IndexerReplayer(model)  # one binder per indexer: the Replayer's
    with routers.record() as rec:
        _logits(model, inputs)
    with routers.replay(rec.routes, indexer=rec.indexer):
        assert torch.equal(_logits(model, inputs), natural), "both replays together must be bit-exact"
    assert ir.stats.replayed_rows > 0
    forced = _random_choices(ir, seed=1)
    with routers.replay(rec.routes, indexer=forced):
        assert not torch.equal(_logits(model, inputs), natural), "forced indexer choices must reach the attention"
    routers.detach()
    assert "forward" not in vars(ir.sites[0].module)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_forced_choices_are_the_attended_keys(model_type: str) -> None:
    """Forced positions must be exactly the keys attended: no -1 fill or live pick may unmask another key."""
    model = hf_tiny.tiny_model(model_type)
    model.config._attn_implementation = "eager"
    inputs = _inputs(model)
    natural = _logits(model, inputs)
    ir = IndexerReplayer(model)
    forced = _random_choices(ir, seed=2)
    with ir.replay(forced):
        attended = _attended_keys(model, inputs)
        assert not torch.equal(_logits(model, inputs), natural), "random choices must change the logits"
    for layer, keys_BST in enumerate(attended):
        expected = torch.zeros(BATCH, POSITIONS, POSITIONS, dtype=torch.bool)
        rows = forced[:, :, layer].long()
        expected.scatter_(-1, rows.clamp(min=0), True)
        expected &= torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).tril()  # the -1 -> 0 clamp is key 0
        expected[..., 0] = (rows == 0).any(dim=-1)
        assert torch.equal(keys_BST, expected), f"layer {layer}: attended keys != forced set"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_unknown_rows_fall_back_live(model_type: str) -> None:
    """A -1 row must take the live choice for that query only, and be counted, not replayed as key 0."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model)
    natural = _logits(model, inputs)
    ir = IndexerReplayer(model)
    with ir.record() as rec:
        _logits(model, inputs)
    holes = rec.indices.clone()
    holes[0, 7, 0] = -1
    holes[1, 9, 0] = -1
    holes[1, 5, 2] = -1  # layer 1 keeps no hole: the live indexer does not run there
    ir.stats.reset()
    with ir.replay(holes) as stats:
        assert torch.equal(_logits(model, inputs), natural), "-1 rows must reproduce the live choice"
    assert stats.fallback_rows == 3 and stats.replayed_rows == 3 * BATCH * POSITIONS - 3
    zeros = rec.indices.clone()
    zeros[0, 7, 0] = torch.tensor([0, -1, -1, -1])  # a real forced row "key 0 only" differs from live
    with ir.replay(zeros):
        assert not torch.equal(_logits(model, inputs), natural)


def _gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs).logits.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpoint_recompute_reuses_choices(model_type: str) -> None:
    """A recompute that ran the indexer live would attend other keys than its forward: other gradients."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model)
    ir = IndexerReplayer(model)
    with ir.record() as plain_record:
        _logits(model, inputs)
    forced = _random_choices(ir, seed=3)
    model.train()
    with ir.replay(forced):
        plain = _gradients(model, inputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ir.stats.reset()
    with ir.replay(forced) as stats:
        checkpointed = _gradients(model, inputs)
    assert stats.recompute_calls == 3, "the recompute must go through the indexer binding"
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-5, atol=1e-7), name
    with ir.record() as rec:
        _gradients(model, inputs)
    assert torch.equal(rec.indices, plain_record.indices), "record under checkpointing must keep its choices"
    assert ir.stats.recompute_calls == 6


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hostile_choices_raise_named_errors(model_type: str) -> None:
    """Impossible choices must be refused on entry with where they are, never replayed."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model, padded=True)
    ir = IndexerReplayer(model)
    with ir.record() as rec:
        _logits(model, inputs)
    good = rec.indices
    cases: list[tuple[torch.Tensor, type[Exception], str, torch.Tensor | None]] = []
    future = good.clone()
    future[0, 2, 1, 3] = 5
    cases.append((future, IndexerRouteError, r"choice 5 at batch row 0, position 2, layer 1 .*future", None))
    high = good.clone()
    high[1, 9, 2, 3] = POSITIONS
    cases.append((high, IndexerRouteError, r"position 9, layer 2 is out of range", None))
    low = good.clone()
    low[0, 4, 0, 3] = -2
    cases.append((low, IndexerRouteError, r"-2 .* below -1", None))
    twice = good.clone()
    twice[0, 6, 0] = torch.tensor([1, 3, 3, -1])
    cases.append((twice, IndexerRouteError, r"choice 3 at batch row 0, position 6, layer 0 appears twice", None))
    padding_key = good.clone()
    padding_key[1, 8, 0, 3] = 1
    cases.append((padding_key, IndexerRouteError, r"position 8, layer 0 is a padding key", inputs["attention_mask"]))
    cases.append((good[:, :, :2], LayerCountError, r"hold 2 layers .* 3 DSA indexers", None))
    cases.append((good[..., :3], TopKMismatchError, r"3 wide but index_topk is 4", None))
    cases.append((good[0], BatchShapeError, r"must be \(B, S, L, I\)", None))
    cases.append((good.float(), DtypeError, r"must be integers", None))
    # hostile forms (issue 38 item 9): uint64 keys a cast to int64 wraps to -1 ("unknown", the live indexer)
    unsigned = torch.from_numpy(good.numpy().astype(np.int64).astype(np.uint64))  # -1 -> 2**64 - 1
    cases.append((unsigned, IndexerRouteError, r"uint64 key 18446744073709551615, out of range", None))
    cases.append((good.to_sparse(), ConfigError, r"indexer choices is a torch.sparse_coo tensor", None))
    cases.append((good.to("meta"), ConfigError, r"indexer choices is on the 'meta' device", None))
    nan_mask = inputs["attention_mask"].float().masked_fill(inputs["attention_mask"] == 0, float("nan"))
    cases.append((good, ConfigError, r"attention_mask\[1, 0\] = nan", nan_mask))
    for bad, error, match, mask in cases:
        with pytest.raises(error, match=match):
            ir.begin_replay(bad, attention_mask=mask)
        assert ir._context is None, "a refused replay must not open a context"
    with ir.replay(good[:1]), pytest.raises(BatchShapeError, match=r"\(B, S\) = \(1, 10\)"):
        _logits(model, inputs)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RecomputeError, match="recomputed"):  # nothing recorded for the recompute to reuse
        loss = model(**inputs).logits.pow(2).mean()
        with ir.record():
            loss.backward()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_other_threads_run_naturally(model_type: str) -> None:
    """A context must force only its own thread's forwards."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model)
    natural = _logits(model, inputs)
    ir = IndexerReplayer(model)
    seen: list[torch.Tensor] = []
    with ir.replay(_random_choices(ir, seed=4)):
        worker = threading.Thread(target=lambda: seen.append(_logits(model, inputs)))
        worker.start()
        worker.join()
        assert not torch.equal(_logits(model, inputs), natural)
    assert torch.equal(seen[0], natural), "another thread's forward must not be forced"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_detach_restores_the_model(model_type: str) -> None:
    """Detach must leave no attribute behind and the forward as it was."""
    model = hf_tiny.tiny_model(model_type)
    inputs = _inputs(model)
    natural = _logits(model, inputs)
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    before = [dict(m.__dict__) for m in indexers]
    ir = IndexerReplayer(model)
    assert all("forward" in m.__dict__ for m in indexers)
    with pytest.raises(AlreadyAttachedError, match="already bound"):
        IndexerReplayer(model)
    forced = _random_choices(ir, seed=6)
    with ir.replay(forced):
        forced_logits = _logits(model, inputs)
        copied = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
        for other in (copied, loaded):  # copies made inside a context carry no replayer state
            assert torch.equal(_logits(other, inputs), natural), "a copy must run its indexers naturally"
    copy_ir = IndexerReplayer(copied)  # binding the copy unwraps its inert stand-ins
    with copy_ir.replay(forced):
        assert torch.equal(_logits(copied, inputs), forced_logits)
    ir.detach()
    assert [dict(m.__dict__) for m in indexers] == before
    assert torch.equal(_logits(model, inputs), natural)
    IndexerReplayer(model).detach()  # binds again after a detach


def test_shared_glm_layers_follow_their_owner() -> None:
    """A "shared" GLM layer has no indexer: it must not be bound, and it reuses the owning layer's forced keys."""
    import transformers

    config = hf_tiny.tiny_config("glm_moe_dsa")
    config.indexer_types = ["full", "shared", "full"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.config._attn_implementation = "eager"
    inputs = _inputs(model)
    ir = IndexerReplayer(model)
    assert ir.layers == (0, 2)
    forced = _random_choices(ir, seed=5)
    with ir.replay(forced):
        attended = _attended_keys(model, inputs)
    assert torch.equal(attended[1], attended[0]), "layer 1 must attend layer 0's forced keys"
    with ir.record() as rec:
        natural = _logits(model, inputs)
    with ir.replay(rec.indices):
        assert torch.equal(_logits(model, inputs), natural)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", FAMILIES)
def test_indexer_call_on_cuda_never_waits_for_the_device(model_type: str) -> None:
    """A host sync per indexer call (an `.item()` / `.tolist()` on device values) stalls every layer on GPU:
    with CUDA's sync debug mode set to error, recorded and replayed indexer calls (with -1 rows and
    without) run without one; entering the context (validation on the host) is outside the checked region."""
    model = hf_tiny.tiny_model(model_type).cuda()
    ir = IndexerReplayer(model)
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(BATCH, POSITIONS, model.config.hidden_size, device="cuda")
    positions = torch.arange(POSITIONS, device="cuda").expand(BATCH, -1)
    rope = model.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden))
    future = torch.ones(POSITIONS, POSITIONS, dtype=torch.bool, device="cuda").triu(1)
    mask = torch.zeros(BATCH, POSITIONS, POSITIONS, device="cuda").masked_fill(future, torch.finfo(torch.float32).min)

    def call() -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return attention.indexer(hidden, q_resid, rope, mask, positions)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with ir.record() as rec:
        live = call()
    assert torch.equal(rec.calls[0][0][0][0, 2], torch.tensor([0, 1, 2, -1], dtype=torch.int32, device="cuda"))
    forced = _random_choices(ir, seed=7).cuda()
    for holes in (0, 2):
        forced[0, :holes] = -1
        ir.stats.reset()
        with ir.replay(forced):
            chosen = call()
        assert (ir.stats.fallback_rows, ir.stats.replayed_rows) == (holes, BATCH * POSITIONS - holes)
        assert torch.equal(chosen[0, :holes], live[0, :holes]), "-1 rows take the live choice"
        picked = torch.zeros(BATCH, POSITIONS, POSITIONS + 1, dtype=torch.bool, device="cuda")
        picked.scatter_(-1, chosen.long(), True)
        wanted = torch.zeros_like(picked).scatter_(-1, forced[:, :, 0].long() % (POSITIONS + 1), True)
        wanted[..., POSITIONS] = False  # -1 slots
        assert torch.equal(picked[0, holes:, :POSITIONS], wanted[0, holes:, :POSITIONS])
        assert torch.equal(picked[1, :, :POSITIONS], wanted[1, :, :POSITIONS])
