"""Moved to routereplay.wire.megatron; kept so existing imports work.

`routereplay.engines.megatron` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.megatron`.
"""

from routereplay.wire import megatron as _moved
from routereplay.wire.megatron import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
