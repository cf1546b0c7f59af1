"""The demo's report (an HTML page of the off / R2 / R3 comparison) and `diagnose`'s (a user's own run).

Only `cli/` imports it. Files:
- `page.py`   `write_report`: the page, written into a folder atomically
- `table.py`  which metrics the page shows, and how each is formatted
- `plots.py`  per-layer disagreement, |Δ log p| histogram, k3 KL and GRPO-step plots (matplotlib)
- `diagnosis/` `routereplay diagnose`: a user's rollouts scored off vs R3, and its one-file HTML report
"""

from routereplay.report.page import render_html, write_report
from routereplay.report.plots import plot_steps
from routereplay.report.table import METRIC_ROWS, format_metric

__all__ = ["METRIC_ROWS", "format_metric", "plot_steps", "render_html", "write_report"]
