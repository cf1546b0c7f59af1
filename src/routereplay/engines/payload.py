"""Turning an engine's wire payload into an integer array, safely.

Covers every container the engines use for routed experts: base64 text, `.npy` bytes (parsed
here with pickle impossible), raw little-endian integer bytes, nested JSON lists, numpy arrays and
torch tensors. Sizes are checked before anything is allocated, so a forged header cannot make us
allocate gigabytes (no decompression bombs).
"""

from __future__ import annotations

import ast
import base64
import binascii
import io
from typing import Any

import numpy as np

from routereplay.errors import (
    ConfigError,
    DtypeError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadSizeError,
    PickleRefusedError,
)

DEFAULT_MAX_BYTES = 4 << 30  # 4 GiB of decoded routes: far above any real sequence
NPY_MAGIC = b"\x93NUMPY"
_PICKLE_PROTOCOL_OPCODE = 0x80
_NPY_HEADER_MAX = 65535 + 12

_MISSING = object()


def get_field(obj: Any, name: str, default: Any = _MISSING) -> Any:
    """`obj[name]` for mappings, `obj.name` for objects (engine output classes); `default` if absent."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def has_field(obj: Any, name: str) -> bool:
    return get_field(obj, name) is not _MISSING


def pick(items: Any, index: int, name: str, what: str) -> Any:
    """`items[index]` of a response's list field, with a named error for a non-list or a bad index."""
    if not isinstance(items, (list, tuple)):
        raise PayloadEncodingError(f"{what}: field '{name}' should be a list, got {type(items).__name__}")
    if not 0 <= index < len(items):
        raise ConfigError(f"{name} index {index} is out of range: the response holds {len(items)}")
    return items[index]


def mapping(value: Any, name: str, what: str) -> dict[str, Any]:
    """A response field that must be a JSON object."""
    if not isinstance(value, dict):
        raise PayloadEncodingError(f"{what}: field '{name}' should be an object, got {type(value).__name__}")
    return value


def is_array_like(value: Any) -> bool:
    """numpy arrays and torch tensors (detected without importing torch)."""
    return isinstance(value, np.ndarray) or (hasattr(value, "detach") and hasattr(value, "numpy"))


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return value.detach().cpu().numpy()  # torch.Tensor


def require_present(value: Any, what: str, hint: str) -> Any:
    """Raise MissingRoutesError for a `None` payload (aborted request or capture switched off)."""
    if value is None:
        raise MissingRoutesError(f"{what} is None: {hint}")
    return value


def b64_to_bytes(text: str | bytes | bytearray, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Strict base64 decoding with the decoded size bounded before decoding."""
    if isinstance(text, str):
        try:
            raw_text = text.encode("ascii")
        except UnicodeEncodeError as exc:
            raise PayloadEncodingError(
                f"{what}: base64 text holds a non-ASCII character at offset {exc.start}; the payload "
                "was corrupted in transit (check the HTTP client's decoding)"
            ) from None
    else:
        raw_text = bytes(text)
    raw_text = raw_text.strip()
    if len(raw_text) // 4 * 3 > max_bytes:
        raise PayloadSizeError(
            f"{what}: base64 text of {len(raw_text)} chars would decode to more than max_bytes="
            f"{max_bytes}; refusing to allocate. Raise max_bytes if this payload is genuine"
        )
    try:
        return base64.b64decode(raw_text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadEncodingError(
            f"{what}: corrupt or truncated base64 ({exc}); {len(raw_text)} chars received - a "
            "truncated HTTP body, or a proxy that rewrote the JSON string"
        ) from None


def load_npy(data: bytes, what: str) -> np.ndarray:
    """Parse `.npy` bytes (as written by `np.save`) without ever unpickling.

    The header is read with a literal parser, the declared size is checked against the bytes that
    follow before any allocation, and object dtypes (which would need pickle) are refused.
    """
    if not data.startswith(NPY_MAGIC):
        if data[:1] and data[0] == _PICKLE_PROTOCOL_OPCODE:
            raise PickleRefusedError(
                f"{what}: the payload is a Python pickle, not a .npy array; routereplay never "
                "unpickles engine payloads. Send routes with np.save (vLLM >= 0.22 does)"
            )
        raise PayloadEncodingError(
            f"{what}: not a .npy payload (starts with {data[:8]!r}, expected {NPY_MAGIC!r}); "
            "vLLM >= 0.22 sends base64 of np.save bytes. Raw int32 bytes are SGLang's format: use "
            "decode_sglang"
        )
    if len(data) < 10:
        raise PayloadEncodingError(f"{what}: .npy payload truncated inside its header ({len(data)} bytes)")
    major = data[6]
    if major == 1:
        header_len, offset = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        header_len, offset = int.from_bytes(data[8:12], "little"), 12
    else:
        raise PayloadEncodingError(f"{what}: unknown .npy format version {major}.{data[7]}")
    if header_len > _NPY_HEADER_MAX or offset + header_len > len(data):
        raise PayloadEncodingError(
            f"{what}: .npy header claims {header_len} bytes but only {len(data) - offset} follow: truncated"
        )
    try:
        header = ast.literal_eval(data[offset : offset + header_len].decode("latin1" if major < 3 else "utf8"))
        descr, fortran, shape = header["descr"], bool(header["fortran_order"]), tuple(int(n) for n in header["shape"])
        dtype = np.dtype(np.lib.format.descr_to_dtype(descr))
    except Exception as exc:  # any malformed header (syntax, keys, dtype) is a corrupt payload
        raise PayloadEncodingError(f"{what}: malformed .npy header ({type(exc).__name__}: {exc})") from None
    if dtype.hasobject:
        raise PickleRefusedError(
            f"{what}: .npy payload has object dtype {dtype}, which only a pickle can restore; "
            "refused (routes are plain integers)"
        )
    if dtype.kind not in "iu" or dtype.itemsize > 8:
        raise DtypeError(
            f"{what}: .npy payload has dtype {dtype}; routed experts are integers "
            "(vLLM sends uint8 when E <= 256, else uint16)"
        )
    if any(n < 0 for n in shape):
        raise PayloadEncodingError(f"{what}: .npy header declares a negative shape {shape}")
    count = int(np.prod(shape, dtype=object))
    body = len(data) - offset - header_len
    if count * dtype.itemsize != body:
        raise PayloadSizeError(
            f"{what}: .npy header declares shape {shape} of {dtype} = {count * dtype.itemsize} bytes, "
            f"but {body} bytes follow: truncated or padded payload"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset + header_len)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return np.ascontiguousarray(array)


def npy_bytes(array: np.ndarray) -> bytes:
    """`.npy` bytes of an array, exactly as `np.save` writes them (what vLLM >= 0.22 sends)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def raw_to_array(data: bytes, dtype: np.dtype[Any], num_layers: int, top_k: int, what: str) -> np.ndarray:
    """Flattened little-endian integers (SGLang) -> (T, L, K), checking the byte length first."""
    row_bytes = num_layers * top_k * dtype.itemsize
    if len(data) % row_bytes:
        fits = [
            str(np.dtype(d))
            for d in ("int32", "uint16", "uint8")
            if len(data) % (num_layers * top_k * np.dtype(d).itemsize) == 0
        ]
        hint = f"; the length would fit dtype {', '.join(fits)}" if fits else ""
        raise PayloadSizeError(
            f"{what}: {len(data)} bytes is not a multiple of num_layers({num_layers}) x top_k({top_k}) x "
            f"{dtype.itemsize} bytes ({dtype}) = {row_bytes}{hint}. Check num_layers (all hidden "
            "layers), top_k and routed_experts_dtype"
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(-1, num_layers, top_k)


def lists_to_array(value: Any, what: str) -> np.ndarray:
    """Nested JSON lists -> integer array; ragged or non-integer lists are refused."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise PayloadEncodingError(
            f"{what}: nested lists are ragged or hold non-integers ({type(exc).__name__}); every row must hold "
            "L lists of K ids"
        ) from None
    if array.dtype.kind == "O":
        raise PayloadEncodingError(f"{what}: nested lists are ragged or mix types; expected [T][L][K] ints")
    if array.size and array.dtype.kind not in "iu":
        raise DtypeError(f"{what}: nested lists hold {array.dtype} values; routed experts are integers")
    if not array.size:
        array = array.astype(np.int64)
    return array


def dtype_named(name: Any, what: str) -> np.dtype[Any]:
    """A dtype from a name an engine sends (`routed_experts_dtype`), restricted to integer types."""
    try:
        dtype = np.dtype(str(name).removeprefix("torch."))
    except (TypeError, ValueError):
        raise DtypeError(f"{what}: unknown routed_experts_dtype {name!r}; expected int32, uint16 or uint8") from None
    if dtype.kind not in "iu":
        raise DtypeError(f"{what}: routed_experts_dtype {name!r} is not an integer type")
    return dtype


__all__ = [
    "DEFAULT_MAX_BYTES",
    "b64_to_bytes",
    "dtype_named",
    "get_field",
    "has_field",
    "is_array_like",
    "lists_to_array",
    "load_npy",
    "mapping",
    "npy_bytes",
    "pick",
    "raw_to_array",
    "require_present",
    "to_numpy",
]
