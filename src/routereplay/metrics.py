"""Mismatch diagnostics: routing agreement between two engines, and log-prob mismatch.

Definitions follow research/papers-and-metrics.md (R3, arXiv 2510.11370). With `d = logp_train -
logp_infer` over sampled response tokens:
- k3 KL = mean(exp(d) - 1 - d): estimates KL(pi_infer || pi_train) from samples of pi_infer.
- F(tau) = mean 1[|d| > ln tau]: the extreme-token fraction (tau = 2 is the standard).
- chi2 = mean((exp(d) - 1)^2), and mean |d|. Over tokens sampled from pi_infer it estimates the chi^2
  divergence without bias, like mean(exp(d)^2) - 1, but it is >= 0 on every sample (the other goes
  negative whenever the sampled ratios average below 1). The signed mean of d hides magnitude, so it is reported
  next to mean |d|, not in its place.
- prob_abs_diff = mean |p_train - p_infer| and pearson_prob = the Pearson correlation of the
  probabilities.
Routing compares expert SETS per (token, layer) row:
- routing_disagreement: the fraction of rows whose sets differ;
- token_disagreement: the fraction of tokens with any differing layer;
- mean_layers_differing: differing layers per token;
- per_layer_disagreement;
- jaccard: the mean |A ∩ B| / |A ∪ B|.
Rows where either side is -1 (no route) are left out and counted in `unrouted_rows`.

Pure functions on tensors; they return plain dicts of floats (lists for per-layer values). Every input
(routes, log-probs, mask) is a torch tensor or a numpy array (read as the same numbers; a numpy array is
copied, never written); anything else is a `ConfigError` naming the argument. A counted log-prob must be
finite and <= 0 (up to `LOGPROB_TOLERANCE`): NaN, inf or a probability above 1 would turn every measure into nan
or a wrong number, so it is a `LogProbValueError` naming the position; positions the mask leaves out may hold
anything (verl's and the trainers' padding).
Legend: N = tokens (any leading shape, flattened), L = layers, K = top-k.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from routereplay.errors import ConfigError, LogProbValueError, TraceShapeError

LOGPROB_TOLERANCE = 1e-6  # a counted log-prob may exceed 0 by this much (float rounding of log(1))


def routing_agreement(
    a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray | None = None
) -> dict[str, Any]:
    """Compare two routings `a`, `b` of shape (..., L, K); `mask` (...) selects tokens (default all).
    Tensors or numpy arrays (module docstring)."""
    a, b = _tensor(a, "a", "routes"), _tensor(b, "b", "routes")
    if a.shape != b.shape or a.dim() < 2:
        raise TraceShapeError(
            f"routings must have the same (..., L, K) shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    num_layers, top_k = a.shape[-2], a.shape[-1]
    a_NLK, b_NLK = a.reshape(-1, num_layers, top_k).long(), b.reshape(-1, num_layers, top_k).long()
    token_N = _mask(mask, a.shape[:-2], a_NLK.shape[0])
    rows_NL = token_N[:, None] & (a_NLK[..., 0] >= 0) & (b_NLK[..., 0] >= 0)
    sorted_a, sorted_b = a_NLK.sort(dim=-1).values, b_NLK.sort(dim=-1).values
    differ_NL = (sorted_a != sorted_b).any(dim=-1) & rows_NL
    shared_NL = (a_NLK[..., :, None] == b_NLK[..., None, :]).any(dim=-1).sum(dim=-1)  # |A ∩ B| (ids distinct)
    jaccard_NL = shared_NL.double() / (2 * top_k - shared_NL).double()
    rows = int(rows_NL.sum())
    tokens_N = rows_NL.any(dim=-1)
    layer_rows_L = rows_NL.sum(dim=0).double()
    per_layer = (differ_NL.sum(dim=0).double() / layer_rows_L.clamp(min=1)).tolist()
    tokens = int(tokens_N.sum())
    return {
        "routing_disagreement": _ratio(int(differ_NL.sum()), rows),
        "token_disagreement": _ratio(int((differ_NL.any(dim=-1) & tokens_N).sum()), tokens),
        "mean_layers_differing": _ratio(int(differ_NL.sum()), tokens),
        "per_layer_disagreement": [float(x) for x in per_layer],
        "jaccard": float(jaccard_NL[rows_NL].mean()) if rows else 1.0,
        "compared_rows": rows,
        "unrouted_rows": int((token_N[:, None] & ~rows_NL).sum()),
    }


def logprob_mismatch(
    logp_train: torch.Tensor | np.ndarray,
    logp_infer: torch.Tensor | np.ndarray,
    mask: torch.Tensor | np.ndarray | None = None,
    *,
    tau: float = 2.0,
) -> dict[str, float]:
    """Mismatch between the trainer's and the engine's log-probs of the same sampled tokens.

    `logp_train`, `logp_infer` (any shape, the same) and `mask` (that shape, nonzero = a token to count)
    are torch tensors or numpy arrays, mixed freely: `np.log(p)` from a reference script gives the same
    numbers as the tensor it came from (computed in float64 either way)."""
    logp_train = _tensor(logp_train, "logp_train", "log-probs")
    logp_infer = _tensor(logp_infer, "logp_infer", "log-probs")
    if logp_train.shape != logp_infer.shape:
        raise TraceShapeError(
            f"log-prob tensors differ in shape: train {tuple(logp_train.shape)}, infer {tuple(logp_infer.shape)}"
        )
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.integer, np.floating)) or not tau > 1:
        raise ConfigError(f"tau={tau} must be > 1 (F(tau) counts tokens whose probability ratio exceeds tau)")
    token_N = _mask(mask, logp_train.shape, logp_train.numel())
    _check_logprobs(logp_train, token_N, "logp_train")
    _check_logprobs(logp_infer, token_N, "logp_infer")
    train_N = logp_train.reshape(-1).double()[token_N]
    infer_N = logp_infer.reshape(-1).double()[token_N]
    tokens = int(train_N.numel())
    if tokens == 0:
        raise ConfigError("logprob_mismatch got no tokens (the mask selects none)")
    delta_N = train_N - infer_N
    ratio_N = delta_N.exp()
    p_train, p_infer = train_N.exp(), infer_N.exp()
    return {
        "tokens": float(tokens),
        "k3_kl": float((ratio_N - 1 - delta_N).mean()),
        f"extreme_frac_{tau:g}": float((delta_N.abs() > math.log(tau)).double().mean()),
        "mean_abs_dlogp": float(delta_N.abs().mean()),
        "signed_mean_dlogp": float(delta_N.mean()),
        "chi2": float(((ratio_N - 1) ** 2).mean()),
        "prob_abs_diff": float((p_train - p_infer).abs().mean()),
        "pearson_prob": _pearson(p_train, p_infer),
    }


def _tensor(value: object, name: str, what: str) -> torch.Tensor:
    """`value` as a tensor: a tensor itself, a numeric numpy array copied into one (any byte order)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(value.astype(value.dtype.newbyteorder("="), copy=True))
    kind = f"a numpy array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
    raise ConfigError(f"{name} must be a torch tensor or a numeric numpy array of {what}, got {kind}")


def _check_logprobs(logp: torch.Tensor, token_N: torch.Tensor, name: str) -> None:
    """Every counted log-prob finite and <= LOGPROB_TOLERANCE: `LogProbValueError` naming the first that is not."""
    logp_N = logp.detach().reshape(-1).double().cpu()
    bad_N = token_N & (~torch.isfinite(logp_N) | (logp_N > LOGPROB_TOLERANCE))
    if not bool(bad_N.any()):
        return
    first = int(bad_N.nonzero()[0, 0])
    position = tuple(int(i) for i in np.unravel_index(first, tuple(logp.shape))) if logp.dim() else ()
    value = float(logp_N[first])
    why = "is not finite" if not math.isfinite(value) else f"is above 0 (a probability of {math.exp(value):.6g} > 1)"
    raise LogProbValueError(
        f"{name}{list(position)} = {value:.6g} {why} (counted positions holding such values: {int(bad_N.sum())}); pass "
        "log-probs (log_softmax of the logits, gathered at the sampled tokens), and mask out positions that hold "
        "none (padding)"
    )


def _mask(mask: object, shape: torch.Size, count: int) -> torch.Tensor:
    if mask is None:
        return torch.ones(count, dtype=torch.bool)
    mask = _tensor(mask, "mask", "tokens to count")
    if tuple(mask.shape) != tuple(shape):
        raise TraceShapeError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask.reshape(-1).to(torch.bool).cpu()


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 2:
        return 1.0
    x, y = x - x.mean(), y - y.mean()
    denominator = float((x.pow(2).sum() * y.pow(2).sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator > 0 else 1.0


__all__ = ["LOGPROB_TOLERANCE", "logprob_mismatch", "routing_agreement"]
