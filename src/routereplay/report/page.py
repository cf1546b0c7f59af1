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

The numbers and metric rows are `routereplay.report.table` (`format_metric` is shared with the
terminal table), the plots `routereplay.report.plots`; this module checks the record and writes
the HTML page and the folder.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from routereplay.atomicfile import atomic_write
from routereplay.errors import ConfigError
from routereplay.report.plots import (
    plot_dlogp_hist,
    plot_kl,
    plot_per_layer_disagreement,
    plot_steps,
)
from routereplay.report.table import (
    METRIC_ROWS,
    NEXT_STEPS,
    format_fact,
    format_metric,
    format_ratio,
    mode_label,
    ordered_modes,
)

__all__ = ["ALT_TEXTS", "CAPTIONS", "CONFIG_DEFAULTS", "CSS", "render_html", "write_report"]

# Config fields whose None means a default, not a missing value: what the report says instead of "None".
CONFIG_DEFAULTS = {
    "model": "built-in demo model (see arch)",
    "threads": "default: OMP_NUM_THREADS if set, else 1",
}


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


def _write_bytes(path: Path, data: bytes) -> None:
    """Write atomically (a reader never sees half a file; a killed writer's temporary is cleaned next time)."""
    atomic_write(path, data)


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

R2_INTRO = (
    "; with <strong>R2</strong> the trainer records its own routing in the old-log-prob pass and replays it in "
    "every update mini-step, so it scores the rollouts as off does and removes the drift between that pass and the "
    "updates, not the engine–trainer gap"
)
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
    "steps.png": (
        "Over the training steps, one line per mode: k3 KL between engine and trainer; the engine-vs-trainer routing "
        "disagreement during the update mini-steps; and the routing drift from the old-log-prob pass to the updates "
        "(R2 replays that pass's routing, so its drift stays at zero; R3 replays the engine's, so its disagreement "
        "does)."
    ),
}


ALT_TEXTS = {
    "per_layer_disagreement.png": "bar chart of routing disagreement per MoE layer and mode",
    "dlogp_hist.png": "histogram of the absolute log-prob difference per mode",
    "kl.png": "bar charts of k3 KL and F(2) per mode",
    "steps.png": "line plots of k3 KL, routing disagreement and routing drift per training step",
}


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _facts_table(title: str, facts: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{_esc(key)}</td><td>{_esc(format_fact(value))}</td></tr>\n" for key, value in facts.items()
    )
    return f"<div><h3>{_esc(title)}</h3>\n<table>\n{rows}</table></div>\n"


def _results_table(modes: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any]) -> str:
    modes_M = ordered_modes(modes)
    ratio_modes = [mode for mode in modes_M if mode != "off"] if "off" in modes else []
    labels = {name: (label, desc) for name, label, desc in METRIC_ROWS}
    head = "".join(f"<th>{_esc(mode_label(mode, config))}</th>" for mode in modes_M)
    head += "".join(f"<th>{_esc(mode)}/off</th>" for mode in ratio_modes)
    lines = [
        '<table class="results">',
        f"<tr><th>metric</th><th>key</th>{head}<th>meaning</th></tr>",
    ]
    for name in _scalar_metric_names(modes):
        label, desc = labels.get(name, (name, ""))
        cells = "".join(f'<td class="num">{_esc(format_metric(name, modes[m].get(name)))}</td>' for m in modes_M)
        cells += "".join(
            f'<td class="num">{_esc(format_ratio(modes[m].get(name), modes["off"].get(name)))}</td>'
            for m in ratio_modes
        )
        lines.append(
            f"<tr><td>{_esc(label)}</td><td><code>{_esc(name)}</code></td>{cells}"
            f'<td class="desc">{_esc(desc)}</td></tr>'
        )
    lines.append("</table>")
    return "\n".join(lines) + "\n"


def _next_steps() -> str:
    """`NEXT_STEPS` as HTML: its docs pages as code."""
    text = _esc(NEXT_STEPS[0].upper() + NEXT_STEPS[1:])
    return re.sub(r"docs/[\w-]+\.md", lambda found: f"<code>{found[0]}</code>", text)


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
        "routes instead of routing again (<strong>off</strong> is no replay)"
        f"{R2_INTRO if 'R2' in modes else ''}. For every response token, "
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
        f"<h2>Results</h2>\n{_results_table(modes, config)}"
        f"<h2>Figures</h2>\n{figures}"
        f"<h2>Next</h2>\n<p>{_next_steps()}</p>\n"
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
