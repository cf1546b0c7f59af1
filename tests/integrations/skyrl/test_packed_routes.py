"""`routes_of_packed` refuses by name, before its output is allocated, every field that is not what SkyRL's collate
writes (issue 38 item 9: these raised torch's own errors): a route dtype SkyRL never packs (uint16 / 32 / 64,
int8), a sparse or meta tensor in any field, and digests that are not one 16-byte digest per trajectory.

The batch is SkyRL's own collate (`convert_prompts_responses_to_batch_tensors`, `make_router_padding_mask`) of
two trajectories. Legend: B trajectories, S padded positions, A all hidden layers, K top-k.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import BatchFieldError, DtypeError, TokenMismatchError
from routereplay.integrations.skyrl import RouteGeometry, routes_of_packed
from routereplay.integrations.skyrl.digest import DIGEST_BYTES, digest_column, generator_digests

pytestmark = pytest.mark.skyrl

GEOMETRY = RouteGeometry(num_experts=16, num_layers=3, top_k=2, moe_layers=(1, 2))
PROMPTS, RESPONSES = ([1, 2, 3], [7, 8]), ([4, 5, 6], [9, 10, 11])


def routes(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out_TAK = np.zeros((rows, 3, 2), dtype=np.uint8)
    for layer in (1, 2):
        out_TAK[:, layer] = np.argsort(rng.random((rows, 16)), axis=1)[:, :2]
    return out_TAK


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    """SkyRL's collate of two trajectories (the final token of each uncaptured), and their digest column."""
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors, make_router_padding_mask

    arrays = [routes(len(p) + len(r) - 1, seed) for seed, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))]
    out = convert_prompts_responses_to_batch_tensors(
        0, list(PROMPTS), list(RESPONSES), [[0.0] * len(r) for r in RESPONSES], [[1] * len(r) for r in RESPONSES],
        rollout_expert_indices=arrays,
    )  # fmt: skip
    sequences, mask, packed = out[0], out[1], out[6]
    output = {"prompt_token_ids": list(PROMPTS), "response_ids": list(RESPONSES), "rollout_expert_indices": arrays}
    return {
        "packed": packed, "attention_mask": mask, "sequences": sequences,
        "router_padding_mask": make_router_padding_mask(mask, [len(a) for a in arrays]),
        "digests": digest_column(generator_digests(output) or []),
    }  # fmt: skip


def read(b: dict[str, Any], **changes: Any) -> torch.Tensor:
    fields = {key: b[key] for key in ("attention_mask", "router_padding_mask", "sequences", "digests")}
    fields.update(changes)
    packed = fields.pop("packed", b["packed"])
    return routes_of_packed(packed, fields.pop("attention_mask"), geometry=GEOMETRY, **fields)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every `torch.full` call: the reader allocates its (B, S, M, K) output with it, last."""
    seen: list[tuple[Any, ...]] = []
    full = torch.full

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(args)
        return full(*args, **kwargs)

    monkeypatch.setattr(torch, "full", counted)
    return seen


def test_the_batch_reads_back_with_its_digests(batch: dict[str, Any]) -> None:
    routes_BSMK = read(batch)
    assert routes_BSMK.shape == (2, 6, 2, 2)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.int8])
def test_a_route_dtype_skyrl_never_packs_is_a_dtype_error(
    batch: dict[str, Any], allocations: list[Any], dtype: torch.dtype
) -> None:
    packed = SimpleNamespace(values=batch["packed"].values.to(dtype), cu_seqlens=batch["packed"].cu_seqlens)
    with pytest.raises(DtypeError, match=f"values is {dtype}; SkyRL packs expert ids as one of uint8, int16, int32"):
        read(batch, packed=packed)
    assert allocations == []


def sparse_or_meta(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    return tensor.to_sparse() if kind == "sparse" else tensor.to("meta")


@pytest.mark.parametrize("kind", ["sparse", "meta"])
@pytest.mark.parametrize(
    "field", ["values", "cu_seqlens", "attention_mask", "router_padding_mask", "sequences", "digests"]
)
def test_a_sparse_or_meta_field_is_a_batch_field_error(
    batch: dict[str, Any], allocations: list[Any], field: str, kind: str
) -> None:
    """SkyRL's own `PackedTensor` takes sparse values (and refuses meta ones itself: the reader reads any object with
    `values` and `cu_seqlens`, as SkyRL's Megatron consumer does)."""
    changes: dict[str, Any] = {}
    if field in ("values", "cu_seqlens"):
        packed = batch["packed"]
        parts = {"values": packed.values, "cu_seqlens": packed.cu_seqlens}
        parts[field] = sparse_or_meta(parts[field], kind)
        changes["packed"] = SimpleNamespace(**parts)
    else:
        changes[field] = sparse_or_meta(batch[field], kind)
    where = r"the meta device \(no data\)" if kind == "meta" else "layout torch.sparse_coo"
    match = {
        "values": rf"rollout_expert_indices.values \(a SkyRL PackedTensor\) is a tensor on {where}",
        "cu_seqlens": f"rollout_expert_indices.cu_seqlens is a tensor on {where}",
        "digests": "the routereplay_route_digests column is a torch.s",
    }.get(field, f"{field} is a tensor on {where}")
    with pytest.raises(BatchFieldError, match=match):
        read(batch, **changes)
    assert allocations == []


@pytest.mark.parametrize(
    ("digests", "match"),
    [
        (5, "digests must be a sequence of 16-byte digests .* got int"),
        ("ab", "digests must be a sequence of 16-byte digests .* got str"),
        (b"x" * 32, "digests must be a sequence of 16-byte digests .* got bytes"),
        ([5, 6], r"digests: 2 entries of \['int'\] for a batch of 2"),
        ([b"x" * 16], r"digests: 1 entries of \['bytes'\] for a batch of 2"),
        ([b"x" * 15, b"y" * 16], r"digests: 2 entries of \['bytes'\] for a batch of 2"),
        (torch.zeros(2, DIGEST_BYTES), "column is a torch.strided torch.float32 tensor"),
        (torch.zeros(3, DIGEST_BYTES, dtype=torch.uint8), r"column has shape \(3, 16\) for a batch of 2"),
    ],
    ids=["int", "str", "bytes", "ints", "too-few", "short-digest", "float-column", "column-rows"],
)
def test_digests_that_are_not_one_16_byte_digest_per_trajectory_are_a_batch_field_error(
    batch: dict[str, Any], allocations: list[Any], digests: Any, match: str
) -> None:
    with pytest.raises(BatchFieldError, match=match):
        read(batch, digests=digests)
    assert allocations == []


def test_digests_without_sequences_or_with_float_sequences_are_refused(batch: dict[str, Any]) -> None:
    with pytest.raises(BatchFieldError, match="digests need the batch's sequences"):
        read(batch, sequences=None)
    with pytest.raises(BatchFieldError, match=r"sequences of shape \(2, 6\) \(torch.float32\)"):
        read(batch, sequences=batch["sequences"].float())


def test_rows_rotated_within_a_trajectory_are_a_token_mismatch(batch: dict[str, Any]) -> None:
    packed = batch["packed"]
    values = packed.values.clone()
    start, end = int(packed.cu_seqlens[1]), int(packed.cu_seqlens[2]) - 1  # trajectory 1's captured rows
    values[start:end] = values[start:end].roll(1, dims=0)
    with pytest.raises(TokenMismatchError, match="trajectory 1: its packed route rows and its tokens"):
        read(batch, packed=SimpleNamespace(values=values, cu_seqlens=packed.cu_seqlens))
