"""Hostile combine weights are refused by name before the context opens (nothing allocated, no forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import routereplay
from routereplay.errors import ConfigError, WeightsShapeError, WeightsSumError, WeightsValueError
from routereplay.testing.hf.models import tiny_model
from tests.runtime.models import random_routes, tiny_qwen3


def setup(norm: bool = False) -> tuple[routereplay.Replayer, torch.Tensor, torch.Tensor]:
    model = tiny_qwen3()
    replayer = routereplay.attach(model)
    if norm:
        for site in replayer.sites:
            site.router.norm_topk_prob = True  # the router now says it normalises its top-k
    routes = random_routes(2, 5, len(replayer.layers), 2, 8)
    return replayer, routes, torch.full(routes.shape, 0.5)


def refused(replayer: routereplay.Replayer, routes: object, weights: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        with replayer.replay(routes, weights=weights):  # type: ignore[arg-type]
            raise AssertionError("the context must not open")
    assert replayer.mode == "off"


def test_wrong_shape_and_dtype_are_refused() -> None:
    replayer, routes, weights = setup()
    refused(replayer, routes, weights[:, :4], WeightsShapeError, r"shape \(2, 4, 3, 2\) but the routes \(2, 5, 3, 2\)")
    refused(replayer, routes, weights.long(), WeightsShapeError, "floating point")
    refused(replayer, routes, np.ones(routes.shape, dtype=np.int32), WeightsShapeError, "floating point")
    refused(replayer, routes, [[0.5]], WeightsShapeError, "got list")


@pytest.mark.parametrize(
    ("value", "match"), [(float("nan"), "is not finite"), (float("inf"), "is not finite"), (-0.1, "is negative")]
)
def test_nan_inf_and_negative_weights_are_refused(value: float, match: str) -> None:
    replayer, routes, weights = setup()
    weights[1, 2, 1, 0] = value
    refused(replayer, routes, weights, WeightsValueError, f"weight 0 of batch row 1, position 2, layer 1 {match}")


@pytest.mark.parametrize("norm", [False, True], ids=["router-not-normalising", "norm_topk_prob"])
def test_a_row_summing_beyond_float32_is_not_finite_before_any_sum_check(norm: bool) -> None:
    """Found by the issue 38 acceptance tester (weights scaled past float32's range): each weight 2e38 fits
    float32 but the row's sum does not; refused as not finite, not blamed on the normalisation."""
    replayer, routes, weights = setup(norm=norm)
    weights[1, 2, 1] = torch.tensor([2e38, 2e38])
    refused(
        replayer,
        routes,
        weights.double(),
        WeightsValueError,
        r"weights of batch row 1, position 2, layer 1 sum to 4e\+38, which is not finite in float32 .*1 such rows",
    )


def test_weights_on_minus_one_rows_are_refused() -> None:
    replayer, routes, weights = setup()
    routes[0, 1] = -1
    refused(replayer, routes, weights, WeightsValueError, "non-zero on a row whose route is -1")


def test_rows_not_summing_as_a_normalising_router_are_refused() -> None:
    replayer, routes, weights = setup(norm=True)
    weights[1, 3, 2] = torch.tensor([0.6, 0.6])
    refused(
        replayer,
        routes,
        weights,
        WeightsSumError,
        r"position 3, layer 2 sum to 1.2, but the layer.s other rows to 1, and .* every top-2 row to one value",
    )
    with replayer.replay(routes, weights=weights.clamp(max=0.5)):
        pass  # rows summing to one value open
    model = replayer.model
    with pytest.raises(WeightsSumError, match="all sum to one value, but some given rows do not"):
        with torch.no_grad(), replayer.replay(routes, weights=torch.full(routes.shape, 0.4)):  # one value: 0.8
            model(input_ids=torch.zeros((2, 5), dtype=torch.long))  # the router's own rows sum to 1


def test_a_router_normalising_without_saying_so_is_checked_at_its_call() -> None:
    model = tiny_model("mixtral")  # renormalises its top-k unconditionally, no norm_topk_prob flag
    replayer = routereplay.attach(model)
    routes = random_routes(1, 6, len(replayer.layers), 2, 8)
    with pytest.raises(WeightsSumError, match="all sum to one value"):
        with torch.no_grad(), replayer.replay(routes, weights=torch.full(routes.shape, 0.3)):
            model(input_ids=torch.zeros((1, 6), dtype=torch.long))
    with torch.no_grad(), replayer.replay(routes, weights=torch.full(routes.shape, 0.5)):
        model(input_ids=torch.zeros((1, 6), dtype=torch.long))


def test_weights_grad_and_traces_without_weights_are_named() -> None:
    replayer, routes, weights = setup()
    with pytest.raises(ConfigError, match="weights_grad='both'"):
        with replayer.replay(routes, weights=weights, weights_grad="both"):
            pass
    refused(replayer, routes, True, ConfigError, "takes the weights from RouteTraces")
    mask = torch.ones((2, 5), dtype=torch.long)
    with torch.no_grad(), replayer.record() as rec:
        replayer.model(input_ids=torch.zeros((2, 5), dtype=torch.long), attention_mask=mask)
    with pytest.raises(WeightsShapeError, match="trace 0 carries no weights"):
        with replayer.replay(rec.traces(mask), mask, weights=True):
            pass
    with pytest.raises(ConfigError, match=r"record\(weights='yes'\): pass True"):
        with replayer.record(weights="yes"):  # type: ignore[arg-type]
            pass
