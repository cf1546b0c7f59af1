"""The demo report says what every figure means (issue 11 item 33)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from routereplay.metrics import logprob_mismatch, routing_agreement
from routereplay.report.page import write_report
from routereplay.report.plots import _identical_groups
from routereplay.report.table import METRIC_ROWS, format_metric
from tests.report.test_page import fake_result


def test_every_demo_metric_has_meaning_text() -> None:
    """Misleading message (issue 11 item 33): `compared_rows`, `tokens` and `unrouted_rows` appeared in the
    results table with no meaning text; every scalar the demo records now has a label and a meaning."""
    routes_a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [-1, -1]]])
    routes_b = torch.tensor([[[1, 0], [2, 4]], [[1, 2], [0, 1]]])
    keys = set(routing_agreement(routes_a, routes_b)) | set(logprob_mismatch(torch.zeros(3), torch.zeros(3)))
    keys |= {"fallback_rows", "update_drift", "update_routing_disagreement"}  # added by rl/demo.py
    keys.discard("per_layer_disagreement")  # a list, drawn as a figure
    meanings = {key: meaning for key, _label, meaning in METRIC_ROWS}
    assert {key for key in keys if not meanings.get(key)} == set()


def test_counts_are_whole_numbers() -> None:
    """Misleading message (issue 11 item 33): `tokens` arrives as a float and printed as 1.024e+04."""
    assert format_metric("tokens", 10240.0) == "10,240"
    assert format_metric("compared_rows", 40960) == "40,960"


def test_config_shows_what_none_means(tmp_path: Path) -> None:
    """Misleading message (issue 11 item 33): the Config table showed `model None` for the built-in demo model."""
    result = fake_result()
    result["config"] = {**result["config"], "model": None, "threads": None}
    write_report(result, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<td>model</td><td>built-in demo model (see arch)</td>" in page
    assert "<td>threads</td><td>default: OMP_NUM_THREADS if set, else 1</td>" in page
    assert not re.search(r"<td>None</td>", page)


def test_identical_modes_share_one_histogram_curve() -> None:
    """Misleading message (issue 11 item 33): the |d| histogram drew R2 exactly over `off` (the same data),
    hiding `off`; identical modes are grouped into one curve labelled with both names."""
    off = np.array([0.1, 0.2, np.nan])
    groups = _identical_groups({"off": off, "R2": off.copy(), "R3": np.array([0.0, 0.1, 0.2])})
    assert groups == [["off", "R2"], ["R3"]]
