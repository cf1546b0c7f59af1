"""The row-index column through AReaL 1.0.4's own batching functions, the contract reader and the token check.

AReaL's `_prepare_mb_list` steps are run here as AReaL runs them (areal.utils.data: concat_padded_tensors,
split_padded_tensor_dict_into_mb_list, pack_tensor_dict, pad_mb_list, unsqueeze_mb_list); the truth is the
trajectory each packed sequence's tokens belong to.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    ExpertIdRangeError,
    TokenMismatchError,
    TopKMismatchError,
)
from routereplay.integrations.areal.packed_layout import (
    ROW_KEY,
    RouteTable,
    attended_lengths,
    check_tokens,
    read_columns,
    ulysses_slice,
)
from routereplay.integrations.verl import RouteGeometry
from tests.integrations.areal.actor_case import (
    MOE_LAYERS,
    NUM_EXPERTS,
    ROUTES_KEY,
    TOKENS_KEY,
    TOP_K,
    episodes,
    random_routes,
    with_routes,
)

GEOMETRY = RouteGeometry(num_experts=NUM_EXPERTS, num_layers=3, top_k=TOP_K, moe_layers=MOE_LAYERS)
LENGTHS = ((5, 4), (3, 6), (7, 1), (2, 3), (6, 6), (1, 2))


def areal_micro_batches(batch: dict[str, Any], spec: dict[str, Any], pad_to_maximum: bool) -> Any:
    """AReaL's `FSDPEngine._prepare_mb_list` data steps for an LLM batch."""
    from areal.api.cli_args import MicroBatchSpec
    from areal.utils.data import (
        amend_position_ids,
        pack_tensor_dict,
        pad_mb_list,
        split_padded_tensor_dict_into_mb_list,
        unsqueeze_mb_list,
    )

    mb_list = split_padded_tensor_dict_into_mb_list(amend_position_ids(dict(batch)), MicroBatchSpec(**spec))
    mb_list.mbs = [pack_tensor_dict(mb) for mb in mb_list.mbs]
    return unsqueeze_mb_list(pad_mb_list(mb_list, pad_value=0.0, pad_to_maximum=pad_to_maximum))


@pytest.mark.areal
def test_areal_splits_the_row_column_with_input_ids_but_not_the_contract_routes_column() -> None:
    from areal.utils.data import concat_padded_tensors

    data = with_routes(episodes(lengths=LENGTHS), random_routes(episodes(lengths=LENGTHS)))
    batch = concat_padded_tensors(data)
    table = RouteTable(len(MOE_LAYERS), TOP_K)
    batch[ROW_KEY] = table.add(batch["input_ids"], attended_lengths(batch, "batch"), None)
    mb_list = areal_micro_batches(batch, {"n_mbs": 2}, False)
    for mb, padded in zip(mb_list.mbs, mb_list.padded_mbs, strict=True):
        assert mb[ROUTES_KEY].shape[0] == len(LENGTHS)  # the whole batch's routes in every micro-batch
        assert padded[ROW_KEY].shape == padded["input_ids"].shape  # packed and padded with input_ids


@pytest.mark.areal
@pytest.mark.parametrize(
    ("spec", "pad_to_maximum"),
    [({"n_mbs": 1}, False), ({"n_mbs": 3}, False), ({"n_mbs": 1, "max_tokens_per_mb": 24}, True)],
    ids=["one", "three", "pad_to_maximum"],
)
def test_every_packed_position_gets_its_own_trajectorys_route(spec: dict[str, Any], pad_to_maximum: bool) -> None:
    from areal.utils.data import concat_padded_tensors

    batch_list = episodes(lengths=LENGTHS)
    routes = random_routes(batch_list)
    batch = concat_padded_tensors(batch_list)
    table = RouteTable(len(MOE_LAYERS), TOP_K)
    lengths_B = attended_lengths(batch, "batch")
    padded_BSMK = torch.full((len(LENGTHS), batch["input_ids"].shape[1], len(MOE_LAYERS), TOP_K), -1)
    for b, rows in enumerate(routes):
        padded_BSMK[b, : rows.shape[0]] = rows
    batch[ROW_KEY] = table.add(batch["input_ids"], lengths_B, padded_BSMK)
    tokens = [e["input_ids"][0].to(torch.int64) for e in batch_list]
    seen = set()
    for padded in areal_micro_batches(batch, spec, pad_to_maximum).padded_mbs:
        row_1T, ids_1T = padded[ROW_KEY], padded["input_ids"]
        table.check_fed(row_1T, ids_1T, "test")
        routes_1TMK = table.model_routes(row_1T)
        cu = padded["cu_seqlens"].tolist()
        for start, stop in itertools.pairwise(cu):
            segment = ids_1T[0, start:stop].to(torch.int64)
            match = [i for i, t in enumerate(tokens) if torch.equal(t, segment)]
            if not match:  # AReaL's padding sequence: no rows, the live router
                assert bool((row_1T[0, start:stop] == 0).all()) and bool((routes_1TMK[0, start:stop] < 0).all())
                continue
            seen.add(match[0])
            assert torch.equal(routes_1TMK[0, start:stop], routes[match[0]])
    assert seen == set(range(len(LENGTHS)))


def test_check_fed_names_a_position_areal_fed_another_token() -> None:
    table = RouteTable(len(MOE_LAYERS), TOP_K)
    ids = torch.tensor([[7, 8, 9]])
    row = table.add(ids, torch.tensor([3]), None)
    with pytest.raises(TokenMismatchError, match=r"model input position \(0, 1\) holds token 5 .* placed token 8"):
        table.check_fed(row, torch.tensor([[7, 5, 9]]), "test")


@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_ulysses_slices_tile_the_padded_column(sp_size: int) -> None:
    column = torch.arange(1, 12).unsqueeze(0)  # T = 11: padded to a multiple of sp_size
    parts = [ulysses_slice(column, sp_size, r, fill=0) for r in range(sp_size)]
    assert len({p.shape for p in parts}) == 1
    joined = torch.cat(parts, dim=1)
    assert torch.equal(joined[:, :11], column) and bool((joined[:, 11:] == 0).all())
    routes = torch.arange(11 * 4).reshape(1, 11, 2, 2)
    assert torch.equal(
        torch.cat([ulysses_slice(routes, sp_size, r, fill=-1) for r in range(sp_size)], 1)[:, :11], routes
    )


def test_token_check_names_trajectory_and_position() -> None:
    ids = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 0]])
    lengths = torch.tensor([4, 3])
    check_tokens(torch.tensor([[4, 5, 6, -1], [8, 9, -1, -1]]), ids, lengths, "batch")
    with pytest.raises(
        TokenMismatchError, match="row 1, position 0: the route row was routed for token 9 .*rows shifted by one"
    ):
        check_tokens(torch.tensor([[4, 5, 6, -1], [9, 10, -1, 0]]), ids, lengths, "batch")


@pytest.mark.areal
def test_reader_accepts_areals_padded_rows_and_refuses_bad_geometry() -> None:
    from areal.utils.data import concat_padded_tensors

    data = with_routes(episodes(), random_routes(episodes()))
    batch = concat_padded_tensors(data)  # rows past each trajectory's length are AReaL's 0 padding: ignored
    lengths = attended_lengths(batch, "batch")
    routes, tokens = read_columns(batch, GEOMETRY, "batch", lengths_B=lengths, tokens_required=True)
    assert routes.shape[:2] == batch["input_ids"].shape and tokens is not None
    short = {**batch, ROUTES_KEY: batch[ROUTES_KEY][:, :3]}
    with pytest.raises(BatchGeometryError, match=r"expected \[4, >= 9, M, K\]"):
        read_columns(short, GEOMETRY, "batch", lengths_B=lengths, tokens_required=True)
    with pytest.raises(TopKMismatchError, match="top-k 1, the model routes 2"):
        read_columns({**batch, ROUTES_KEY: batch[ROUTES_KEY][..., :1]}, GEOMETRY, "b", lengths_B=lengths,
                     tokens_required=True)  # fmt: skip
    with pytest.raises(BatchFieldError, match=f"'{TOKENS_KEY}' is missing"):
        read_columns({k: v for k, v in batch.items() if k != TOKENS_KEY}, GEOMETRY, "b", lengths_B=lengths,
                     tokens_required=True)  # fmt: skip


def test_left_padded_batches_are_refused() -> None:
    batch = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])}
    with pytest.raises(BatchFieldError, match="row 0: attention_mask is not right-padded"):
        attended_lengths(batch, "batch")


@pytest.mark.areal
def test_reader_reads_only_attended_rows_of_a_routes_column_longer_than_the_tokens() -> None:
    """After AReaL's compute_advantages the routes keep the padded length (zero rows past it) while input_ids and
    the token column are trimmed: the reader reads the attended rows through the contract's reader only."""
    from areal.utils.data import concat_padded_tensors

    batch = concat_padded_tensors(with_routes(episodes(), random_routes(episodes())))
    lengths = attended_lengths(batch, "batch")
    routes = batch[ROUTES_KEY]
    longer = torch.cat([routes, torch.zeros(routes.shape[0], 3, *routes.shape[2:], dtype=routes.dtype)], dim=1)
    read, tokens = read_columns({**batch, ROUTES_KEY: longer}, GEOMETRY, "b", lengths_B=lengths, tokens_required=True)
    assert read.shape[1] == batch["input_ids"].shape[1] + 3 and tokens is not None
    spoilt = longer.clone()
    spoilt[1, 2, 0, 0] = NUM_EXPERTS
    with pytest.raises(ExpertIdRangeError, match="b row 1.*expert id 16 is outside"):
        read_columns({**batch, ROUTES_KEY: spoilt}, GEOMETRY, "b", lengths_B=lengths, tokens_required=True)
