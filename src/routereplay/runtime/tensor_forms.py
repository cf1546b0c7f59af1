"""Which tensors, arrays and numbers replay and record take as arguments, checked before anything reads them.

Every array-valued argument of `Replayer.replay` / `Replayer.record` / `Recording.traces` and of the
Megatron adapter (routes, combine weights, attention masks, input ids, indexer choices) passes here
first, so a hostile form is a named `RouteReplayError` saying what, where and how to fix, never a raw
`TypeError` / `NotImplementedError` from torch or numpy halfway through the checks.

Decided (docs/replay.md "Argument forms"):
- **Accepted as their values**: numpy arrays of any byte order (big-endian is converted to native), any
  strides (negative ones and views: copied to one C-contiguous array), read-only arrays (copied), and
  any width of their kind (int8..int64 and uint8..uint64 for ids, float16..longdouble for weights).
  The values are what counts: a uint64 id beyond int64 is refused, never wrapped to -1.
- **Refused** (`ConfigError`): torch tensors that hold no plain values to read - on the `meta` device,
  sparse (COO, CSR, CSC, BSR, BSC) or MKL-DNN layouts, nested (jagged) tensors, quantized tensors.
  Each message names the argument and the conversion that makes it readable.
- **Numbers** (`threshold=`): any real number (Python int or float, numpy integer or floating scalar,
  `fractions.Fraction`) whose value is a finite float; bools, complex numbers, strings, tensors and ints
  too large for a float are refused by name (an int of thousands of digits is never printed).

The dtype each argument takes (integers for ids, floats for weights, 0/1 for masks) is checked where
the argument is; this file owns only the forms common to all of them.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from routereplay.errors import ConfigError

_FIXES = {
    "sparse": "pass a dense tensor ({name}.to_dense())",
    "mkldnn": "pass a dense tensor ({name}.to_dense())",
    "nested": "pass one padded (B, S, ...) tensor ({name}.to_padded_tensor(-1) for ids, 0 for weights and masks)",
    "quantized": "pass plain values ({name}.dequantize(), or the integer ids it encodes)",
}


def refuse_unreadable(value: object, name: str) -> None:
    """`ConfigError` for a torch tensor whose plain values cannot be read (see the module docstring)."""
    if not isinstance(value, torch.Tensor):
        return
    shape = _shape(value)
    if value.device.type == "meta":
        raise ConfigError(
            f"{name} is on the 'meta' device (shape {shape}), which holds no values, and replay reads the values of "
            f"{name}: materialise it first ({name}.to('cpu') after loading real data, or build it on a real device)"
        )
    if value.is_nested:
        kind, what = "nested", "a nested (jagged) tensor"
    elif value.layout is not torch.strided:
        kind = "mkldnn" if value.layout is torch._mkldnn else "sparse"  # type: ignore[attr-defined]
        what = f"a {value.layout} tensor"
    elif value.is_quantized:
        kind, what = "quantized", f"a quantized {value.dtype} tensor"
    else:
        return
    raise ConfigError(
        f"{name} is {what} (shape {shape}); replay reads plain strided values: {_FIXES[kind].format(name=name)}"
    )


def native_array(array: np.ndarray) -> np.ndarray:
    """`array` as torch.from_numpy takes it without error or warning: native byte order, C-contiguous (no
    negative strides), writeable. The same values and the same dtype kind and width; copied only when needed."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="), order="C")
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, order="C")
    return array


def finite_number(value: object, name: str, wanted: str) -> float:
    """`value` as a float, or `ConfigError` naming `wanted` when it is not a real number with a finite float value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        hint = f"; pass a Python float (float({name}.item()))" if isinstance(value, (torch.Tensor, np.ndarray)) else ""
        raise ConfigError(f"{name}={_shown(value)} ({type(value).__name__}): give {wanted}{hint}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name}={_shown(value)}: give {wanted} (this one has no finite float value)")
    return number


def _shown(value: object) -> str:
    """A short repr: an int of thousands of digits is named by its size (Python refuses to print it whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{'-' if value < 0 else ''}int of {value.bit_length()} bits>"
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _shape(value: torch.Tensor) -> tuple[int, ...] | str:
    try:
        return tuple(value.shape)
    except RuntimeError:  # a jagged nested tensor has no single shape
        return "ragged"


__all__ = ["finite_number", "native_array", "refuse_unreadable"]
