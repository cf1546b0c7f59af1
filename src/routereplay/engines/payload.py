"""Moved to routereplay.wire.payload; kept so existing imports work.

`routereplay.engines.payload` re-exports the same objects (pickles naming this path still load); new
code imports `routereplay.wire.payload`.
"""

from routereplay.wire.payload import (
    DEFAULT_MAX_BYTES,
    NDARRAY_TAG,
    b64_to_bytes,
    dtype_named,
    get_field,
    has_field,
    is_array_like,
    is_ndarray_wrapper,
    lists_to_array,
    load_npy,
    mapping,
    npy_bytes,
    pick,
    pick_choice,
    raw_to_array,
    require_present,
    to_numpy,
    unwrap_ndarray,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "NDARRAY_TAG",
    "b64_to_bytes",
    "dtype_named",
    "get_field",
    "has_field",
    "is_array_like",
    "is_ndarray_wrapper",
    "lists_to_array",
    "load_npy",
    "mapping",
    "npy_bytes",
    "pick",
    "pick_choice",
    "raw_to_array",
    "require_present",
    "to_numpy",
    "unwrap_ndarray",
]
