"""The verl batch readers' own arguments (issue 30 leftovers): lengths bounded before allocating, `geometry=` /
`limits=` of the right type, `unchecked=` / `recorded=` real bools, expert ids within the model's experts, and
messages that name what was asked and the reader that was called.

Duck-typed verl containers as in test_batch_readers.py (no verl needed).

Legend: B samples, S padded positions, L layers, K top-k.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    ConfigError,
    ExpertIdRangeError,
    UncheckedRoutesError,
)
from routereplay.integrations.verl import (
    DIGEST_KEY,
    BatchLimits,
    RouteGeometry,
    dense_routed_experts,
    jagged_routed_experts,
    padded_routes,
    put_routes,
    routed_experts_for_batch,
    routes_for_batch,
)
from tests.integrations.verl.test_batch_readers import GEOMETRY, P, _dense, _good, jagged, trace, traces3

NOT_A_BOOL: Any = "no"  # typed Any so the calls below type-check
ONE: Any = 1
NOT_A_GEOMETRY: Any = "x"
NUMPY_TRUE: Any = np.bool_(True)


def test_padded_routes_bounds_the_batch_lengths_before_allocating() -> None:
    """`prompt_length=10**12` tried to allocate 7.28 TiB (a raw MemoryError)."""
    tracemalloc.start()
    try:
        with pytest.raises(BatchGeometryError, match=r"prompt_length=1000000000000 .*BatchLimits.max_positions"):
            padded_routes(trace(5, 0), prompt_len=2, response_len=3, prompt_length=10**12, response_length=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes traced before the lengths were checked"
    with pytest.raises(BatchGeometryError, match="max_positions=8"):
        padded_routes(
            trace(5, 0), prompt_len=2, response_len=3, prompt_length=5, response_length=4,
            limits=BatchLimits(max_positions=8),
        )  # fmt: skip
    out = padded_routes(trace(5, 0), prompt_len=2, response_len=3, prompt_length=5, response_length=4)
    assert out.shape == (1, 9, 2, 2)  # the default limit leaves real batches alone
    with pytest.raises(ConfigError, match=r"BatchLimits.max_positions=0 must be a positive int"):
        BatchLimits(max_positions=0)


READERS = {
    "routes_for_batch": lambda g: routes_for_batch(_good(), geometry=g),
    "routes_for_batch-limits": lambda g: routes_for_batch(_good(), limits=g),
    "routed_experts_for_batch": lambda g: routed_experts_for_batch(_dense(), geometry=g),
    "padded_routes": lambda g: padded_routes(
        trace(5, 0), prompt_len=2, response_len=3, prompt_length=4, response_length=4, geometry=g
    ),
    "dense_routed_experts": lambda g: dense_routed_experts(traces3(), _good().batch["attention_mask"], P, geometry=g),
    "jagged_routed_experts": lambda g: jagged_routed_experts(traces3(), jagged(_good())["input_ids"], geometry=g),
    "put_routes": lambda g: put_routes(_good(), traces3(), form="dense", geometry=g),
}


@pytest.mark.parametrize("read", list(READERS.values()), ids=list(READERS))
def test_a_geometry_of_the_wrong_type_is_a_config_error(read: Any) -> None:
    """`routes_for_batch(batch, geometry="x")` raised a raw AttributeError."""
    with pytest.raises(ConfigError, match=r"(geometry|limits)='x' is a str, not a (RouteGeometry|BatchLimits)"):
        read(NOT_A_GEOMETRY)


@pytest.mark.parametrize("value", [NOT_A_BOOL, ONE, None], ids=["str", "int", "none"])
@pytest.mark.parametrize("flag", ["unchecked", "recorded"])
def test_the_unchecked_opt_out_must_be_a_real_bool(flag: str, value: Any) -> None:
    """`unchecked="no"` (or 1) was taken as true, replaying a digest-less tensor with no token check."""
    batch = _dense()
    del batch.non_tensor_batch[DIGEST_KEY]
    with pytest.raises(ConfigError, match=rf"{flag}={value!r} must be True or False"):
        routed_experts_for_batch(batch, **{flag: value})
    with pytest.raises(UncheckedRoutesError):
        routed_experts_for_batch(batch, unchecked=False)
    assert routed_experts_for_batch(batch, unchecked=NUMPY_TRUE).shape == batch.batch["routed_experts"].shape


@pytest.mark.parametrize("layout", ["padded", "jagged"])
@pytest.mark.parametrize("bad", [30000, 16, -2])
def test_expert_ids_outside_the_model_are_refused_with_a_geometry(layout: str, bad: int) -> None:
    """`unchecked=True` with a geometry of E experts handed back ids of 30000."""
    batch = _dense()
    del batch.non_tensor_batch[DIGEST_KEY]
    routes = batch.batch["routed_experts"].clone()
    routes[1, 5, 2, 1] = bad  # sample 1: its tokens sit at [2, 8), so position 5 is its token 3
    batch.batch["routed_experts"] = routes
    target = batch if layout == "padded" else jagged(batch)
    where = "position 5" if layout == "padded" else "position 3"
    with pytest.raises(ExpertIdRangeError, match=rf"sample 1, {where}, layer column 2, slot 1: expert id {bad} .*E=16"):
        routed_experts_for_batch(target, unchecked=True, recorded=True, geometry=GEOMETRY)
    routed_experts_for_batch(target, unchecked=True, recorded=True)  # no geometry: nothing to bound the ids by


def test_the_acceptance_case_of_ids_30000_on_an_8_expert_model() -> None:
    routes = torch.full((1, 3, 1, 1), 30000, dtype=torch.int16)
    ids = torch.arange(3)[None]
    batch = {"routed_experts": routes, "input_ids": ids, "attention_mask": torch.ones(1, 3, dtype=torch.int64)}
    geometry = RouteGeometry(num_experts=8, num_layers=1, top_k=1, moe_layers=(0,))

    class Proto:
        def __init__(self) -> None:
            self.batch: dict[str, Any] = batch
            self.non_tensor_batch: dict[str, Any] = {}

    with pytest.raises(ExpertIdRangeError, match="sample 0, position 0, layer column 0, slot 0: expert id 30000"):
        routed_experts_for_batch(Proto(), unchecked=True, recorded=True, geometry=geometry)


def test_the_route_columns_message_names_num_hidden_layers_as_asked() -> None:
    """It said `routes of 2 layers x top-2 make 2000...0 int16 entries`: the trace's 2 layers, not the flag's."""
    with pytest.raises(BatchGeometryError, match=r"routes of num_hidden_layers=10{30} x top-2 make 2(0){30} "):
        routes_for_batch(_good(), num_hidden_layers=10**30)


def test_the_narrower_input_ids_error_names_the_reader_called() -> None:
    """It was prefixed `dense_routed_experts:` though `routes_for_batch` was called."""
    batch = _good()
    batch.batch["input_ids"] = batch.batch["input_ids"][:, :-1]
    with pytest.raises(BatchFieldError, match=r"^routes_for_batch: attention_mask has shape"):
        routes_for_batch(batch)
