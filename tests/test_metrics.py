"""metrics.py on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from routereplay.errors import ConfigError, LogProbValueError, TraceShapeError
from routereplay.metrics import logprob_mismatch, routing_agreement


def test_routing_agreement_hand_computed() -> None:
    # 3 tokens x 2 layers x top-2; order inside a row does not matter
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    b = torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[5, 7], [1, 3]]])
    result = routing_agreement(a, b)
    # differing rows: (1, layer 0) shares 1 of 3 ids; (2, layer 0) shares 0 of 4
    assert result["routing_disagreement"] == pytest.approx(2 / 6)
    assert result["token_disagreement"] == pytest.approx(2 / 3)
    assert result["mean_layers_differing"] == pytest.approx(2 / 3)
    assert result["per_layer_disagreement"] == pytest.approx([2 / 3, 0.0])
    assert result["jaccard"] == pytest.approx((1 + 1 + 1 / 3 + 1 + 0 + 1) / 6)
    assert result["compared_rows"] == 6 and result["unrouted_rows"] == 0


def test_routing_agreement_mask_and_unrouted_rows() -> None:
    a = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]])
    b = torch.tensor([[[0, 2]], [[-1, -1]], [[4, 5]]])
    result = routing_agreement(a, b, mask=torch.tensor([True, True, False]))
    assert result["compared_rows"] == 1 and result["unrouted_rows"] == 1
    assert result["routing_disagreement"] == 1.0 and result["jaccard"] == pytest.approx(1 / 3)
    with pytest.raises(TraceShapeError, match="same"):
        routing_agreement(a, b[:, :, :1])
    with pytest.raises(TraceShapeError, match="mask has shape"):
        routing_agreement(a, b, mask=torch.ones(2, dtype=torch.bool))


def test_logprob_mismatch_hand_computed() -> None:
    train = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.1]))
    infer = torch.log(torch.tensor([0.5, 0.5, 0.3, 0.1]))
    mask = torch.tensor([True, True, True, False])
    result = logprob_mismatch(train, infer, mask)
    deltas = [0.0, math.log(0.2 / 0.5), math.log(0.9 / 0.3)]
    assert result["tokens"] == 3
    assert result["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas) / 3)
    assert result["extreme_frac_2"] == pytest.approx(2 / 3)  # ratios 0.4 < 1/2 and 3 > 2; 1.0 is not
    assert result["mean_abs_dlogp"] == pytest.approx(sum(abs(d) for d in deltas) / 3)
    assert result["signed_mean_dlogp"] == pytest.approx(sum(deltas) / 3)
    assert result["chi2"] == pytest.approx(sum((math.exp(d) - 1) ** 2 for d in deltas) / 3)
    assert result["prob_abs_diff"] == pytest.approx((0 + 0.3 + 0.6) / 3)
    x, y = [0.5, 0.2, 0.9], [0.5, 0.5, 0.3]
    mx, my = sum(x) / 3, sum(y) / 3
    cov = sum((p - mx) * (q - my) for p, q in zip(x, y, strict=True))
    pearson = cov / math.sqrt(sum((p - mx) ** 2 for p in x) * sum((q - my) ** 2 for q in y))
    assert result["pearson_prob"] == pytest.approx(pearson)


def test_identical_logprobs_have_zero_mismatch() -> None:
    logp = torch.log(torch.rand(50, generator=torch.Generator().manual_seed(0)))
    result = logprob_mismatch(logp, logp.clone())
    assert result["k3_kl"] == 0 and result["extreme_frac_2"] == 0 and result["chi2"] == pytest.approx(0, abs=1e-12)


def test_logprob_mismatch_errors() -> None:
    with pytest.raises(TraceShapeError, match="differ in shape"):
        logprob_mismatch(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ConfigError, match="selects none"):
        logprob_mismatch(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ConfigError, match="must be > 1"):
        logprob_mismatch(torch.zeros(3), torch.zeros(3), tau=1.0)


def test_chi2_is_never_negative_where_the_sampled_ratios_average_below_one() -> None:
    """A user saw a negative χ² row (-2.27e-4 against -5.45e-4, printed as the ratio 2.395, "R3 worse"):
    mean(r²) - 1 goes negative whenever the sampled ratios r = p_train / p_infer average below 1, which
    finite samples often do. mean((r - 1)²) estimates the same χ² without bias and is >= 0 by construction."""
    ratios = torch.tensor([0.99, 0.995, 1.001, 0.998, 0.997], dtype=torch.float64)
    assert float((ratios**2).mean() - 1) < 0  # the old estimate on these samples
    infer = torch.log(torch.full((5,), 0.4, dtype=torch.float64))
    result = logprob_mismatch(infer + ratios.log(), infer)
    assert result["chi2"] == pytest.approx(float(((ratios - 1) ** 2).mean()))
    assert result["chi2"] > 0
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):  # small random samples of near-equal log-probs: never below 0
        d = torch.randn(7, generator=rng, dtype=torch.float64) * 1e-3
        assert logprob_mismatch(infer[0] + d, infer[0].expand(7))["chi2"] >= 0


def test_numpy_inputs_give_the_tensor_results() -> None:
    """numpy log-probs, routes and masks (a reference script's `np.log(p)`) raised AttributeError ('numpy.ndarray'
    object has no attribute 'numel'); they are read as the same numbers, mixed with tensors freely, never written."""
    gen = torch.Generator().manual_seed(1)
    train, infer = torch.log(torch.rand(4, 6, generator=gen)), torch.log(torch.rand(4, 6, generator=gen))
    mask = torch.rand(4, 6, generator=gen) > 0.3
    expected = logprob_mismatch(train, infer, mask, tau=1.5)
    big_endian = infer.numpy().astype(">f8")
    assert logprob_mismatch(train.numpy(), big_endian, mask.numpy(), tau=np.float64(1.5)) == expected
    assert logprob_mismatch(train.numpy().astype(np.float32), infer, mask.numpy()) == logprob_mismatch(
        train.float(), infer, mask
    )
    a = torch.randint(0, 8, (5, 3, 2), generator=gen)
    b = a.flip(-1).clone()
    b[0, 0] = torch.tensor([6, 7]) if set(a[0, 0].tolist()) != {6, 7} else torch.tensor([0, 1])
    frozen = a.numpy().astype(np.int16)
    frozen.flags.writeable = False
    result = routing_agreement(frozen, b.numpy(), np.ones(5, bool))
    assert result == routing_agreement(a, b) and result["routing_disagreement"] == pytest.approx(1 / 15)


@pytest.mark.parametrize("bad", [[0.1, 0.2, 0.3], "0.1", None, np.array(["a", "b", "c"])])
def test_inputs_that_are_not_arrays_are_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="logp_infer must be a torch tensor or a numeric numpy array of log-probs"):
        logprob_mismatch(torch.zeros(3), bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mask must be a torch tensor or a numeric numpy array"):
        logprob_mismatch(torch.zeros(3), torch.zeros(3), [True, True, True])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tau=.* must be > 1"):
        logprob_mismatch(torch.zeros(3), torch.zeros(3), tau="2")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 0.5])
@pytest.mark.parametrize("side", ["logp_train", "logp_infer"])
def test_a_counted_logprob_that_no_distribution_gives_is_refused(side: str, bad: float) -> None:
    """`logprob_mismatch(tensor([nan]), tensor([0.]))` returned k3_kl=nan silently; a log-prob > 0 was accepted."""
    good = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.3, 0.7]]))
    broken = good.clone()
    broken[1, 2] = bad
    args = (broken, good) if side == "logp_train" else (good, broken)
    with pytest.raises(LogProbValueError, match=rf"^{side}\[1, 2\] = .* (is not finite|is above 0)"):
        logprob_mismatch(*args)
    with pytest.raises(LogProbValueError, match=r"^logp_train\[0\] = nan is not finite"):
        logprob_mismatch(torch.tensor([float("nan")]), torch.tensor([0.0]))
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False  # a masked-out position may hold anything (padding)
    assert logprob_mismatch(*args, mask) == logprob_mismatch(good, good.clone(), mask)
    assert math.isfinite(logprob_mismatch(*args, mask)["k3_kl"])


def test_logprob_rounding_above_zero_is_tolerated() -> None:
    """log(1) computed in float may land a hair above 0: within LOGPROB_TOLERANCE it is a log-prob."""
    assert logprob_mismatch(torch.tensor([5e-7, -1.0]), torch.tensor([0.0, -1.0]))["tokens"] == 2
    with pytest.raises(LogProbValueError, match=r"logp_infer\[1\] = 0.001 is above 0"):
        logprob_mismatch(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 1e-3]))
