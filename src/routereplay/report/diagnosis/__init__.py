"""`routereplay diagnose`: where a user's own run diverges, engine against trainer. Only `cli/` imports it.

Files:
- `rollouts.py`  the inputs: routes, token ids and engine log-probs from vLLM / SGLang payloads, .rrt, route stores
- `scoring.py`   the computation: off vs R3 per layer and position, expert load skew, the summary and next steps
- `page.py`      the report: one self-contained HTML file (plots as data: URIs)
- `plots.py`     the figures, as PNG bytes
"""

from routereplay.report.diagnosis.page import render_diagnosis, write_diagnosis
from routereplay.report.diagnosis.rollouts import Geometry, Rollout, read_rollouts, sniff_inputs
from routereplay.report.diagnosis.scoring import DiagnoseConfig, diagnose, summarize

__all__ = [
    "DiagnoseConfig",
    "Geometry",
    "Rollout",
    "diagnose",
    "read_rollouts",
    "render_diagnosis",
    "sniff_inputs",
    "summarize",
    "write_diagnosis",
]
