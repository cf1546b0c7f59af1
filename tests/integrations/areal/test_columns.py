"""The episode-dict contract: `episode_columns` builds the two columns, `check_columns` reads them back.
Legend: S positions, M MoE layers, K top-k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import (
    BatchFieldError,
    DtypeError,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerCountError,
    PartialRowError,
    RouteReplayError,
    TokenMismatchError,
    TopKMismatchError,
)
from routereplay.integrations.areal import ROUTES_KEY, TOKENS_KEY, check_columns, episode_columns, route_dtype
from routereplay.trace.route_trace import RouteTrace

E, M, K = 16, 2, 2


def trace(tokens: list[int], routed: int, seed: int = 0) -> RouteTrace:
    """Rows for the first `routed` positions (distinct ids per row), naming their tokens."""
    rng = np.random.default_rng(seed)
    experts_TMK = np.stack([[rng.choice(E, K, replace=False) for _ in range(M)] for _ in range(routed)])
    return RouteTrace(experts_TMK, E, layers=(1, 2), token_ids=tokens[:routed])


def columns(length: int = 6) -> tuple[dict[str, torch.Tensor], list[int]]:
    tokens = list(range(40, 40 + length))
    return episode_columns(trace(tokens, length - 1), torch.tensor(tokens, dtype=torch.int32)), tokens


def test_episode_columns_form() -> None:
    built, tokens = columns()
    routes, ids = built[ROUTES_KEY], built[TOKENS_KEY]
    assert routes.shape == (1, 6, M, K) and routes.dtype == torch.int16
    assert ids.shape == (1, 6) and ids.dtype == torch.int32
    assert (routes[0, -1] == -1).all() and ids[0].tolist() == [*tokens[:-1], -1]
    assert check_columns(routes, ids, num_experts=E, num_moe_layers=M, top_k=K, input_ids=torch.tensor([tokens])) == 5


def test_route_dtype_is_int16_while_ids_fit() -> None:
    assert route_dtype(128) == torch.int16 and route_dtype(32767) == torch.int16 and route_dtype(32768) == torch.int32


def test_episode_columns_refuse_other_tokens() -> None:
    tokens = [40, 41, 42, 43]
    with pytest.raises(TokenMismatchError, match="position 2"):
        episode_columns(trace(tokens, 3), torch.tensor([40, 41, 99, 43]))
    with pytest.raises(BatchFieldError, match="longer sequence"):
        episode_columns(trace(tokens, 3), torch.tensor([40, 41]))


def test_padding_is_not_read() -> None:
    """AReaL's concat_padded_tensors pads routes with 0 (a row naming expert 0 twice): `valid` skips it."""
    built, _tokens = columns(4)
    routes = torch.cat([built[ROUTES_KEY], torch.zeros(1, 3, M, K, dtype=torch.int16)], dim=1)
    ids = torch.cat([built[TOKENS_KEY], torch.zeros(1, 3, dtype=torch.int32)], dim=1)
    valid = torch.tensor([[True] * 4 + [False] * 3])
    assert check_columns(routes, ids, num_experts=E, num_moe_layers=M, top_k=K, valid=valid) == 3
    with pytest.raises(DuplicateExpertError):
        check_columns(routes, ids, num_experts=E, num_moe_layers=M, top_k=K)


def spoil(change: Callable[[torch.Tensor, torch.Tensor], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    built, _ = columns()
    routes, ids = built[ROUTES_KEY].clone(), built[TOKENS_KEY].clone()
    spoilt = change(routes, ids)
    return spoilt if isinstance(spoilt, tuple) else (routes, ids)


def set_(tensor: torch.Tensor, index: tuple[int, ...], value: int) -> None:
    tensor[index] = value


HOSTILE: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], Any], type[RouteReplayError], str]] = {
    "id >= E": (lambda r, t: set_(r, (0, 1, 0, 0), E), ExpertIdRangeError, "expert id 16"),
    "negative id": (lambda r, t: set_(r, (0, 1, 1, 1), -2), ExpertIdRangeError, "expert id -2"),
    "partial row": (lambda r, t: set_(r, (0, 2, 1), -1), PartialRowError, "mix -1"),
    "repeated id": (lambda r, t: r[0, 0, 0].copy_(r[0, 0, 0, :1].expand(K)), DuplicateExpertError, "twice"),
    "token -1 on a routed row": (lambda r, t: set_(t, (0, 1), -1), BatchFieldError, "exactly on the unrouted"),
    "layer count": (lambda r, t: (r[..., :1, :], t), LayerCountError, "MoE layers"),
    "top-k": (lambda r, t: (r[..., :1], t), TopKMismatchError, "top-k 1, the model routes 2"),
    "float routes": (lambda r, t: (r.float(), t), DtypeError, "int16"),
    "unsigned routes": (lambda r, t: (r.to(torch.uint8), t), DtypeError, "signed"),
    "shape": (lambda r, t: (r, t[:, :-1]), BatchFieldError, "does not sit"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_columns_are_named(kind: str) -> None:
    change, error, match = HOSTILE[kind]
    routes, ids = spoil(change)
    with pytest.raises(error, match=match):
        check_columns(routes, ids, num_experts=E, num_moe_layers=M, top_k=K)


def test_token_check_against_input_ids() -> None:
    built, tokens = columns()
    moved = torch.tensor([[tokens[0], *tokens[:-1]]])  # every token one place right: rows off their tokens
    with pytest.raises(TokenMismatchError, match="row 0, position 1: the route row was routed for token"):
        check_columns(built[ROUTES_KEY], built[TOKENS_KEY], num_experts=E, num_moe_layers=M, top_k=K, input_ids=moved)


def test_routes_alone_are_read_without_a_token_column() -> None:
    """A trainer opted out of the token check may get no token column: the rows are still read."""
    built, _ = columns()
    assert check_columns(built[ROUTES_KEY], None, num_experts=E, num_moe_layers=M, top_k=K) == 5
    routes = built[ROUTES_KEY].clone()
    routes[0, 2, 1, 0] = E
    with pytest.raises(ExpertIdRangeError, match="row 0.*expert id 16 is outside"):
        check_columns(routes, None, num_experts=E, num_moe_layers=M, top_k=K)


def test_a_trajectory_shorter_than_top_k_cut_by_areal_is_named() -> None:
    """AReaL's `_unpad_splits` trims a one-token trajectory's routes `[1, S, M, K]` on their LAST axis (K) to 1:
    refused, the message naming AReaL's trim and the way out."""
    tokens = torch.tensor([[-1]], dtype=torch.int32)  # one token: the episode's last, never routed
    cut = torch.full((1, 1, M, K), -1, dtype=torch.int16)[..., :1]  # what compute_advantages hands back
    with pytest.raises(
        TopKMismatchError, match="top-k 1, the model routes 2; AReaL's compute_advantages.*shorter than"
    ):
        check_columns(cut, tokens, num_experts=E, num_moe_layers=M, top_k=K)
    with pytest.raises(TopKMismatchError, match=r"top-k 3, the model routes 2$"):
        check_columns(torch.zeros(1, 1, M, 3, dtype=torch.int16), tokens, num_experts=E, num_moe_layers=M, top_k=K)
