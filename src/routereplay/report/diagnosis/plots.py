"""The figures of the diagnose report, as PNG bytes (embedded in the page as data: URIs).

- `layers_png`: routing disagreement per MoE layer, engine vs the trainer's own routing (off) and under R3;
- `positions_png`: routing disagreement per token position, and mean |dlogp| of off and R3 where the engine's
  log-probs are known (positions grouped into at most `MAX_BINS` bins on long sequences);
- `load_png`: expert load skew per layer (busiest expert / mean), engine and trainer.

Each returns None when its data is absent. Figures are drawn on their own Agg canvas (`report.plots`), so this
works headless and leaves the caller's matplotlib state alone. Legend: L = MoE layers, P = positions,
G = position bins.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routereplay.report.plots import DPI, MODE_COLORS, _new_figure, _style_axes

MAX_BINS = 200  # at most this many position groups in the per-position plot
ENGINE_COLOR, TRAINER_COLOR = "#30638e", MODE_COLORS["off"]


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    return buffer.getvalue()


def _values(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def layers_png(record: Mapping[str, Any]) -> bytes | None:
    """Grouped bars per layer: off (the trainer's own routing) and R3 (replayed), percent of compared rows."""
    routing = record["routing"]
    off_L = _values(routing["per_layer_disagreement"])
    if not off_L.size or not np.isfinite(off_L).any():
        return None
    layers_L = record["model"]["layers"]
    fig = _new_figure(min(13.0, 5.5 + 0.25 * len(layers_L)), 3.8)
    ax = fig.add_subplot()
    x_L = np.arange(len(layers_L), dtype=np.float64)
    replayed = routing["replayed_disagreement"] or 0.0
    ax.bar(x_L - 0.2, 100 * np.nan_to_num(off_L), width=0.38, color=MODE_COLORS["off"], label="off (trainer routes)")
    ax.bar(
        x_L + 0.2,
        np.full(len(layers_L), 100 * replayed),
        width=0.38,
        color=MODE_COLORS["R3"],
        label=f"R3 (replayed; overall {replayed:.2%})",
    )
    return _per_layer_png(
        fig, ax, layers_L, "rows with a different expert set (%)", "Routing disagreement per layer: engine vs trainer"
    )


def _per_layer_png(fig: Any, ax: Any, layers_L: Sequence[int], ylabel: str, title: str) -> bytes:
    """A per-layer bar chart finished: one tick per MoE layer (labels vertical past 40), labels, legend; its PNG."""
    x_L = np.arange(len(layers_L), dtype=np.float64)
    ax.set_xticks(x_L, [str(layer) for layer in layers_L], rotation=90 if len(layers_L) > 40 else 0)
    ax.set_xlabel("MoE layer (global index)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _style_axes(ax)
    ax.legend(frameon=False, fontsize=9)
    return _png(fig)


def _binned(values_P: np.ndarray, weights_P: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Weighted means of `values_P` over `bins` equal groups of positions: (first position of each, means)."""
    edges = np.linspace(0, values_P.size, bins + 1).astype(np.int64)
    starts_G = edges[:-1]
    filled_P = np.nan_to_num(values_P) * weights_P
    sums_G, weights_G = np.add.reduceat(filled_P, starts_G), np.add.reduceat(weights_P, starts_G)
    means_G = np.divide(sums_G, weights_G, out=np.full(bins, np.nan), where=weights_G > 0)
    return starts_G, means_G


def positions_png(record: Mapping[str, Any]) -> bytes | None:
    """Routing disagreement per position; below it mean |dlogp| per position (off and R3) when known."""
    table = record["per_position"]
    rows_P = np.asarray(table["routed_rows"], dtype=np.float64)
    if not rows_P.sum():
        return None
    bins = min(MAX_BINS, rows_P.size)
    has_logprobs = "mean_abs_dlogp_off" in table
    fig = _new_figure(8.0, 6.2 if has_logprobs else 3.4)
    from matplotlib.ticker import MaxNLocator

    axes = fig.subplots(2 if has_logprobs else 1, 1, squeeze=False, sharex=True)[:, 0]
    x_G, share_G = _binned(_values(table["routing_disagreement"]), rows_P, bins)
    axes[0].plot(x_G, 100 * share_G, color=MODE_COLORS["off"], linewidth=1.4, marker="o", markersize=2.5)
    axes[0].set_ylabel("rows with a different\nexpert set (%)")
    axes[0].set_title("Routing disagreement per token position (engine vs trainer, off)")
    if has_logprobs:
        tokens_P = np.asarray(table["scored_tokens"], dtype=np.float64)
        for mode in ("off", "R3"):
            x_G, mean_G = _binned(_values(table[f"mean_abs_dlogp_{mode}"]), tokens_P, bins)
            axes[1].plot(x_G, mean_G, color=MODE_COLORS[mode], linewidth=1.4, marker="o", markersize=2.5, label=mode)
        axes[1].set_ylabel("mean |logp_train − logp_engine|")
        axes[1].set_title("Log-prob mismatch per token position")
        axes[1].legend(frameon=False, fontsize=9)
    for ax in axes:
        ax.set_xlabel("token position" + (f" (grouped into {bins} bins)" if bins < rows_P.size else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        _style_axes(ax)
    return _png(fig)


def load_png(record: Mapping[str, Any]) -> bytes | None:
    """Busiest expert over the mean load per layer, for the engine's routes and the trainer's own."""
    load = record["load"]
    engine_L, trainer_L = _values(load["engine"]["max_over_mean"]), _values(load["trainer"]["max_over_mean"])
    if not engine_L.size:
        return None
    layers_L = record["model"]["layers"]
    fig = _new_figure(min(13.0, 5.5 + 0.25 * len(layers_L)), 3.6)
    ax = fig.add_subplot()
    x_L = np.arange(len(layers_L), dtype=np.float64)
    ax.bar(x_L - 0.2, engine_L, width=0.38, color=ENGINE_COLOR, label="engine routes")
    ax.bar(x_L + 0.2, trainer_L, width=0.38, color=TRAINER_COLOR, label="trainer's own routes (off)")
    ax.axhline(1.0, color="#222222", linestyle="--", linewidth=1.0)
    return _per_layer_png(fig, ax, layers_L, "busiest expert / mean load", "Expert load skew per layer (1 = even)")


FIGURES = (
    (
        "layers",
        layers_png,
        "Routing disagreement per MoE layer: the share of (token, layer) rows whose expert set the "
        "trainer's own router picks differently from the engine (off), and the same under R3 (replayed: zero but for "
        "rows the engine did not route).",
    ),
    (
        "positions",
        positions_png,
        "Per token position: routing disagreement, and the mean |dlogp| against the engine's "
        "log-probs without (off) and with R3 replay (only when the inputs hold the engine's log-probs).",
    ),
    (
        "load",
        load_png,
        "Expert load skew: tokens of the busiest expert over the mean tokens per expert, per layer, "
        "for the engine's routes and the trainer's own routing. 1 is an even load.",
    ),
)

__all__ = ["FIGURES", "MAX_BINS", "layers_png", "load_png", "positions_png"]
