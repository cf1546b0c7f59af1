"""Moved to routereplay.wire.megatron; kept so existing imports work.

`routereplay.engines.megatron` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.megatron`.
"""

from routereplay.wire.megatron import (
    decode_megatron,
)

__all__ = [
    "decode_megatron",
]
