"""What the single-process reference and every rank share: the tiny model, its batch, its loss, its grads.

The parent test builds the model once, saves its weights with the batch and the forced routes, and
the ranks load that file, so both sides start from the same bits; nothing here talks to other ranks.

Legend: B = batch rows, S = positions, L = MoE layers, K = top-k, E = experts, V = vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

MODEL_TYPE = "qwen3_moe"  # hf_tiny: 2 MoE layers, 8 experts, top-2, 4 query / 2 kv heads, fp32
IGNORE = -100  # label of a position without a next token (the last one, padding)


def tiny_moe(state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The tiny Qwen3-MoE in train mode (attention dropout is 0), optionally with given weights."""
    from routereplay.testing.hf import models as hf_tiny

    model = hf_tiny.tiny_model(MODEL_TYPE, seed=0).train()
    if state is not None:
        model.load_state_dict(state)
    return model


def token_ids(batch: int, positions: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, positions), generator=torch.Generator().manual_seed(seed))


def forced_routes(batch: int, positions: int, layers: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """(B, S, L, K) random valid routes (K distinct experts per row): almost never the natural ones."""
    keys = torch.rand(batch * positions * layers, experts, generator=torch.Generator().manual_seed(seed))
    return keys.argsort(dim=1)[:, :top_k].reshape(batch, positions, layers, top_k)


def next_token_labels(ids_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) label of each position: the next token, IGNORE at the last position."""
    labels_BS = torch.full_like(ids_BS, IGNORE)
    labels_BS[:, :-1] = ids_BS[:, 1:]
    return labels_BS


def summed_token_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over labelled positions (divide by the global label count for the mean)."""
    return nn.functional.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(),
        labels_BS.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by name (an FSDP2 DTensor grad is gathered: a collective)."""
    out = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        grad = param.grad
        full = getattr(grad, "full_tensor", None)
        out[name] = (full() if full is not None else grad).detach().clone()
    return out


def relative_change(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||grads - reference|| / ||reference|| over all parameters together: a negative control's distance."""
    diff = sum(float((grads[name] - ref).pow(2).sum()) for name, ref in reference.items())
    norm = sum(float(ref.pow(2).sum()) for ref in reference.values())
    return (diff / norm) ** 0.5


def save(path: Path, payload: dict[str, Any]) -> None:
    torch.save(payload, path)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)
