"""`Replayer.replay(routes)` argument forms (issue 22 item 11): an int numpy array replays exactly as the same
torch tensor; anything that is neither routes nor RouteTraces is a `ConfigError` naming the accepted forms."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import ConfigError, DtypeError
from tests.runtime.models import random_routes, tiny_qwen3

pytestmark = pytest.mark.hf


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones(2, 10, dtype=torch.long)


def _read_only(array: np.ndarray) -> np.ndarray:
    array = array.copy()
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(
    "as_numpy",
    [
        lambda r: r.numpy(),  # int64, shares memory
        lambda r: r.numpy().astype(np.int32),
        lambda r: r.numpy().astype(np.int8),
        lambda r: r.numpy()[:, :, :, ::-1],  # negative strides (same set per row)
        lambda r: _read_only(r.numpy().astype(np.int16)),
    ],
    ids=["int64", "int32", "int8", "reversed-view", "read-only"],
)
def test_numpy_routes_replay_as_the_tensor(as_numpy: Any) -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3()
    replayer = attach(model)
    ids, mask = _batch()
    forced_BSLK = random_routes(2, 10, 3, 2, 8, seed=5)
    forced_BSLK[0, 3] = -1  # one live-fallback row
    with replayer.replay(forced_BSLK) as rec:
        expected = model(input_ids=ids, attention_mask=mask).logits
    expected_routes = rec.routes
    stats = (replayer.stats.replayed_rows, replayer.stats.fallback_rows)
    with replayer.replay(as_numpy(forced_BSLK)) as rec:
        got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, expected), "a numpy routes array must force the same experts as the torch tensor"
    assert torch.equal(rec.routes, expected_routes)
    assert (replayer.stats.replayed_rows, replayer.stats.fallback_rows) == (2 * stats[0], 2 * stats[1])


def test_unsigned_numpy_routes_replay() -> None:
    from routereplay.runtime import attach

    model = tiny_qwen3()
    replayer = attach(model)
    ids, mask = _batch()
    forced_BSLK = random_routes(2, 10, 3, 2, 8, seed=7)
    with replayer.replay(forced_BSLK):
        expected = model(input_ids=ids, attention_mask=mask).logits
    for dtype in (np.uint8, np.uint16):
        with replayer.replay(forced_BSLK.numpy().astype(dtype)):
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected), dtype


def test_float_numpy_routes_are_a_dtype_error() -> None:
    from routereplay.runtime import attach

    replayer = attach(tiny_qwen3())
    with pytest.raises(DtypeError, match=r"routes array has dtype float32; expert ids are integers"):
        with replayer.replay(np.zeros((2, 10, 3, 2), dtype=np.float32)):
            pass
    with pytest.raises(DtypeError, match=r"dtype bool"):
        with replayer.replay(np.zeros((2, 10, 3, 2), dtype=bool)):
            pass


@pytest.mark.parametrize(
    ("routes", "where"),
    [
        ([[[[0, 1]] * 3] * 10] * 2, r"routes\[0\] is a list"),
        ([torch.zeros(10, 3, 2, dtype=torch.long)], r"routes\[0\] is a Tensor"),
        ({"routed_experts": "..."}, r"routes is a dict"),
        ("AAAA", r"routes is a str"),
        (None, r"routes is a NoneType"),
    ],
    ids=["nested-list", "list-of-tensors", "dict", "str", "none"],
)
def test_other_routes_forms_are_a_config_error(routes: Any, where: str) -> None:
    from routereplay.runtime import attach

    replayer = attach(tiny_qwen3())
    mask = torch.ones(2, 10, dtype=torch.long)
    with pytest.raises(ConfigError, match=where + r".*int tensor or numpy array.*list of RouteTrace.*decode_vllm"):
        with replayer.replay(routes, mask):
            pass
    assert replayer._session is None, "a refused replay leaves no session behind"


def test_uint64_ids_beyond_int64_are_refused_not_wrapped_to_no_route() -> None:
    """An outside tester found np.uint64 2**64-1 replayed as -1 (every row live, silently)."""
    from routereplay.errors import ExpertIdRangeError
    from routereplay.runtime.routes import replay_routes

    with pytest.raises(ExpertIdRangeError, match="uint64 id 18446744073709551615"):
        replay_routes(np.full((1, 2, 2, 2), 2**64 - 1, dtype=np.uint64))
