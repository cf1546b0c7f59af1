"""Layout invariants (packed == padded, 1 == N micro-batches) and the explicit runtime policies:
DeepSeek-V2 group-limited replay, jitter, kernel bypass detection, hash routers left natural."""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import KernelBypassError
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf


def _block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """(1, 1, S, S) additive mask for one packed row: causal inside each sequence, -inf across."""
    segment = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    allowed = (segment[:, None] == segment[None, :]) & torch.tril(
        torch.ones(len(segment), len(segment), dtype=torch.bool)
    )
    mask = torch.zeros(1, 1, len(segment), len(segment))
    mask[0, 0][~allowed] = float("-inf")
    return mask


def test_packed_equals_padded() -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3()
    replayer = attach(model)
    generator = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, 128, (6,), generator=generator), torch.randint(0, 128, (4,), generator=generator)
    padded = torch.zeros(2, 6, dtype=torch.long)
    padded[0], padded[1, :4] = first, second
    mask = torch.zeros(2, 6, dtype=torch.long)
    mask[0], mask[1, :4] = 1, 1
    with replayer.record() as rec_padded:
        logits_padded = model(input_ids=padded, attention_mask=mask).logits
    packed = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(6), torch.arange(4)])[None]
    block = _block_causal_mask([6, 4])
    with replayer.record() as rec_packed:
        logits_packed = model(input_ids=packed, position_ids=positions, attention_mask=block).logits
    routes_padded, routes_packed = rec_padded.routes, rec_packed.routes
    assert torch.equal(routes_packed[0, :6], routes_padded[0]) and torch.equal(
        routes_packed[0, 6:], routes_padded[1, :4]
    )
    # replaying the padded batch's routes in packed layout reproduces the packed logits exactly
    moved = torch.cat([routes_padded[0], routes_padded[1, :4]])[None]
    with replayer.replay(moved):
        assert torch.equal(model(input_ids=packed, position_ids=positions, attention_mask=block).logits, logits_packed)
    assert torch.allclose(logits_packed[0, 6:], logits_padded[1, :4], atol=1e-5)


def test_one_batch_equals_micro_batches() -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3()
    replayer = attach(model)
    ids = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(4))
    forced = random_routes(4, 9, 3, 2, 8, seed=9)
    with replayer.replay(forced):
        whole = model(input_ids=ids).logits
    parts = []
    for half in (slice(0, 2), slice(2, 4)):
        with replayer.replay(forced[half]):
            parts.append(model(input_ids=ids[half]).logits)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6, rtol=0)
    with replayer.record() as rec_whole:
        model(input_ids=ids)
    recorded = []
    for half in (slice(0, 2), slice(2, 4)):
        with replayer.record() as rec:
            model(input_ids=ids[half])
        recorded.append(rec.routes)
    assert torch.equal(torch.cat(recorded), rec_whole.routes)


def test_deepseek_v2_group_limited_replay_keeps_weights() -> None:
    import transformers

    from routereplay.runtime import attach

    config = transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
        topk_method="group_limited_greedy", first_k_dense_replace=0, n_shared_experts=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    replayer = attach(model)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    forced = torch.tensor([[0, 7]]).expand(8, 2).reshape(1, 8, 1, 2).expand(1, 8, 2, 2).contiguous()  # two groups
    weights = []
    gate = model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda module, args, output: weights.append(output[1].detach()))
    with replayer.replay(forced):
        model(input_ids=ids)
    handle.remove()
    assert gate.topk_method == "group_limited_greedy", "the override is restored after the call"
    assert (weights[0] > 0).all(), "forced experts outside the live top group must keep their weights"


def test_jitter_policy() -> None:
    import transformers

    from routereplay.runtime import attach

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.5,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    replayer = attach(model, jitter="off")
    with replayer.record() as rec:
        reference = model(input_ids=ids).logits
    model.train()
    with replayer.replay(rec.routes):
        assert torch.equal(model(input_ids=ids).logits, reference), "jitter off: training replay == eval replay"
    assert model.model.layers[0].mlp.jitter_noise == 0.5, "restored when the context exits"
    replayer.detach()
    replayer = attach(model)  # jitter="model": the model's own noise perturbs the recomputed weights
    with replayer.replay(rec.routes):
        assert not torch.equal(model(input_ids=ids).logits, reference)


def test_router_bypassed_by_a_kernel_is_an_error() -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3()
    gate = model.model.layers[1].mlp.gate

    def fused_forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        indices = logits.argsort(dim=-1, descending=True)[:, : gate.top_k]  # no torch.topk to intercept
        return logits, logits.softmax(-1).gather(1, indices), indices

    gate.forward = fused_forward  # what a hub kernel does to a router
    replayer = attach(model)
    with pytest.raises(KernelBypassError, match="layer 1 .* ran without a visible top-2 over 8 choices"):
        with replayer.replay(random_routes(1, 5, 3, 2, 8)):
            model(input_ids=torch.zeros(1, 5, dtype=torch.long))
    replayer.detach()

    class Kernelized(torch.nn.Module):  # a model loaded with use_kernels=True
        use_kernels = True

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

    with pytest.raises(KernelBypassError, match="use_kernels is on"):
        attach(Kernelized(model))


def test_hash_routers_stay_natural() -> None:
    from routereplay.runtime import attach
    from routereplay.testing.hf import models as hf_tiny

    model = hf_tiny.tiny_model("deepseek_v4")
    hashed = [type(m).__name__ for m in model.modules() if type(m).__name__ == "DeepseekV4HashRouter"]
    replayer = attach(model)
    natural = [r for r in replayer.refused if r.natural_ok]
    assert len(natural) == len(hashed) >= 1
    assert all("tid2eid" in r.reason for r in natural)
    assert replayer.layers and all(b.family == "DeepseekV4TopKRouter" for b in replayer.bindings)
