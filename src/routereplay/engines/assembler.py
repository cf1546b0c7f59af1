"""Moved to routereplay.wire.assembler; kept so existing imports work.

`routereplay.engines.assembler` re-exports the same objects, every name in the new module's `__all__`
(pickles naming this path still load); new code imports `routereplay.wire.assembler`.
"""

from routereplay.wire import assembler as _moved
from routereplay.wire.assembler import *  # noqa: F403  (the names of _moved.__all__)

__all__ = list(_moved.__all__)
