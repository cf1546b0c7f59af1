"""Moved to routereplay.wire.vllm; kept so existing imports work.

`routereplay.engines.vllm` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.vllm`.
"""

from routereplay.wire import vllm as _moved
from routereplay.wire.vllm import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
