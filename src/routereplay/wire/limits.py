"""Bounds and argument checks of the wire decoders.

A payload declares its own shape (a `.npy` header, the nesting of JSON lists, an array's dims).
A forged declaration can be tiny on the wire yet ask for an absurd shape: `(0, 10**7, 8)` holds no
bytes but would make us build ten million layer numbers. `WireLimits` bounds every declared axis
before anything is allocated or looped over; the defaults sit far above any real model (the
largest open MoE models have < 100 layers and top-k <= 16). Raise a bound by passing
`limits=WireLimits(max_layers=...)` to a decoder.

The `checked_*` functions turn a decoder argument of the wrong type or range (`None`, a bool, a
float, a string where an int belongs) into a `ConfigError` naming the argument, instead of a
`TypeError` deep inside numpy.

Legend: T = rows (token positions), L = layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from routereplay.errors import ConfigError, PayloadLimitError, TraceShapeError

DEFAULT_MAX_ROWS = 1 << 24  # 16.7 M token positions in one sequence
DEFAULT_MAX_LAYERS = 1024  # real MoE models: < 100 hidden layers
DEFAULT_MAX_TOP_K = 1024  # real MoE models: top-k <= 16 (K <= E always)
MAX_INT_ARGUMENT = (1 << 63) - 1  # every count, offset and index argument fits int64
ROUTE_NDIM = 3  # routes are (T, L, K); a payload declaring more dims is refused unread

# integer dtypes an engine may name for its routes (SGLang routed_experts_dtype, Megatron's
# ["ndarray", {"dtype": ...}]); anything else (float, bool, object, structured) is refused
WIRE_INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


@dataclass(frozen=True, slots=True, kw_only=True)
class WireLimits:
    """Largest shape a decoder accepts, checked before any allocation or O(size) work."""

    max_rows: int = DEFAULT_MAX_ROWS
    max_layers: int = DEFAULT_MAX_LAYERS
    max_top_k: int = DEFAULT_MAX_TOP_K

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_layers", "max_top_k"):
            checked_int(getattr(self, name), f"WireLimits.{name}", minimum=1)

    def check_shape(self, shape: Sequence[int], what: str) -> None:
        """Refuse a declared (T, L, K) shape beyond the bounds, or with an empty layer/top-k axis."""
        if len(shape) != ROUTE_NDIM:
            raise TraceShapeError(
                f"{what}: declares {len(shape)} dimensions {_short(shape)}; routes are 3-D (tokens, layers, top_k)"
            )
        rows, layers, top_k = (int(n) for n in shape)
        for value, bound, name in (
            (rows, self.max_rows, "rows"),
            (layers, self.max_layers, "layers"),
            (top_k, self.max_top_k, "top_k"),
        ):
            if value > bound:
                raise PayloadLimitError(
                    f"{what}: declares {_brief(value)} {name} (shape {_short(shape)}), above WireLimits.max_{name}="
                    f"{bound}; refused before allocating. A forged or corrupt header - or raise the limit "
                    f"(limits=WireLimits(max_{name}=...)) if the payload is genuine"
                )
        if rows and (layers == 0 or top_k == 0):
            raise TraceShapeError(
                f"{what}: shape {_short(shape)} has {rows} rows but no layers or no top-k slots; every row "
                "holds L lists of K expert ids"
            )

    def check_model(self, num_layers: int | None, top_k: int | None) -> None:
        """Refuse a caller's num_layers / top_k beyond the bounds (ConfigError: it is an argument)."""
        if num_layers is not None and num_layers > self.max_layers:
            raise ConfigError(
                f"num_layers={num_layers} is above WireLimits.max_layers={self.max_layers}; pass the model's "
                "hidden layer count, or raise the limit"
            )
        if top_k is not None and top_k > self.max_top_k:
            raise ConfigError(
                f"top_k={top_k} is above WireLimits.max_top_k={self.max_top_k}; pass the model's "
                "num_experts_per_tok, or raise the limit"
            )


def _short(shape: Sequence[int]) -> str:
    """A shape for a message, elided when a forged header declares many dims."""
    items = list(shape)
    text = ", ".join(_brief(n) if is_int(n) else str(n) for n in items[:6])
    return f"({text}, ... {len(items)} dims)" if len(items) > 6 else f"({text})"


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (True is an int to Python, never a count to us)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def checked_int(value: Any, name: str, *, minimum: int = 0) -> int:
    """`value` as an int in [minimum, 2**63), or a ConfigError naming the argument and what it got."""
    if not is_int(value):
        raise ConfigError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {_brief(value)}")
    if value < minimum:
        raise ConfigError(f"{name}={_brief(value)} must be >= {minimum}")
    if value > MAX_INT_ARGUMENT:
        raise ConfigError(f"{name}={_brief(value)} does not fit in int64; no count or offset is that large")
    return int(value)


def checked_optional_int(value: Any, name: str, *, minimum: int = 0) -> int | None:
    return None if value is None else checked_int(value, name, minimum=minimum)


def checked_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be True or False, got {type(value).__name__} {_brief(value)}")
    return bool(value)


def checked_layers(value: Any, name: str, limits: WireLimits) -> tuple[int, ...] | None:
    """A sequence of distinct non-negative global layer numbers (or None)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bytearray, dict)) or not isinstance(value, (Sequence, np.ndarray, range)):
        raise ConfigError(f"{name} must be a sequence of global layer numbers, got {type(value).__name__}")
    if len(value) > limits.max_layers:
        raise ConfigError(f"{name} names {len(value)} layers, above WireLimits.max_layers={limits.max_layers}")
    layers = tuple(checked_int(x, f"{name}[{i}]") for i, x in enumerate(value))
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{name}={list(layers)} names a layer twice; global layer numbers are distinct")
    return layers


def checked_sequence_name(value: Any) -> str | int | None:
    """The `sequence=` label of errors: a string, an int, or None."""
    if value is None or isinstance(value, str) or is_int(value):
        return value if not is_int(value) else int(value)
    raise ConfigError(f"sequence must be a str, an int or None, got {type(value).__name__}")


def checked_decoder_args(
    max_bytes: Any, policy_version: Any, validate: Any, sequence: Any
) -> tuple[int, int | None, bool, str | int | None]:
    """The arguments every engine decoder takes, checked in this order: `max_bytes`, `policy_version`,
    `validate` and the `sequence` label of its errors (a ConfigError names the first bad one)."""
    return (
        checked_int(max_bytes, "max_bytes"),
        checked_optional_int(policy_version, "policy_version"),
        checked_bool(validate, "validate"),
        checked_sequence_name(sequence),
    )


def _brief(value: Any) -> str:
    """A short, always-printable picture of a bad argument (never the repr of a huge object)."""
    if is_int(value):
        value = int(value)
        sign = "-" if value < 0 else ""
        return str(value) if value.bit_length() <= 64 else f"<{sign}int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes)):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if value is None or isinstance(value, (bool, float, np.bool_, np.floating)):
        return repr(value)
    return ""


DEFAULT_LIMITS = WireLimits()  # frozen: shared safely as every decoder's default

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
