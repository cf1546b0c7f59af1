"""Modality routers: a layer whose tokens go to one of several routers by their modality.

Ernie-4.5-VL's MoE block (`Ernie4_5_VLMoeMoeBlock`) holds a text MoE and a vision MoE, each with its
own router, and hands each token to one of them by `moe_mm_token_type_ids` (0 = text, 1 or 2 =
vision): the text router sees only the text tokens (`hidden_states[~vision]`), the vision router only
the vision tokens, and with no vision token in the batch the text MoE takes every token and the
vision router does not run. A trace holds a column per router (`(layer, "mlp.text_moe.gate")`,
`(layer, "mlp.vision_moe.gate")`): the column of the router that ran for a token holds its route, the
other column -1 there.

`ModalityRows` is what a block's forward pre-hook computes for one call, before its routers run: the
tokens each router will see (a bool mask over the block's B * S tokens, or None for all of them).
Replay forces each router's rows only, so every token replays in the router that actually runs for
it; a route in a router's column for a token that router does not run for (a vision route on a text
token: the batch's modality ids are not the ones the routes were recorded with) is a
`ModalityMismatchError`, never dropped silently. Record scatters a router's choice back to the
block's tokens, -1 on the tokens it did not see.

The split costs host syncs (the model's own `moe_mm_token_type_ids.any()` is one): modality routers
are not on the sync-free path of `runtime/interception.py`.

Legend: T = tokens of the block call (B * S), K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from routereplay.enums import StrEnum
from routereplay.errors import ModalityMismatchError


class Modality(StrEnum):
    """Which tokens a modality router runs for."""

    TEXT = "text"  # token type 0, or every token when the batch holds no other type
    VISION = "vision"  # token type != 0 (image or video)


@dataclass(frozen=True, slots=True)
class ModalitySplit:
    """How a family's MoE block splits tokens between its routers: the token-type argument, and the child
    MoE of each modality (the block of the router)."""

    argument: str  # name of the forward argument holding the (B, S) token types
    position: int  # its position among the positional arguments (after hidden_states)
    children: tuple[tuple[str, Modality], ...]  # (child MoE attribute, modality)


# MoE block classes that split tokens by modality
MODALITY_BLOCKS = {
    "Ernie4_5_VLMoeMoeBlock": ModalitySplit(
        "moe_mm_token_type_ids", 1, (("text_moe", Modality.TEXT), ("vision_moe", Modality.VISION))
    ),
}


def token_types(split: ModalitySplit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The (B, S) token types a block call was given, or None (text only)."""
    value = kwargs.get(split.argument, args[split.position] if len(args) > split.position else None)
    return value if isinstance(value, torch.Tensor) else None


def rows_of(modality: Modality, types_BS: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """The tokens (a (T,) bool mask) a router of `modality` sees in a block call; None: all of them.

    Mirrors the block's own rule: with any non-text token, text takes type 0 and vision the rest;
    without one, text takes every token and vision none."""
    vision_T = None if types_BS is None else types_BS.reshape(-1).bool()
    if vision_T is None or not bool(vision_T.any()):  # host sync, as the model's own `.any()`
        return None if modality is Modality.TEXT else torch.zeros(tokens, dtype=torch.bool)
    return ~vision_T if modality is Modality.TEXT else vision_T


def checked_counts(
    forced_TK: torch.Tensor, rows_T: torch.Tensor | None, attended_T: np.ndarray | None, where: str, modality: Modality
) -> tuple[int, int]:
    """Replay, one host pass per block call: refuse forced routes on tokens this router does not see
    (`ModalityMismatchError`), and return its (replayed, fallback) rows (its tokens, attended ones only)."""
    routed_T = forced_TK[:, 0].cpu().numpy() >= 0
    seen_T = np.ones_like(routed_T) if rows_T is None else rows_T.cpu().numpy()
    stray = np.flatnonzero(routed_T & ~seen_T)
    if stray.size:
        raise ModalityMismatchError(
            f"{where}: routes for {stray.size} tokens (first at flat position {int(stray[0])}, b * S + s) that the "
            f"{modality} router does not run for (the batch's moe_mm_token_type_ids send them to another router); "
            "pass the token types the routes were recorded with, or -1 for the tokens of other modalities"
        )
    if attended_T is not None and attended_T.size == seen_T.size:
        seen_T = seen_T & attended_T
    return int(np.count_nonzero(seen_T & routed_T)), int(np.count_nonzero(seen_T & ~routed_T))


def scatter_rows(chosen_TK: torch.Tensor, rows_T: torch.Tensor | None) -> torch.Tensor:
    """A router's choice on its own tokens, put back on the block's tokens (-1 where it did not run)."""
    if rows_T is None:
        return chosen_TK
    full_TK = torch.full((rows_T.shape[0], chosen_TK.shape[1]), -1, dtype=chosen_TK.dtype, device=chosen_TK.device)
    full_TK[rows_T.to(chosen_TK.device)] = chosen_TK
    return full_TK


def take_rows(routes_TK: torch.Tensor, rows_T: torch.Tensor | None) -> torch.Tensor:
    """A block-wide (T, K) routes tensor cut to the tokens of one router."""
    return routes_TK if rows_T is None else routes_TK[rows_T.to(routes_TK.device)]


__all__ = [
    "MODALITY_BLOCKS",
    "Modality",
    "ModalitySplit",
    "checked_counts",
    "rows_of",
    "scatter_rows",
    "take_rows",
    "token_types",
]
