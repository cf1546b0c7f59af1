"""Moved to routereplay.wire.sglang; kept so existing imports work.

`routereplay.engines.sglang` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.sglang`.
"""

from routereplay.wire.sglang import (
    decode_sglang,
)

__all__ = [
    "decode_sglang",
]
