"""The PNG plots of the demo report, each drawn on its own Agg canvas.

- `plot_per_layer_disagreement`: per-layer routing disagreement, grouped bars per mode;
- `plot_dlogp_hist`: |d| = |logp_train - logp_infer| per response token, log-spaced bins, ln 2 marked;
- `plot_kl`: k3 KL and F(2) per mode, annotated with the ratio to `off`;
- `plot_steps`: k3 KL, routing disagreement and drift per training step and mode.

Each returns the written path, or None when its data is absent. matplotlib (extra `demo`) is imported
inside the functions that draw, without pyplot or a global backend switch, so this works headless and
leaves the caller's matplotlib state alone.

Legend: N = response tokens, L = MoE layers, M = modes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.atomicfile import atomic_write
from routereplay.report.table import PERCENT_METRICS, format_metric, format_ratio, ordered_modes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LN2 = math.log(2.0)
DLOGP_FLOOR = 1e-7  # |d| below this (including exact zeros) is drawn at this value on the log axis
DPI = 110
MODE_COLORS = {"off": "#d1495b", "R2": "#edae49", "R3": "#00798c"}
EXTRA_COLORS = ("#30638e", "#6a4c93", "#8a9a5b", "#5c5c5c")
INSTALL_HINT = "pip install 'routereplay[demo]'"


def _mode_color(mode: str, modes_M: Sequence[str]) -> str:
    if mode in MODE_COLORS:
        return MODE_COLORS[mode]
    extras = [m for m in modes_M if m not in MODE_COLORS]
    return EXTRA_COLORS[extras.index(mode) % len(EXTRA_COLORS)]


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
    atomic_write(path, buffer.getvalue())  # a reader never sees half a file
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
    modes_M = [mode for mode in ordered_modes(modes) if modes[mode].get("per_layer_disagreement") is not None]
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
    modes_M = [mode for mode in ordered_modes(dlogp) if len(dlogp[mode]) > 0]
    if not modes_M:
        return None
    abs_by_mode = {mode: np.abs(np.asarray(dlogp[mode], dtype=np.float64)) for mode in modes_M}
    largest = max(float(np.nanmax(abs_N)) for abs_N in abs_by_mode.values())
    upper = max(largest * 1.5, LN2 * 2.0)
    bins = np.logspace(math.log10(DLOGP_FLOOR), math.log10(upper), 61).tolist()
    all_modes = ordered_modes(result["modes"])
    fig = _new_figure(7.2, 4.6)
    ax = fig.add_subplot()
    for names in _identical_groups(abs_by_mode):
        mode = names[0]
        abs_N = abs_by_mode[mode]
        abs_N = abs_N[np.isfinite(abs_N)]
        f2 = float(np.mean(abs_N > LN2)) if abs_N.size else 0.0
        median = float(np.median(abs_N)) if abs_N.size else 0.0
        same = f" = {' = '.join(names[1:])}, identical data" if len(names) > 1 else ""
        label = f"{mode}{same}  (n={abs_N.size:,}, median {median:.2g}, F(2) {format_metric('extreme_frac_2', f2)})"
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
    modes_M = ordered_modes(modes)
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
                text += f"\n{mode}/off = {format_ratio(value, off)}"
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

    modes_M = ordered_modes({row["mode"]: None for row in steps})
    all_modes = ordered_modes({**result["modes"], **{mode: None for mode in modes_M}})
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
