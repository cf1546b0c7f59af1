"""The diagnose report: ONE self-contained HTML file (plots embedded as base64 PNG, no script, no network).

`render_diagnosis(record)` turns the record `routereplay diagnose --json` prints into the page: the summary
and next steps first, then the inputs and the model, the overall numbers (off vs R3 against the engine), a
per-layer table (disagreement, load skew of the engine and the trainer), and the figures of
`report.diagnosis.plots`. `write_diagnosis(record, path)` writes it atomically. Every image is a
`data:image/png;base64,...` URI and the page links to nothing outside itself, so it can be mailed or
attached to an issue as is.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from routereplay.atomicfile import atomic_write
from routereplay.report.diagnosis.plots import FIGURES
from routereplay.report.page import CSS

LOGPROB_ROWS = (
    ("k3_kl", "k3 KL", "mean(exp(d) − 1 − d), d = logp_train − logp_engine"),
    ("mean_abs_dlogp", "mean |d|", "mean absolute log-prob difference per token"),
    ("extreme_frac_2", "F(2)", "tokens whose probability ratio lies outside [½, 2]"),
    ("chi2", "χ²", "mean((exp(d) − 1)²)"),
    ("tokens", "tokens", "scored tokens"),
)


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _number(value: Any, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{100 * float(value):.2f}%"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{float(value):.4g}"


def _code_docs(text: str) -> str:
    """Escaped text with docs pages and calls as code."""
    escaped = _esc(text)
    return re.sub(r"docs/[\w-]+\.md|replay\([\w=.]*\)", lambda found: f"<code>{found[0]}</code>", escaped)


def _facts(title: str, facts: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>\n" for k, v in facts.items())
    return f"<div><h3>{_esc(title)}</h3>\n<table>\n{rows}</table></div>\n"


def _overall(record: Mapping[str, Any]) -> str:
    routing = record["routing"]
    lines = [
        '<table class="results">',
        "<tr><th>measure</th><th>off (trainer routes)</th><th>R3 (replayed)</th><th>meaning</th></tr>",
    ]
    lines.append(
        f'<tr><td>routing disagreement</td><td class="num">{_number(routing["routing_disagreement"], True)}</td>'
        f'<td class="num">{_number(routing["replayed_disagreement"], True)}</td><td class="desc">share of '
        f"{routing['compared_rows']:,} (token, layer) rows whose expert set differs from the engine's</td></tr>"
    )
    logprobs = record["logprobs"]
    if logprobs is not None:
        for key, label, meaning in LOGPROB_ROWS:
            lines.append(
                f'<tr><td>{_esc(label)}</td><td class="num">{_number(logprobs["off"].get(key))}</td>'
                f'<td class="num">{_number(logprobs["R3"].get(key))}</td><td class="desc">{_esc(meaning)}</td></tr>'
            )
    shift = record["replay_shift"]
    if shift is not None:
        lines.append(
            f'<tr><td>replay shift (R3 vs off)</td><td class="num" colspan="2">k3 {_number(shift["k3_kl"])}, mean |d| '
            f'{_number(shift["mean_abs_dlogp"])}</td><td class="desc">how far replaying the engine\'s routes moves the '
            "trainer's own log-probs</td></tr>"
        )
    lines.append("</table>")
    return "\n".join(lines) + "\n"


def _per_layer(record: Mapping[str, Any]) -> str:
    layers_L = record["model"]["layers"]
    per_layer_L = record["routing"]["per_layer_disagreement"]
    engine, trainer = record["load"]["engine"], record["load"]["trainer"]
    lines = [
        "<table>",
        "<tr><th>layer</th><th>disagreement (off)</th><th>engine load max/mean</th>"
        "<th>trainer load max/mean</th><th>unused experts (engine)</th></tr>",
    ]
    for i, layer in enumerate(layers_L):
        lines.append(
            f'<tr><td>{layer}</td><td class="num">{_number(per_layer_L[i], True)}</td>'
            f'<td class="num">{engine["max_over_mean"][i]:.2f}</td>'
            f'<td class="num">{trainer["max_over_mean"][i]:.2f}</td>'
            f'<td class="num">{engine["unused_experts"][i]}</td></tr>'
        )
    lines.append("</table>")
    return "\n".join(lines) + "\n"


def _figures(record: Mapping[str, Any]) -> str:
    parts = []
    for name, draw, caption in FIGURES:
        png = draw(record)
        if png is None:
            continue
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="{name}"><img src="{uri}" alt="{_esc(caption.split(":")[0])}">'
            f"<figcaption>{_esc(caption)}</figcaption></figure>\n"
        )
    return "".join(parts)


def render_diagnosis(record: Mapping[str, Any]) -> str:
    """The page for a `diagnose` record (see the module docstring)."""
    model, inputs = record["model"], record["inputs"]
    title = f"routereplay diagnose: {model['model_type']}"
    steps = "".join(f"<li>{_code_docs(step)}</li>\n" for step in record["summary"]["next_steps"])
    missing = "".join(f"<p><strong>Missing:</strong> {_code_docs(m)}</p>\n" for m in inputs["missing"])
    shown_inputs = {k: v for k, v in inputs.items() if k != "missing"}
    shown_model = {**model, "layers": ", ".join(str(layer) for layer in model["layers"])}
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<h1>{_esc(title)}</h1>\n"
        "<p>The trainer (this model) scored the rollouts twice: with its own routing (<strong>off</strong>) and "
        "replaying the engine's routes (<strong>R3</strong>). <strong>Routing disagreement</strong> is the share of "
        "(token, layer) rows whose expert <em>set</em> differs from the engine's; the log-prob mismatch compares the "
        "trainer's log-probs with the engine's, d = logp_train − logp_engine.</p>\n"
        f"<h2>Summary and next steps</h2>\n<ul>\n{steps}</ul>\n{missing}"
        f'<h2>Setup</h2>\n<div class="facts">\n{_facts("Inputs", shown_inputs)}{_facts("Model", shown_model)}'
        f"{_facts('Trainer', record['config'])}</div>\n"
        f"<h2>Engine vs trainer</h2>\n{_overall(record)}"
        f"<h2>Per layer</h2>\n{_per_layer(record)}"
        f"<h2>Figures</h2>\n{_figures(record)}"
        "</body>\n</html>\n"
    )


def write_diagnosis(record: Mapping[str, Any], path: str | Path) -> Path:
    """Write the page to `path` atomically (a reader never sees half of it); returns the path."""
    target = Path(path)
    atomic_write(target, render_diagnosis(record).encode("utf-8"))
    return target


__all__ = ["render_diagnosis", "write_diagnosis"]
