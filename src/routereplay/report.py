"""The report folder of `routereplay demo`: one self-contained HTML page and its PNG plots.

`write_report(result, folder)` turns the record `routereplay demo --json` prints (plus the raw
per-token log-prob differences) into

- `report.html`: what is measured, the config and model facts, a table with one row per metric and
  one column per replay mode (plus `<mode>/off` ratio columns), and the figures below;
- `per_layer_disagreement.png`: fraction of (token, layer) rows whose expert set differs between the
  engine's and the trainer's router, per MoE layer and mode;
- `dlogp_hist.png`: distribution of |d| per response token, d = logp_train - logp_infer, on a log
  axis, with the F(2) threshold ln 2 marked (only when `result["dlogp"]` holds data);
- `kl.png`: k3 KL and F(2) per mode, annotated with the ratio to `off`;
- `steps.png`: k3 KL and routing disagreement per training step and mode (only when
  `result["steps"]` is non-empty).

The page needs no network and no JavaScript; images are referenced by relative path, so the folder
can be zipped or served as is. Plotting needs matplotlib (extra `demo`); it is imported inside the
functions that draw, and figures are rendered with the Agg canvas directly (no pyplot, no global
backend switch), so this works headless and leaves the caller's matplotlib state alone.

`format_metric(name, value)` is the one number formatter, shared with the terminal table.

Legend: N = response tokens, L = MoE layers, M = modes.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.atomicfile import atomic_write
from routereplay.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    ("chi2", "χ²", "mean exp(d)² − 1, the χ² estimate of the token ratio p_train / p_infer"),
    ("prob_abs_diff", "Mean |Δp|", "mean |p_train − p_infer| of the sampled token"),
    ("pearson_prob", "Pearson r(p)", "correlation of p_train and p_infer over tokens"),
    (
        "update_routing_disagreement",
        "≠ engine in updates (GRPO)",
        "mean over GRPO update mini-steps of the routing disagreement with the engine's routes",
    ),
    ("update_drift", "Drift old pass → updates (GRPO)", "routing change between the old-log-prob pass and the updates"),
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

# Config fields whose None means a default, not a missing value: what the report says instead of "None".
CONFIG_DEFAULTS = {
    "model": "built-in demo model (see arch)",
    "threads": "default: OMP_NUM_THREADS if set, else 1",
}

LN2 = math.log(2.0)
DLOGP_FLOOR = 1e-7  # |d| below this (including exact zeros) is drawn at this value on the log axis
DPI = 110
MODE_ORDER = ("off", "R2", "R3")
MODE_COLORS = {"off": "#d1495b", "R2": "#edae49", "R3": "#00798c"}
EXTRA_COLORS = ("#30638e", "#6a4c93", "#8a9a5b", "#5c5c5c")
INSTALL_HINT = "pip install 'routereplay[demo]'"


# --- numbers -----------------------------------------------------------------------------------


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


def _format_ratio(numerator: float | None, denominator: float | None) -> str:
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


def _format_fact(value: Any) -> str:
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


# --- the result record -------------------------------------------------------------------------


def _ordered_modes(modes: Mapping[str, Any]) -> list[str]:
    """`off`, `R2`, `R3` first (when present), then any other mode in record order."""
    known = [mode for mode in MODE_ORDER if mode in modes]
    return known + [mode for mode in modes if mode not in MODE_ORDER]


def _mode_color(mode: str, modes_M: Sequence[str]) -> str:
    if mode in MODE_COLORS:
        return MODE_COLORS[mode]
    extras = [m for m in modes_M if m not in MODE_COLORS]
    return EXTRA_COLORS[extras.index(mode) % len(EXTRA_COLORS)]


def _check_result(result: Mapping[str, Any]) -> None:
    """Fail early, naming the missing piece, rather than halfway through writing the folder."""
    for key in ("config", "model", "modes"):
        if key not in result:
            raise ConfigError(f"result has no {key!r} entry; pass the record `routereplay demo --json` prints")
    if not result["modes"]:
        raise ConfigError("result['modes'] is empty; the demo must measure at least one mode (e.g. 'off')")
    layers_L = list(result["model"].get("layers", []))
    for mode, metrics in result["modes"].items():
        per_layer_L = metrics.get("per_layer_disagreement")
        if per_layer_L is not None and layers_L and len(per_layer_L) != len(layers_L):
            raise ConfigError(
                f"mode {mode!r}: per_layer_disagreement has {len(per_layer_L)} values but model.layers lists "
                f"{len(layers_L)} layers; both must come from the same model"
            )


def _scalar_metric_names(modes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Table rows: the known metrics present in any mode, then unknown scalar ones."""
    present = {
        name
        for metrics in modes.values()
        for name, value in metrics.items()
        if isinstance(value, (int, float, np.integer, np.floating)) or value is None
    }
    known = [name for name, _, _ in METRIC_ROWS if name in present]
    extra = sorted(present - set(known))
    return known + extra


# --- files -------------------------------------------------------------------------------------


def _write_bytes(path: Path, data: bytes) -> None:
    """Write atomically (a reader never sees half a file; a killed writer's temporary is cleaned next time)."""
    atomic_write(path, data)


def _new_figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas: no pyplot, no display, no global backend change."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"the demo report's plots need matplotlib; install it with {INSTALL_HINT}") from exc
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save_figure(fig: Figure, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    _write_bytes(path, buffer.getvalue())
    return path


def _style_axes(ax: Axes) -> None:
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.set_axisbelow(True)
    ax.grid(axis="y", color="#dddddd", linewidth=0.8)


# --- plots -------------------------------------------------------------------------------------


def plot_per_layer_disagreement(result: Mapping[str, Any], path: Path) -> Path | None:
    """Grouped bars: per-layer routing disagreement (percent of rows) of every mode that has it."""
    modes = result["modes"]
    modes_M = [mode for mode in _ordered_modes(modes) if modes[mode].get("per_layer_disagreement") is not None]
    if not modes_M:
        return None
    num_layers = len(modes[modes_M[0]]["per_layer_disagreement"])
    layers_L = list(result["model"].get("layers") or range(num_layers))
    fig = _new_figure(min(13.0, 6.4 + 0.12 * num_layers * len(modes_M)), 3.8)
    ax = fig.add_subplot()
    x_L = np.arange(num_layers, dtype=np.float64)
    width = 0.8 / len(modes_M)
    label_bars = num_layers * len(modes_M) <= 24
    top = 0.0
    for i, mode in enumerate(modes_M):
        percent_L = 100.0 * np.asarray(modes[mode]["per_layer_disagreement"], dtype=np.float64)
        top = max(top, float(np.nanmax(percent_L)) if percent_L.size else 0.0)
        bars = ax.bar(
            x_L + (i - (len(modes_M) - 1) / 2) * width,
            percent_L,
            width=width * 0.92,
            color=_mode_color(mode, modes_M),
            label=f"{mode}  (overall {format_metric('routing_disagreement', modes[mode].get('routing_disagreement'))})",
        )
        if label_bars:
            ax.bar_label(bars, labels=[f"{p:.1f}" for p in percent_L], padding=2, fontsize=7, color="#333333")
    ax.set_xticks(x_L, [str(layer) for layer in layers_L])
    ax.set_xlim(-0.6, num_layers - 0.4)
    if num_layers > 40:
        for label in ax.get_xticklabels():
            label.set_rotation(90)
    ax.set_xlabel("MoE layer (global index)")
    ax.set_ylabel("rows with a different expert set (%)")
    ax.set_ylim(0, top * (1.18 + 0.07 * len(modes_M)) if top > 0 else 1.0)  # headroom for the legend
    config = result["config"]
    engine_dtype, trainer_dtype = config.get("engine_dtype", "bf16"), config.get("trainer_dtype", "fp32")
    ax.set_title(f"Routing disagreement per layer: engine ({engine_dtype}) vs trainer ({trainer_dtype}) router")
    _style_axes(ax)
    ax.legend(frameon=False, fontsize=9, loc="upper left")
    return _save_figure(fig, path)


def plot_dlogp_hist(result: Mapping[str, Any], path: Path) -> Path | None:
    """Histograms of |d| per mode, log-spaced bins, with ln 2 (the F(2) threshold) marked."""
    dlogp = result.get("dlogp") or {}
    modes_M = [mode for mode in _ordered_modes(dlogp) if len(dlogp[mode]) > 0]
    if not modes_M:
        return None
    abs_by_mode = {mode: np.abs(np.asarray(dlogp[mode], dtype=np.float64)) for mode in modes_M}
    largest = max(float(np.nanmax(abs_N)) for abs_N in abs_by_mode.values())
    upper = max(largest * 1.5, LN2 * 2.0)
    bins = np.logspace(math.log10(DLOGP_FLOOR), math.log10(upper), 61).tolist()
    all_modes = _ordered_modes(result["modes"])
    fig = _new_figure(7.2, 4.6)
    ax = fig.add_subplot()
    for names in _identical_groups(abs_by_mode):
        mode = names[0]
        abs_N = abs_by_mode[mode]
        abs_N = abs_N[np.isfinite(abs_N)]
        f2 = float(np.mean(abs_N > LN2)) if abs_N.size else 0.0
        median = float(np.median(abs_N)) if abs_N.size else 0.0
        same = f" = {' = '.join(names[1:])}, identical data" if len(names) > 1 else ""
        label = (
            f"{mode}{same}  (n={abs_N.size:,}, median {median:.2g}, F(2) {format_metric('extreme_frac_2', f2)})"
        )
        shown_N = np.clip(abs_N, DLOGP_FLOOR, None)
        weights_N = np.full(shown_N.shape, 100.0 / max(shown_N.size, 1))
        color = _mode_color(mode, all_modes)
        ax.hist(shown_N, bins=bins, weights=weights_N, histtype="stepfilled", color=color, alpha=0.25)
        ax.hist(shown_N, bins=bins, weights=weights_N, histtype="step", color=color, linewidth=1.6, label=label)
    ax.axvline(LN2, color="#222222", linestyle="--", linewidth=1.2)
    ax.annotate(
        "ln 2 ≈ 0.693\nF(2) threshold",
        xy=(LN2, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(-6, -6),
        textcoords="offset points",
        ha="right",
        va="top",
        fontsize=8.5,
    )
    ax.set_xscale("log")
    ax.set_xlim(DLOGP_FLOOR, upper)
    ax.set_xlabel(f"|logp_train − logp_infer| per response token (values < {DLOGP_FLOOR:g} drawn at {DLOGP_FLOOR:g})")
    ax.set_ylabel("tokens (%)")
    ax.set_title("Log-prob mismatch between trainer and engine")
    _style_axes(ax)
    fig.legend(frameon=False, fontsize=8.5, loc="outside lower center")  # below the axes: never over the bars
    return _save_figure(fig, path)


def _identical_groups(arrays: Mapping[str, np.ndarray]) -> list[list[str]]:
    """Modes grouped by identical data, in order: one curve drawn on another would hide it (the demo's
    R2 old-log-prob pass routes like `off`, so their |d| are the same numbers)."""
    groups: list[list[str]] = []
    for name, values in arrays.items():
        for group in groups:
            if np.array_equal(arrays[group[0]], values, equal_nan=True):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def plot_kl(result: Mapping[str, Any], path: Path) -> Path | None:
    """Two bar panels, k3 KL and F(2) per mode, each bar annotated with its ratio to `off`."""
    modes = result["modes"]
    candidates = (("k3_kl", "k3 KL  (mean exp(d) − 1 − d)"), ("extreme_frac_2", "F(2)  (tokens with |d| > ln 2)"))
    panels = tuple(p for p in candidates if any(modes[m].get(p[0]) is not None for m in modes))
    if not panels:
        return None
    modes_M = _ordered_modes(modes)
    fig = _new_figure(3.0 + 2.6 * len(panels), 3.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, title) in zip(axes, panels, strict=True):
        values_M = [modes[mode].get(name) for mode in modes_M]
        heights_M = np.array([np.nan if v is None else float(v) for v in values_M], dtype=np.float64)
        scale = 100.0 if name in PERCENT_METRICS else 1.0
        x_M = np.arange(len(modes_M))
        bars = ax.bar(
            x_M, np.nan_to_num(heights_M) * scale, width=0.6, color=[_mode_color(m, modes_M) for m in modes_M]
        )
        off = modes.get("off", {}).get(name)
        labels = []
        for mode, value in zip(modes_M, values_M, strict=True):
            text = format_metric(name, value)
            if mode != "off" and off is not None:
                text += f"\n{mode}/off = {_format_ratio(value, off)}"
            labels.append(text)
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8.5)
        top = float(np.nanmax(heights_M)) * scale if np.isfinite(heights_M).any() else 0.0
        ax.set_ylim(0, top * 1.35 if top > 0 else 1.0)
        ax.set_xticks(x_M, modes_M)
        ax.set_xlabel("replay mode")
        ax.set_ylabel("tokens (%)" if scale == 100.0 else "nats per token")
        if scale == 1.0:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.set_title(title, fontsize=10)
        _style_axes(ax)
    fig.suptitle("Trainer–engine mismatch by replay mode", fontsize=11)
    return _save_figure(fig, path)


def plot_steps(result: Mapping[str, Any], path: Path) -> Path | None:
    """k3 KL, engine-vs-trainer routing and drift per training step, one line per mode; None without steps."""
    steps = result.get("steps") or []
    if not steps:
        return None
    from matplotlib.ticker import MaxNLocator

    modes_M = _ordered_modes({row["mode"]: None for row in steps})
    all_modes = _ordered_modes({**result["modes"], **{mode: None for mode in modes_M}})
    candidates = (
        ("k3_kl", "k3 KL per step (engine vs trainer)", "k3 KL (nats / token)"),
        ("routing_disagreement", "Engine vs trainer routing, updates", "rows with a different expert set (%)"),
        ("drift", "Routing drift: old-log-prob pass → updates", "rows with a different expert set (%)"),
    )
    panels = [panel for panel in candidates if any(row.get(panel[0]) is not None for row in steps)]
    fig = _new_figure(4.5 * len(panels), 3.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, title, ylabel) in zip(axes, panels, strict=True):
        scale = 100.0 if name in PERCENT_METRICS else 1.0
        for mode in modes_M:
            rows = sorted((row for row in steps if row["mode"] == mode and row.get(name) is not None), key=_step_key)
            if not rows:
                continue
            ax.plot(
                [row["step"] for row in rows],
                [scale * float(row[name]) for row in rows],
                marker="o",
                markersize=3.5,
                linewidth=1.6,
                color=_mode_color(mode, all_modes),
                label=mode,
            )
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if scale == 1.0:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.set_ylim(bottom=0)
        _style_axes(ax)
        ax.legend(frameon=False, fontsize=9)
    fig.suptitle("Training run: mismatch per step", fontsize=11)
    return _save_figure(fig, path)


def _step_key(row: Mapping[str, Any]) -> int:
    return int(row["step"])


# --- html --------------------------------------------------------------------------------------

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222; max-width: 980px;
       margin: 2em auto; padding: 0 1em; line-height: 1.5; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.desc { color: #555; } code { background: #f4f4f4; padding: 0 0.25em; border-radius: 3px; font-size: 0.92em; }
.facts { display: flex; gap: 2em; flex-wrap: wrap; } .facts table td:first-child { color: #555; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: 0.92em; margin-top: 0.3em; }
"""

CAPTIONS = {
    "per_layer_disagreement.png": (
        "Per-layer routing disagreement: the share of (token, layer) rows where the trainer's router picks a "
        "different top-k expert set than the engine did. With R3 the trainer replays the engine's routes, so "
        "its bars should be at zero."
    ),
    "dlogp_hist.png": (
        "Distribution of |d| = |logp_train − logp_infer| over response tokens (log x axis). Mass to the right "
        "of the dashed ln 2 line is F(2): tokens whose probability ratio lies outside [½, 2]. Modes with identical "
        "data share one curve (R2 scores like off: its old-log-prob pass routes the trainer's own way)."
    ),
    "kl.png": (
        "k3 KL and F(2) per mode, with each mode's ratio to no replay (off). A ratio below 1 means replay "
        "shrinks the trainer–engine mismatch."
    ),
    "steps.png": "k3 KL and routing disagreement over the training steps, one line per mode.",
}


ALT_TEXTS = {
    "per_layer_disagreement.png": "bar chart of routing disagreement per MoE layer and mode",
    "dlogp_hist.png": "histogram of the absolute log-prob difference per mode",
    "kl.png": "bar charts of k3 KL and F(2) per mode",
    "steps.png": "line plots of k3 KL and routing disagreement per training step",
}


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _facts_table(title: str, facts: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{_esc(key)}</td><td>{_esc(_format_fact(value))}</td></tr>\n" for key, value in facts.items()
    )
    return f"<div><h3>{_esc(title)}</h3>\n<table>\n{rows}</table></div>\n"


def _results_table(modes: Mapping[str, Mapping[str, Any]]) -> str:
    modes_M = _ordered_modes(modes)
    ratio_modes = [mode for mode in modes_M if mode != "off"] if "off" in modes else []
    labels = {name: (label, desc) for name, label, desc in METRIC_ROWS}
    head = "".join(f"<th>{_esc(mode)}</th>" for mode in modes_M)
    head += "".join(f"<th>{_esc(mode)}/off</th>" for mode in ratio_modes)
    lines = [
        '<table class="results">',
        f"<tr><th>metric</th><th>key</th>{head}<th>meaning</th></tr>",
    ]
    for name in _scalar_metric_names(modes):
        label, desc = labels.get(name, (name, ""))
        cells = "".join(f'<td class="num">{_esc(format_metric(name, modes[m].get(name)))}</td>' for m in modes_M)
        cells += "".join(
            f'<td class="num">{_esc(_format_ratio(modes[m].get(name), modes["off"].get(name)))}</td>'
            for m in ratio_modes
        )
        lines.append(
            f"<tr><td>{_esc(label)}</td><td><code>{_esc(name)}</code></td>{cells}"
            f'<td class="desc">{_esc(desc)}</td></tr>'
        )
    lines.append("</table>")
    return "\n".join(lines) + "\n"


def render_html(result: Mapping[str, Any], images: Sequence[str]) -> str:
    """The report page; `images` are file names next to it, shown in order with their captions."""
    config, model, modes = result["config"], result["model"], result["modes"]
    engine_dtype = config.get("engine_dtype", "bf16")
    trainer_dtype = config.get("trainer_dtype", "fp32")
    title = f"routereplay demo: {model.get('model_type', config.get('arch', 'MoE'))}"
    intro = (
        f"The same tiny Mixture-of-Experts model generates rollouts in an <em>engine</em> running in "
        f"<code>{_esc(engine_dtype)}</code> and re-scores them in a <em>trainer</em> running in "
        f"<code>{_esc(trainer_dtype)}</code>. The precision gap makes the two routers pick different top-k "
        "experts for some tokens; <strong>routing disagreement</strong> is the fraction of (token, layer) rows "
        "whose expert <em>set</em> differs. With <strong>R3</strong> the trainer replays the engine's recorded "
        "routes instead of routing again (<strong>off</strong> is no replay). For every response token, "
        "<code>d = logp_train − logp_infer</code>; <strong>k3 KL</strong> = mean(exp(d) − 1 − d), and "
        "<strong>F(2)</strong> = fraction of tokens with |d| &gt; ln 2, i.e. whose probability ratio lies "
        "outside [½, 2]. Lower is better for both: a large mismatch biases the policy-gradient importance "
        "weights."
    )
    shown_config = {key: CONFIG_DEFAULTS.get(key, "not set") if v is None else v for key, v in config.items()}
    facts = [_facts_table("Config", shown_config), _facts_table("Model", model)]
    if result.get("rollouts"):
        facts.append(_facts_table("Rollouts", result["rollouts"]))
    figures = "".join(
        f'<figure><img src="{_esc(name)}" alt="{_esc(ALT_TEXTS.get(name, name))}">'
        f"<figcaption>{_esc(CAPTIONS.get(name, name))}</figcaption></figure>\n"
        for name in images
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"<h1>{_esc(title)}</h1>\n<p>{intro}</p>\n"
        f'<h2>Setup</h2>\n<div class="facts">\n{"".join(facts)}</div>\n'
        f"<h2>Results</h2>\n{_results_table(modes)}"
        f"<h2>Figures</h2>\n{figures}"
        "</body>\n</html>\n"
    )


def write_report(result: dict[str, Any], folder: str | Path) -> list[Path]:
    """Write `folder/report.html` and its PNG plots; return the written paths (HTML last).

    `result` is the `routereplay demo --json` record with the raw `dlogp` arrays. Plots whose data
    is absent (`dlogp`, `steps`) are skipped. Raises `ConfigError` on a malformed record and
    `ImportError` (naming the `demo` extra) when matplotlib is missing.
    """
    _check_result(result)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plots = (
        ("per_layer_disagreement.png", plot_per_layer_disagreement),
        ("dlogp_hist.png", plot_dlogp_hist),
        ("kl.png", plot_kl),
        ("steps.png", plot_steps),
    )
    written: list[Path] = []
    for name, plot in plots:
        path = plot(result, folder / name)
        if path is not None:
            written.append(path)
    html_path = folder / "report.html"
    _write_bytes(html_path, render_html(result, [path.name for path in written]).encode("utf-8"))
    written.append(html_path)
    return written
