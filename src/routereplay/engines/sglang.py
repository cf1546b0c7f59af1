"""Moved to routereplay.wire.sglang; kept so existing imports work.

`routereplay.engines.sglang` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.sglang`.
"""

from routereplay.wire import sglang as _moved
from routereplay.wire.sglang import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
