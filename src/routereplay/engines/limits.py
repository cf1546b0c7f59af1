"""Moved to routereplay.wire.limits; kept so existing imports work.

`routereplay.engines.limits` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.limits`.
"""

from routereplay.wire import limits as _moved
from routereplay.wire.limits import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
