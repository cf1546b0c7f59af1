"""Moved to routereplay.wire.limits; kept so existing imports work.

`routereplay.engines.limits` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.limits`.
"""

from routereplay.wire.limits import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_ROWS,
    DEFAULT_MAX_TOP_K,
    MAX_INT_ARGUMENT,
    WIRE_INT_DTYPES,
    WireLimits,
    checked_bool,
    checked_decoder_args,
    checked_int,
    checked_layers,
    checked_optional_int,
    checked_sequence_name,
    is_int,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_MAX_TOP_K",
    "MAX_INT_ARGUMENT",
    "WIRE_INT_DTYPES",
    "WireLimits",
    "checked_bool",
    "checked_decoder_args",
    "checked_int",
    "checked_layers",
    "checked_optional_int",
    "checked_sequence_name",
    "is_int",
]
