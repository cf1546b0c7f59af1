"""`ForcingBuffers`: the fixed-address forced ids and mask every wrapped router reads, filled step by step.

Each step's content must be exactly that step's rows (no row left over from an earlier step), at the same
addresses every step (a CUDA graph reads the addresses it captured). Here on CPU tensors; the copy path is
the same on a GPU but for pinned staging and the event (tests/engines/test_vllm_forcing_op.py, `gpu`).

Legend: T = token rows, N = forced rows, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay.engines.vllm.forcing import ForcingBuffers
from routereplay.errors import ForcedRoutesError

LAYERS = (1, 3, 4)


def expected(buffers: ForcingBuffers, rows_N: np.ndarray, experts_NLK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mask_TL = np.zeros((buffers.max_tokens, len(LAYERS)), dtype=bool)
    ids_TLK = np.zeros((buffers.max_tokens, len(LAYERS), buffers.top_k), dtype=np.int32)
    for row, experts_LK in zip(rows_N, experts_NLK, strict=True):
        for col, experts_K in enumerate(experts_LK):
            if experts_K[0] >= 0:
                mask_TL[row, col] = True
                ids_TLK[row, col] = experts_K
    return mask_TL, ids_TLK


def random_step(rng: np.random.Generator, max_tokens: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    rows_N = rng.choice(max_tokens, size=int(rng.integers(0, max_tokens + 1)), replace=False)
    experts_NLK = np.argsort(rng.random((len(rows_N), len(LAYERS), 16)), axis=-1)[:, :, :top_k]
    experts_NLK[rng.random((len(rows_N), len(LAYERS))) < 0.3] = -1  # some layers of some rows route live
    return rows_N, experts_NLK


def test_each_step_holds_exactly_its_rows_at_the_same_addresses() -> None:
    buffers = ForcingBuffers(max_tokens=12, moe_layers=LAYERS, top_k=2, device="cpu")
    addresses = (buffers.ids_TLK.data_ptr(), buffers.mask_TL.data_ptr())
    assert buffers.ids_TLK.dtype == torch.int32 and buffers.ids_TLK.shape == (12, 3, 2)
    assert buffers.mask_TL.dtype == torch.bool and buffers.mask_TL.shape == (12, 3)
    assert buffers.column == {1: 0, 3: 1, 4: 2}
    rng = np.random.default_rng(0)
    for _ in range(40):  # steps of every size, high rows then low rows, some with nothing forced
        rows_N, experts_NLK = random_step(rng, 12, 2)
        buffers.load(rows_N, experts_NLK)
        mask_TL, ids_TLK = expected(buffers, rows_N, experts_NLK)
        np.testing.assert_array_equal(buffers.mask_TL.numpy(), mask_TL)
        forced_TL = buffers.mask_TL.numpy()
        np.testing.assert_array_equal(buffers.ids_TLK.numpy()[forced_TL], ids_TLK[forced_TL])
        assert (buffers.ids_TLK.numpy() >= 0).all(), "unforced rows hold valid ids too (never read)"
        assert buffers.forced == bool(mask_TL.any())
        assert (buffers.ids_TLK.data_ptr(), buffers.mask_TL.data_ptr()) == addresses


def test_weights_are_kept_only_when_asked_for_at_a_fixed_address() -> None:
    assert ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=2, device="cpu").weights_TLK is None
    buffers = ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=2, device="cpu", capture_weights=True)
    assert buffers.weights_TLK is not None
    assert buffers.weights_TLK.dtype == torch.float32 and buffers.weights_TLK.shape == (4, 3, 2)
    address = buffers.weights_TLK.data_ptr()
    buffers.load(np.array([1]), np.tile([3, 5], (1, 3, 1)))
    buffers.clear()
    assert buffers.weights_TLK.data_ptr() == address


def test_clear_unforces_every_row_and_a_later_load_starts_clean() -> None:
    buffers = ForcingBuffers(max_tokens=8, moe_layers=LAYERS, top_k=2, device="cpu")
    buffers.load(np.array([7, 2]), np.tile([5, 6], (2, 3, 1)))
    assert buffers.forced and buffers.mask_TL.sum() == 6
    buffers.clear()
    assert not buffers.forced and not buffers.mask_TL.any()
    buffers.clear()  # already clear: still clear
    assert not buffers.mask_TL.any()
    buffers.load(np.array([0]), np.array([[[1, 2], [-1, -1], [3, 4]]]))
    assert buffers.mask_TL.nonzero().tolist() == [[0, 0], [0, 2]]
    buffers.load(np.array([], dtype=np.int64), np.zeros((0, 3, 2), dtype=np.int64))
    assert not buffers.forced and not buffers.mask_TL.any()


def test_a_step_whose_rows_are_all_minus_one_forces_nothing() -> None:
    buffers = ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=2, device="cpu")
    buffers.load(np.array([1, 3]), np.full((2, 3, 2), -1))
    assert not buffers.forced and not buffers.mask_TL.any()


@pytest.mark.parametrize(
    ("rows", "experts", "message"),
    [
        (np.array([0]), np.zeros((1, 2, 2), dtype=np.int64), r"do not fit.*\(N, 3, 2\)"),
        (np.array([[0]]), np.zeros((1, 3, 2), dtype=np.int64), r"do not fit"),
        (np.array([8]), np.zeros((1, 3, 2), dtype=np.int64), r"outside the step's \[0, 8\) rows"),
        (np.array([-1]), np.zeros((1, 3, 2), dtype=np.int64), r"outside the step's"),
        (np.array([2, 2]), np.zeros((2, 3, 2), dtype=np.int64), r"listed twice"),
        (np.array([0]), np.array([[[1, -1], [1, 2], [1, 2]]]), r"mixes -1 with expert ids"),
        (np.array([0]), np.full((1, 3, 2), -2), r"below -1"),
        (np.array([0.0]), np.zeros((1, 3, 2)), r"must be integers"),
        (np.array([0]), np.full((1, 3, 2), 16), r"expert id 16 is not below the model's 16 experts"),
        (np.array([], dtype=np.int64), np.zeros((0, 5, 9), dtype=np.int64), r"do not fit"),
        (np.array([5]), np.array([[[1, 2], [3, 3], [1, 2]]]), r"token row 5, MoE layer 3 names an expert twice"),
        (np.array([0]), np.zeros((1, 3, 2), dtype=np.int64), r"names an expert twice \(\[0, 0\]; 3 such"),
        (
            np.array([0]),
            np.array([[[1, 2], [3, 4], [5, 6]]], dtype="m8[s]"),
            r"experts \(timedelta64\[s\]\) must be integers",
        ),
        (np.array([0], dtype="m8[s]"), np.array([[[1, 2], [3, 4], [5, 6]]]), r"must be integers"),
        (np.array([0], dtype="M8[s]"), np.array([[[1, 2], [3, 4], [5, 6]]]), r"must be integers"),
        (np.array([True]), np.array([[[1, 2], [3, 4], [5, 6]]]), r"must be integers"),
    ],
)
def test_bad_rows_are_refused_by_name(rows: np.ndarray, experts: np.ndarray, message: str) -> None:
    buffers = ForcingBuffers(max_tokens=8, moe_layers=LAYERS, top_k=2, device="cpu", num_experts=16)
    with pytest.raises(ForcedRoutesError, match=message):
        buffers.load(rows, experts)
    assert not buffers.mask_TL.any(), "a refused load changes nothing"


def test_distinct_ids_in_any_order_and_live_layers_are_not_duplicates() -> None:
    buffers = ForcingBuffers(max_tokens=8, moe_layers=LAYERS, top_k=3, device="cpu", num_experts=16)
    buffers.load(
        np.array([0, 1]), np.array([[[2, 0, 1], [-1, -1, -1], [15, 3, 7]], [[0, 15, 14], [1, 2, 0], [-1] * 3]])
    )
    assert buffers.mask_TL[:2].tolist() == [[True, False, True], [True, True, False]]


def test_an_id_past_int32_is_refused_not_wrapped() -> None:
    buffers = ForcingBuffers(max_tokens=8, moe_layers=LAYERS, top_k=2, device="cpu")  # no expert count known
    with pytest.raises(ForcedRoutesError, match=r"expert id 4294967299 is not below int32's range"):
        buffers.load(np.array([0]), np.full((1, 3, 2), 2**32 + 3, dtype=np.int64))


@pytest.mark.parametrize(
    ("max_tokens", "layers", "top_k", "message"),
    [
        (0, LAYERS, 2, "at least one token row"),
        (4, (), 2, "one MoE layer"),
        (4, (1, 1), 2, "repeat"),
        (4.7, LAYERS, 2, "must be integers"),
        (None, LAYERS, 2, "must be integers"),
        (4, None, 2, r"moe_layers=None\): pass the model's MoE layer numbers as a tuple"),
        (4, 3, 2, r"moe_layers=3\): pass the model's MoE layer numbers"),
        (4, (1, None), 2, "must be integers"),
    ],
)
def test_bad_sizes_are_refused_by_name(max_tokens: object, layers: tuple[int, ...], top_k: int, message: str) -> None:
    with pytest.raises(ForcedRoutesError, match=message):
        ForcingBuffers(max_tokens=max_tokens, moe_layers=layers, top_k=top_k, device="cpu")


@pytest.mark.parametrize(
    ("layers", "num_layers", "message"),
    [
        (
            (-1,),
            None,
            r"MoE layer numbers \[-1\] are not decoder layers of the model \(global layer numbers are >= 0\)",
        ),
        ((1, -3), 8, r"MoE layer numbers \[-3\] are not decoder layers .* \[0, 8\)"),
        ((1, 8), 8, r"MoE layer numbers \[8\] are not decoder layers .* \[0, 8\)\); pass ServedRouting.moe_layers"),
    ],
)
def test_layers_outside_the_model_are_refused_by_name(
    layers: tuple[int, ...], num_layers: int | None, message: str
) -> None:
    """Issue 38 acceptance: moe_layers=(-1,) was taken (a Python index, not a global layer number)."""
    known = {} if num_layers is None else {"num_layers": num_layers}
    with pytest.raises(ForcedRoutesError, match=message):
        ForcingBuffers(max_tokens=4, moe_layers=layers, top_k=2, device="cpu", **known)  # type: ignore[arg-type]
    assert ForcingBuffers(max_tokens=4, moe_layers=(0, 7), top_k=2, device="cpu", num_layers=8).moe_layers == (0, 7)


@pytest.mark.parametrize(
    ("top_k", "num_experts", "message"),
    [
        (9, 8, r"top_k=9, num_experts=8\): need 1 <= top_k <= num_experts"),
        (0, 8, r"top_k=0, num_experts=8\): need 1 <= top_k <= num_experts"),
        (0, None, r"need 1 <= top_k <= the model's num_experts"),
        (2, 0, r"num_experts=0\): num_experts must be >= 1"),
    ],
)
def test_top_k_is_checked_against_num_experts_by_name(top_k: int, num_experts: int | None, message: str) -> None:
    with pytest.raises(ForcedRoutesError, match=message):
        ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=top_k, device="cpu", num_experts=num_experts)
    assert ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=8, device="cpu", num_experts=8).top_k == 8


@pytest.mark.parametrize("device", ["bogus", "cpu:x", 1.5])
def test_a_bad_device_is_refused_by_name(device: object) -> None:
    with pytest.raises(ForcedRoutesError, match=rf"ForcingBuffers\(device={device!r}\): not a torch device"):
        ForcingBuffers(max_tokens=4, moe_layers=LAYERS, top_k=2, device=device)  # type: ignore[arg-type]
