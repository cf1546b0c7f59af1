"""Moved to routereplay.wire.diagnosis; kept so existing imports work.

`routereplay.engines.diagnosis` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.diagnosis`.
"""

from routereplay.wire import diagnosis as _moved
from routereplay.wire.diagnosis import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
