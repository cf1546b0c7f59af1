"""Moved to routereplay.wire.assembler; kept so existing imports work.

`routereplay.engines.assembler` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.assembler`.
"""

from routereplay.wire.assembler import (
    Expectation,
    assemble,
    raise_wrong_split,
)

__all__ = [
    "Expectation",
    "assemble",
    "raise_wrong_split",
]
