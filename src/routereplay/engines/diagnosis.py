"""Moved to routereplay.wire.diagnosis; kept so existing imports work.

`routereplay.engines.diagnosis` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.diagnosis`.
"""

from routereplay.wire.diagnosis import (
    MAX_CHECKED_SPLITS,
    Split,
    clean_alternatives,
    describe,
    fits_cleanly,
    split_hint_for_rows,
    splits_of,
)

__all__ = [
    "MAX_CHECKED_SPLITS",
    "Split",
    "clean_alternatives",
    "describe",
    "fits_cleanly",
    "split_hint_for_rows",
    "splits_of",
]
