"""RouteTrace: the routes of one sequence, where they came from, and whether they are valid.

Files:
- `route_trace.py`  `RouteTrace`: (T, L, K) expert ids (-1 = no route), global layer numbers, router
                    slots, start offset, token ids, whether the top-k order was kept, indexer choices;
                    slicing, merging by token position, equality as sets
- `provenance.py`   `Segment` (which engine and policy version routed which rows), `MergePolicy`, and
                    the merge of two traces of one sequence
- `validation.py`   the canonical id dtype and the validation catalogue: range, partial rows,
                    duplicates, all-zero layers, top-k and layer counts
- `summary.py`      what `routereplay inspect` reports of one trace: coverage, per-layer expert load,
                    the verdict

Shape legend: T tokens (rows), L MoE layers (columns), K top-k.
"""

from routereplay.trace.provenance import UNROUTED_SOURCE, MergePolicy, Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.summary import LayerLoad, TraceSummary, summarize
from routereplay.trace.validation import canonical_dtype

__all__ = [
    "UNROUTED_SOURCE",
    "LayerLoad",
    "MergePolicy",
    "RouteTrace",
    "Segment",
    "TraceSummary",
    "canonical_dtype",
    "summarize",
]
