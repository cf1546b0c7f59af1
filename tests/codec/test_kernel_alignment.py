"""The set codec's C kernel only ever sees aligned memory.

Defect guarded against: a `RouteTrace` on a numpy view at an odd byte offset (rows cut from a received
message, `np.frombuffer(buf, np.int16, offset=1)`) reached `set_kernel.c`, which read its int16 ids
through a misaligned pointer: undefined behaviour in C (UBSan reports it; x86-64 happens to tolerate it).
Inputs are now copied to aligned memory before the kernel, an output must be aligned to be written by
it, and the kernel itself refuses a misaligned buffer with ValueError before reading a row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from routereplay.codec import blob as codec
from routereplay.codec import native
from routereplay.codec.subsets import SubsetUnranker, binomial_table
from routereplay.trace.route_trace import RouteTrace
from tests.codec.test_kernel import distinct_rows

pytestmark = pytest.mark.native
T, L, K, E = 96, 3, 8, 128


def odd_view(values: np.ndarray) -> np.ndarray:
    """`values` copied into a view that starts one byte past an aligned address (C-contiguous, misaligned)."""
    raw = np.zeros(values.nbytes + 16, np.uint8)
    view = raw[1 : 1 + values.nbytes].view(values.dtype).reshape(values.shape)
    view[...] = values
    assert not view.flags.aligned and view.flags.c_contiguous
    return view


class AlignmentSpy:
    """Stands in for the kernel module: records whether every array argument is aligned, then calls it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.seen = kernel, []

    def _call(self, name: str, *args: Any) -> Any:
        self.seen += [(name, a.flags.aligned) for a in args if isinstance(a, np.ndarray)]
        return getattr(self.kernel, name)(*args)

    def rank_pack(self, *args: Any) -> Any:
        return self._call("rank_pack", *args)

    def unrank(self, *args: Any) -> Any:
        return self._call("unrank", *args)


@pytest.mark.parametrize("top_k", [8, 5])  # 8: the SSE2 transposing loader; 5: the plain one
@pytest.mark.parametrize("unrouted", [0.0, 0.3])
def test_a_trace_on_an_odd_address_is_copied_before_the_kernel_reads_it(
    top_k: int, unrouted: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert native.KERNEL is not None
    rng = np.random.default_rng(0)
    experts_TLK = distinct_rows(rng, T * L, E, top_k).reshape(T, L, top_k)
    experts_TLK[rng.random((T, L)) < unrouted] = -1
    aligned = RouteTrace(experts_TLK, E)
    trace = RouteTrace(odd_view(experts_TLK), E)
    assert not trace.experts.flags.aligned  # the trace keeps the caller's int16 view
    spy = AlignmentSpy(native.KERNEL)
    monkeypatch.setattr(native, "KERNEL", spy)
    blob = codec.encode(trace)
    assert ("rank_pack", True) in spy.seen and all(ok for _, ok in spy.seen)
    assert blob == codec.encode(aligned) == codec.encode(trace, native=False)
    assert np.array_equal(codec.decode(blob).experts, np.sort(experts_TLK, axis=2))


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32, np.int64])
def test_rows_of_any_width_at_an_odd_address_are_packed_from_an_aligned_copy(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = math.comb(E, K)
    bits, table_JE = (count - 1).bit_length(), binomial_table(E, K, count)
    rows_RK = distinct_rows(np.random.default_rng(2), 300, E, K).astype(dtype)
    spy = AlignmentSpy(native.KERNEL)
    monkeypatch.setattr(native, "KERNEL", spy)
    packed = native.pack_set_rows(odd_view(rows_RK), E, odd_view(table_JE), bits)
    assert spy.seen and all(ok for _, ok in spy.seen)
    assert bytes(packed.payload) == bytes(native.pack_set_rows(rows_RK, E, table_JE, bits).payload)


def test_a_misaligned_output_is_not_one_the_kernel_writes() -> None:
    assert native.can_unrank_into(np.empty((10, K), np.int16))
    assert not native.can_unrank_into(odd_view(np.zeros((10, K), np.int16)))
    assert not native.can_unrank_into(odd_view(np.zeros((10, K), np.int32)))


def test_the_kernel_refuses_misaligned_buffers_before_any_row() -> None:
    """The last line of defence: called directly with a misaligned buffer, the kernel raises, never reads."""
    assert native.KERNEL is not None
    count = math.comb(E, K)
    bits = (count - 1).bit_length()
    table_JE = binomial_table(E, K, count)
    rows_RK = distinct_rows(np.random.default_rng(1), 16, E, K)
    network = np.asarray(native.merge_network(K), np.int32).reshape(-1, 2)
    bitmap, stream = np.zeros(2, np.uint8), np.zeros(-(-16 * bits // 8), np.uint8)
    with pytest.raises(ValueError, match="rank_pack: experts, table or network is not aligned"):
        native.KERNEL.rank_pack(odd_view(rows_RK), E, table_JE, network, bits, bitmap, stream)
    with pytest.raises(ValueError, match="rank_pack: experts, table or network is not aligned"):
        native.KERNEL.rank_pack(rows_RK, E, odd_view(table_JE), network, bits, bitmap, stream)
    routed, bad = native.KERNEL.rank_pack(rows_RK, E, table_JE, network, bits, bitmap, stream)
    assert (routed, bad) == (16, -1)
    plan = native.unrank_plan(SubsetUnranker(table_JE, count), count)
    assert plan is not None
    out = odd_view(np.zeros((16, K), np.int16))
    with pytest.raises(ValueError, match="unrank: out is not aligned"):
        native.unrank_set_rows(plan, stream, out, bits, stream_offset=0)
    assert (out == 0).all()
    good = np.empty((16, K), np.int16)
    assert native.unrank_set_rows(plan, stream, good, bits, stream_offset=0) == -1
    assert np.array_equal(good, np.sort(rows_RK, axis=1))
