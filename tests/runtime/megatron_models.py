"""Real megatron-core models for the Megatron adapter's tests (0.16 and 0.19), built on CPU.

`TopKRouter.forward` cannot run on CPU (its gating moves the weights to CUDA), so tests drive
`router.routing(logits)`, where the top-k selection and every weight computation happen, with
logits from the router's own weight (`h @ router.weight.T`, what gating computes). Models are real
`TransformerBlock`s built from Megatron's GPT specs on a one-rank gloo world (dense-first: layer 0
dense, layers 1-3 MoE).

Legend: S = sequence, B = batch, H = hidden, N = S * B tokens, E = experts, L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

H, E, K, S, B = 16, 8, 2, 5, 2  # hidden, experts, top-k, sequence, batch: N = S * B = 10 tokens per micro-batch
N = S * B
MOE_LAYERS = (1, 2, 3)  # 0-based; layer 0 is dense


def one_rank_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo world with Megatron's parallel state, so real blocks can be built on CPU."""
    from megatron.core import parallel_state

    owned = not torch.distributed.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("gloo") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        torch.distributed.destroy_process_group()


def make_config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=32,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_router_load_balancing_type="none",
        moe_layer_freq=[0, 1, 1, 1],
        use_cpu_initialization=True,
    )
    # no CUDA graphs: 0.16 names the capture regions cuda_graph_scope, 0.19 cuda_graph_modules
    fields[graph_modules_field()] = []
    fields.update(overrides)
    return TransformerConfig(**fields)


def graph_modules_field() -> str:
    """The config field naming CUDA-graph capture regions in the installed megatron-core."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    return "cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"


def mtp_inner_layer(mtp_block: nn.Module, index: int = 0) -> nn.Module:
    """The transformer layer inside an MTP layer: 0.16 `transformer_layer`, 0.19 `mtp_model_layer`."""
    layer = mtp_block.layers[index]
    return layer.mtp_model_layer if hasattr(layer, "mtp_model_layer") else layer.transformer_layer


def build_block(config: Any = None, seed: int = 0) -> nn.Module:
    """A real dense-first TransformerBlock (Megatron's local GPT spec, no Transformer Engine)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = config or make_config()
    torch.manual_seed(seed)
    return TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0))


def standalone_router(config: Any, layer: int | None, router_class: type | None = None) -> nn.Module:
    """A TopKRouter (or `router_class`) numbered as MoELayer numbers it (1-based), or not at all."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    cls = router_class or TopKRouter
    router = cls(config, ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None))
    if layer is not None:
        router.set_layer_number(layer + 1)
    return router


def routers_of(model: nn.Module) -> dict[int, nn.Module]:
    """The model's routers by 0-based layer (Megatron's 1-based layer_number - 1), test-side."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number - 1: m for m in model.modules() if isinstance(m, TopKRouter)}


MIX = {layer: torch.randn(E, H, generator=torch.Generator().manual_seed(layer)) for layer in range(4)}


def run(routers: dict[int, nn.Module], x_SBH: torch.Tensor) -> tuple[torch.Tensor, dict[int, tuple[Any, Any]]]:
    """One micro-batch through the MoE layers in order: logits from the router weight, routing, mix."""
    h_SBH, outputs = x_SBH, {}
    for layer, router in sorted(routers.items()):
        logits_SBE = h_SBH @ router.weight.t()
        probs_NE, map_NE = router.routing(logits_SBE)
        outputs[layer] = (probs_NE, map_NE)
        h_SBH = h_SBH + (probs_NE @ MIX[layer]).view_as(h_SBH)
    return h_SBH, outputs


def hidden(seed: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


def random_routes(layers: int, seed: int, rows: int = N) -> torch.Tensor:
    """(rows, layers, K) distinct expert ids per row."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows * layers)]).view(rows, layers, K)


def chosen_sets(map_NE: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in map_NE]
