"""Moved to routereplay.wire.payload; kept so existing imports work.

`routereplay.engines.payload` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.payload`.
"""

from routereplay.wire import payload as _moved
from routereplay.wire.payload import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
