"""Metric names, labels and number formatting of the demo report, shared by its table and plots.

`format_metric(name, value)` is the one number formatter, shared with the terminal table of
`routereplay demo`; `METRIC_ROWS` orders and explains the results-table rows; `ordered_modes`
puts the replay modes in display order (`off`, `R2`, `R3`, then any other); `mode_label` is a mode's
column heading (the threshold mode names its margin); `NEXT_STEPS` ends the demo's output and its report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# Metrics shown as a percentage: fractions of rows / tokens, or an overlap in [0, 1].
PERCENT_METRICS = frozenset(
    {
        "routing_disagreement",
        "token_disagreement",
        "extreme_frac_2",
        "jaccard",
        "drift",
        "update_drift",
        "update_routing_disagreement",
        "replace_rate",
    }
)
# Metrics that are small and span orders of magnitude.
SCIENTIFIC_METRICS = frozenset({"k3_kl", "chi2"})
# Counts (some arrive as floats, e.g. `tokens`): shown as whole numbers.
COUNT_METRICS = frozenset({"compared_rows", "unrouted_rows", "tokens", "fallback_rows"})

# Results-table rows, in order: (key, label, what it measures). Unknown scalar keys follow these.
METRIC_ROWS: tuple[tuple[str, str, str], ...] = (
    ("routing_disagreement", "Routing disagreement", "(token, layer) rows whose top-k expert set differs"),
    ("token_disagreement", "Token disagreement", "tokens with a differing expert set in at least one layer"),
    ("mean_layers_differing", "Layers differing / token", "mean number of layers per token whose set differs"),
    ("jaccard", "Expert-set Jaccard", "mean |A ∩ B| / |A ∪ B| of the two top-k sets"),
    ("k3_kl", "k3 KL", "mean(exp(d) − 1 − d), the k3 estimator of KL(infer ‖ train)"),
    ("mean_abs_dlogp", "Mean |d|", "mean absolute log-prob difference"),
    ("signed_mean_dlogp", "Mean d", "signed mean log-prob difference (bias)"),
    ("extreme_frac_2", "F(2)", "tokens with |d| > ln 2 (probability ratio outside [½, 2])"),
    ("chi2", "χ²", "mean (exp(d) − 1)², the χ² estimate of the token ratio p_train / p_infer (never negative)"),
    ("prob_abs_diff", "Mean |Δp|", "mean |p_train − p_infer| of the sampled token"),
    ("pearson_prob", "Pearson r(p)", "correlation of p_train and p_infer over tokens"),
    (
        "update_routing_disagreement",
        "≠ engine in updates (GRPO)",
        "mean over GRPO update mini-steps of the routing disagreement with the engine's routes",
    ),
    ("update_drift", "Drift old pass → updates (GRPO)", "routing change between the old-log-prob pass and the updates"),
    (
        "replace_rate",
        "Replace rate (threshold)",
        "replayed rows a threshold gave back to the live router (`demo --threshold`)",
    ),
    ("fallback_rows", "Fallback rows", "(token, layer) rows without engine routes (-1), routed live and counted"),
    (
        "compared_rows",
        "Compared rows",
        "(token, layer) rows where both engine and trainer have a route: the denominator of routing disagreement",
    ),
    (
        "unrouted_rows",
        "Unrouted rows",
        "(token, layer) rows of compared tokens that one side left unrouted (-1), so not compared",
    ),
    ("tokens", "Tokens", "response tokens behind the log-prob metrics (k3 KL, F(2), |d|, ...)"),
)

# Replay modes in display order; any other mode follows in record order.
MODE_ORDER = ("off", "R2", "R3")

# Where to go after the demo: the guides that put R2 / R3 into a trainer, and the engines' routes
NEXT_STEPS = (
    "next: R3 in your own trainer: docs/replay.md (any HF transformers MoE model), docs/trl.md, docs/verl.md, "
    "docs/skyrl.md or docs/megatron.md; your engine's routes: docs/engines.md (in the routereplay source)"
)


def _scientific(value: float, digits: int = 3) -> str:
    """`0.00123` -> `1.23e-3`: scientific with a short exponent."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def format_metric(name: str, value: float | None) -> str:
    """Format one metric value for a table cell.

    Fractions (`routing_disagreement`, `token_disagreement`, `extreme_frac_2`, `jaccard`) become
    percentages, `k3_kl` and `chi2` scientific (`1.23e-3`), anything else 4 significant digits.
    `None` and NaN become `n/a`.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if name in COUNT_METRICS and float(value).is_integer():
        return f"{int(value):,}"
    if isinstance(value, (int, np.integer)) and name not in PERCENT_METRICS:
        return str(int(value))
    value = float(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if name in PERCENT_METRICS:
        percent = 100.0 * value
        if percent == 0:
            return "0%"
        if abs(percent) >= 0.01:
            return f"{percent:.2f}%"
        return f"{_scientific(percent, 2)}%"
    if name in SCIENTIFIC_METRICS:
        return _scientific(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        return _scientific(value, 4)
    return f"{value:.4g}"


def format_ratio(numerator: float | None, denominator: float | None) -> str:
    """`numerator / denominator` as `0.083×`; `—` when undefined (missing, or 0/0)."""
    if numerator is None or denominator is None:
        return "—"
    numerator, denominator = float(numerator), float(denominator)
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return "—"
    ratio = numerator / denominator
    if ratio == 0:
        return "0×"
    if abs(ratio) < 1e-3:
        return f"{_scientific(ratio, 2)}×"
    return f"{ratio:.3g}×"


def format_fact(value: Any) -> str:
    """A config / model fact as text: thousands separators for big ints, compact layer lists."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, int) for v in value) and list(value) == list(range(value[0], value[-1] + 1)):
            return f"{value[0]}–{value[-1]} ({len(value)})" if len(value) > 3 else ", ".join(map(str, value))
        return ", ".join(map(str, value))
    return str(value)


def ordered_modes(modes: Mapping[str, Any]) -> list[str]:
    """`off`, `R2`, `R3` first (when present), then any other mode in record order."""
    known = [mode for mode in MODE_ORDER if mode in modes]
    return known + [mode for mode in modes if mode not in MODE_ORDER]


def mode_label(mode: str, config: Mapping[str, Any]) -> str:
    """A mode's column heading: the mode, and for the threshold mode (`demo --threshold M`) its margin
    (`R3-threshold (margin 0.01)`)."""
    margin = config.get("threshold")
    if mode.endswith("-threshold") and isinstance(margin, (int, float)):
        return f"{mode} (margin {margin:g})"
    return mode
