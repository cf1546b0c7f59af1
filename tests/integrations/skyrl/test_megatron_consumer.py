"""SkyRL's own Megatron R3 consumer and routereplay read one batch's `rollout_expert_indices` alike.

SkyRL 0.4.0's Megatron worker hands each micro-batch's packed routes to `replay_utils.
setup_per_microbatch_replay_forward`, which aligns them to Megatron's token layout
(`build_token_metadata_layout`, `align_packed_token_metadata`), maps captured layers to the model's
`RouterReplay` instances (dense-first: by the layer number `patch_topk_router_layer_number` stores) and
installs one (T, K) target per router (`RouterReplay.set_replay_data`). Here it runs on megatron-core 0.16
(CPU, one gloo rank) against a dense-first Megatron `TransformerBlock` built with `moe_enable_routing_replay`,
and its installed targets are compared with what routereplay's trainer side reads from the same batch
(`routes_of_packed`, packed like SkyRL's `remove_microbatch_padding`).

They agree on every captured token. They differ, by name, on tokens with no captured route
(`router_padding_mask` True: each trajectory's final sampled token here): SkyRL's Megatron path forces the
dummy experts 0..K-1 there (`replay_padding_row`; the mask only keeps them out of router accounting), while
routereplay gives -1 and the live router picks. `attach_megatron` then replays routereplay's targets through
Megatron's own routing: the captured rows exactly, the others live and counted.

Legend: B = trajectories, S = padded positions, N = attended tokens (packed), P = payload layers (all 4),
L = MoE layers (3), K = top-k, H = hidden size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

NUM_LAYERS, EXPERTS, TOP_K, HIDDEN = 4, 8, 2, 16
MOE_LAYERS = (1, 2, 3)
LENGTHS = ((4, 3), (2, 5), (6, 1))  # (prompt, response) tokens per trajectory

pytestmark = [pytest.mark.skyrl, pytest.mark.megatron]


def megatron_block() -> tuple[torch.nn.Module, object]:
    """The dense-first block of the verl tests, with SkyRL's switch on: each TopKRouter gets a RouterReplay."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import TransformerBlock
    from skyrl.backends.skyrl_train.utils.replay_utils import patch_topk_router_layer_number

    from tests.integrations.verl import fsdp_megatron as mega

    _, config = mega.megatron_block()
    config.moe_enable_routing_replay = True
    RouterReplay.clear_global_router_replay_instances()
    patch_topk_router_layer_number()  # what SkyRL's Megatron worker does before building its model
    torch.manual_seed(0)
    return TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)), config


def skyrl_batch() -> tuple[torch.Tensor, torch.Tensor, object, torch.Tensor, list[np.ndarray]]:
    """SkyRL's preprocessing of 3 trajectories: routes for all but each final token, every layer (dense 0 zeros)."""
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors, make_router_padding_mask

    generator = np.random.default_rng(3)
    prompts = [generator.integers(4, 50, p).tolist() for p, _ in LENGTHS]
    responses = [generator.integers(4, 50, r).tolist() for _, r in LENGTHS]
    routes = []
    for p, r in LENGTHS:
        rows = np.zeros((p + r - 1, NUM_LAYERS, TOP_K), dtype=np.uint8)
        for layer in MOE_LAYERS:
            rows[:, layer] = np.argsort(generator.random((p + r - 1, EXPERTS)), axis=-1)[:, :TOP_K]
        routes.append(rows)
    rewards = [[0.0] * len(r) for r in responses]
    masks = [[1] * len(r) for r in responses]
    sequences, attention_mask, _, _, _, _, packed, _ = convert_prompts_responses_to_batch_tensors(
        0, prompts, responses, rewards, masks, None, routes, None
    )
    padding_mask = make_router_padding_mask(attention_mask, [len(r) for r in routes])
    return sequences, attention_mask, packed, padding_mask, routes


def skyrl_targets(block: torch.nn.Module, config: object, packed: object, padding_mask: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(N, L, K): the per-router targets SkyRL's Megatron consumer installs for a packed micro-batch."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import build_token_metadata_layout
    from skyrl.backends.skyrl_train.utils.replay_utils import clear_router_replay, setup_per_microbatch_replay_forward

    layout = build_token_metadata_layout(attention_mask, torch.device("cpu"), packed=True, fp8_enabled=False)
    kwargs = setup_per_microbatch_replay_forward(
        packed, padding_mask, attention_mask, block, config, layout, remove_microbatch_padding=True
    )
    try:
        assert torch.equal(kwargs["padding_mask"][0], padding_mask[attention_mask.bool()])  # packed like the routes
        return torch.stack([r.target_topk_idx for r in RouterReplay.global_router_replay_instances], dim=1)
    finally:
        clear_router_replay()


def test_skyrls_megatron_consumer_and_routereplay_agree_on_captured_tokens_and_differ_by_name_elsewhere(
    world: None,
) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    import routereplay
    from routereplay.integrations.skyrl.micro_batch import ModelInputLayout
    from routereplay.integrations.skyrl.packed_routes import routes_of_packed
    from routereplay.integrations.verl import RouteGeometry

    parallel_state.initialize_model_parallel()
    try:
        block, config = megatron_block()
        sequences, attention_mask, packed, padding_mask, _ = skyrl_batch()
        skyrl_NLK = skyrl_targets(block, config, packed, padding_mask, attention_mask).to(torch.int64)

        geometry = RouteGeometry(num_experts=EXPERTS, num_layers=NUM_LAYERS, top_k=TOP_K, moe_layers=MOE_LAYERS)
        routes_BSLK = routes_of_packed(packed, attention_mask, geometry=geometry, router_padding_mask=padding_mask,
                                       sequences=sequences)  # fmt: skip
        layout = ModelInputLayout(attention_mask=attention_mask.bool(), remove_padding=True)
        ours_NLK = layout.place(routes_BSLK.to(torch.int64), fill=-1)[0]

        captured_N = ~padding_mask[attention_mask.bool()]
        assert int((~captured_N).sum()) == len(LENGTHS)  # each trajectory's final token
        assert torch.equal(skyrl_NLK[captured_N], ours_NLK[captured_N])
        # the named difference: SkyRL forces experts 0..K-1 where routereplay routes live
        assert (skyrl_NLK[~captured_N] == torch.arange(TOP_K)).all()
        assert (ours_NLK[~captured_N] == -1).all()

        replayer = routereplay.attach_megatron(block)
        x_NH = torch.randn(ours_NLK.shape[0], HIDDEN, generator=torch.Generator().manual_seed(0))
        routers = [m for m in block.modules() if type(m).__name__ == "TopKRouter"]
        with replayer.replay([ours_NLK]):
            maps = [router.routing(x_NH @ router.weight.t())[1] for router in routers]
        for i, routing_map in enumerate(maps):
            for n in torch.nonzero(captured_N).flatten().tolist():
                assert set(routing_map[n].nonzero().flatten().tolist()) == set(ours_NLK[n, i].tolist())
        assert replayer.stats.fallback_rows == len(LENGTHS) * len(MOE_LAYERS)  # the final tokens, live
        replayer.detach()
    finally:
        parallel_state.destroy_model_parallel()
