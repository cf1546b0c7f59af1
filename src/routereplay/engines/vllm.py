"""Moved to routereplay.wire.vllm; kept so existing imports work.

`routereplay.engines.vllm` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.vllm`.
"""

from routereplay.wire.vllm import (
    decode_vllm,
)

__all__ = [
    "decode_vllm",
]
