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
    AmbiguousChoiceError,
    ConfigError,
    DtypeError,
    MissingRoutesError,
    PayloadEncodingError,
    PayloadSizeError,
    PickleRefusedError,
)
from routereplay.trace.validation import overflow_span
from routereplay.wire.limits import DEFAULT_LIMITS, WIRE_INT_DTYPES, WireLimits, is_int

try:  # the optional C kernel of strict base64 (built at install; see setup.py)
    from routereplay.wire import _base64_kernel as BASE64_KERNEL  # type: ignore[attr-defined]
except ImportError:
    BASE64_KERNEL = None

DEFAULT_MAX_BYTES = 4 << 30  # 4 GiB of decoded routes: far above any real sequence
NPY_MAGIC = b"\x93NUMPY"
_PICKLE_PROTOCOL_OPCODE = 0x80
_NPY_HEADER_MAX = 65535 + 12

_MISSING = object()
_SEQUENCES = (list, tuple, str, bytes, bytearray)  # their `.index` is a method, not a choice number


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


def pick_choice(choices: Any, choice: int, what: str) -> Any:
    """The choice numbered `choice` of an OpenAI-style response (or `RequestOutput.outputs`).

    Choices that carry an `index` field are matched by it, so a list that a gateway (or the
    engine's completion order) reordered still yields the asked sample; a list without index fields
    is read by position. Duplicate, missing or non-integer indices are refused: picking by position
    there could hand back another sample's routes with no error.
    """
    if not isinstance(choices, (list, tuple)):
        raise PayloadEncodingError(f"{what}: field 'choices' should be a list, got {type(choices).__name__}")
    indices = [None if isinstance(c, _SEQUENCES) else get_field(c, "index", None) for c in choices]
    if all(i is None for i in indices):
        return pick(choices, choice, "choices", what)
    numbers = [int(i) for i in indices if i is not None and is_int(i)]
    if len(numbers) != len(indices):
        raise AmbiguousChoiceError(
            f"{what}: some choices carry no integer index field, so choice {choice} cannot be matched; pass "
            "the untouched response"
        )
    matches = [c for c, i in zip(choices, numbers, strict=True) if i == choice]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(
            f"choices index {choice} is out of range: the response holds {len(choices)} (indices {sorted(numbers)[:8]})"
        )
    raise AmbiguousChoiceError(
        f"{what}: {len(matches)} choices carry index {choice}; which one is the asked sample cannot be told"
    )


def mapping(value: Any, name: str, what: str) -> dict[str, Any]:
    """A response field that must be a JSON object."""
    if not isinstance(value, dict):
        raise PayloadEncodingError(f"{what}: field '{name}' should be an object, got {type(value).__name__}")
    return value


def is_array_like(value: Any) -> bool:
    """numpy arrays and torch tensors (detected without importing torch)."""
    return isinstance(value, np.ndarray) or (hasattr(value, "detach") and hasattr(value, "numpy"))


def require_present(value: Any, what: str, hint: str) -> Any:
    """Raise MissingRoutesError for a `None` payload (aborted request or capture switched off)."""
    if value is None:
        raise MissingRoutesError(f"{what} is None: {hint}")
    return value


def b64_to_bytes(text: str | bytes | bytearray, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Strict base64 decoding with the decoded size bounded before decoding.

    With the C kernel (`wire/base64_kernel.c`), text it accepts (no whitespace, the alphabet, '=' only
    as the last one or two characters) is decoded there, without copying a str; everything else takes
    the path below, which names the fault. Both give the same bytes."""
    if BASE64_KERNEL is not None and isinstance(text, (str, bytes)) and len(text) // 4 * 3 <= max_bytes:
        fast = BASE64_KERNEL.decode(text)
        if fast is not None:
            return bytes(fast)
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
    if raw_text[:1] in (b"{", b"[", b'"'):  # never base64: those characters are outside its alphabet
        raise PayloadEncodingError(
            f"{what}: got JSON text ({len(raw_text)} chars starting {raw_text[:20]!r}), not base64 routes; "
            "pass the parsed JSON (json.loads(text), or response.json()) - the decoder finds the field itself"
        )
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


def load_npy(data: bytes, what: str, limits: WireLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Parse `.npy` bytes (as written by `np.save`) of a (T, L, K) route array without ever unpickling.

    The header is read with a literal parser and checked field by field: a 3-D shape of plain ints
    within `limits`, an integer dtype, the declared size equal to the bytes that follow. All of it
    happens before any allocation, so a forged header costs nothing; object dtypes (which would
    need pickle) are refused.
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
    descr, fortran, shape = _npy_header(data[offset : offset + header_len], major, what)
    try:
        dtype = np.dtype(np.lib.format.descr_to_dtype(descr))
    except Exception as exc:  # any malformed descr (numpy raises several types) is a corrupt payload
        raise PayloadEncodingError(f"{what}: malformed .npy dtype {str(descr)[:40]!r} ({type(exc).__name__})") from None
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
    limits.check_shape(shape, f"{what}: .npy header")
    count = shape[0] * shape[1] * shape[2]
    body = len(data) - offset - header_len
    if count * dtype.itemsize != body:
        raise PayloadSizeError(
            f"{what}: .npy header declares shape {shape} of {dtype} = {count * dtype.itemsize} bytes, "
            f"but {body} bytes follow: truncated or padded payload"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset + header_len)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return np.ascontiguousarray(array)


def _npy_header(raw: bytes, major: int, what: str) -> tuple[Any, bool, tuple[int, ...]]:
    """The (descr, fortran_order, shape) of a `.npy` header, each checked for its exact type."""
    try:
        header = ast.literal_eval(raw.decode("latin1" if major < 3 else "utf8"))
    except Exception as exc:  # syntax, nesting depth, a 5000-digit literal: all a corrupt header
        raise PayloadEncodingError(f"{what}: malformed .npy header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        keys = sorted(map(str, header))[:5] if isinstance(header, dict) else type(header).__name__
        raise PayloadEncodingError(
            f"{what}: malformed .npy header: expected the keys descr, fortran_order, shape; got {keys}"
        )
    shape, fortran = header["shape"], header["fortran_order"]
    if not isinstance(shape, tuple) or not all(is_int(n) for n in shape):
        raise PayloadEncodingError(f"{what}: malformed .npy header: shape {str(shape)[:60]} is not a tuple of ints")
    if any(n < 0 for n in shape):
        raise PayloadEncodingError(f"{what}: .npy header declares a negative shape {str(shape)[:60]}")
    if not isinstance(fortran, bool):
        raise PayloadEncodingError(f"{what}: malformed .npy header: fortran_order {str(fortran)[:20]!r} is not a bool")
    return header["descr"], fortran, shape


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
        raise PayloadEncodingError(
            f"{what}: nested lists are ragged, mix types, or hold integers beyond 64 bits; expected [T][L][K] ints"
        )
    if array.size and array.dtype.kind not in "iu":
        raise DtypeError(f"{what}: nested lists hold {array.dtype} values; routed experts are integers")
    if not array.size:
        array = array.astype(np.int64)
    return array


def dtype_named(name: Any, what: str) -> np.dtype[Any]:
    """A dtype from a name an engine sends (`routed_experts_dtype`), restricted to `WIRE_INT_DTYPES`."""
    if isinstance(name, np.dtype):
        name = name.name
    elif isinstance(name, type) and issubclass(name, np.generic):
        name = np.dtype(name).name
    if not isinstance(name, str):
        raise DtypeError(
            f"{what}: routed_experts_dtype must be a dtype name, got {type(name).__name__}; expected one of "
            f"{', '.join(sorted(WIRE_INT_DTYPES))}"
        )
    text = name.removeprefix("torch.")
    if text not in WIRE_INT_DTYPES:
        kind = "is not an integer type" if text in _NON_INT_DTYPES else "is not a dtype name this release accepts"
        raise DtypeError(
            f"{what}: routed_experts_dtype {name[:40]!r} {kind}; expected one of {', '.join(sorted(WIRE_INT_DTYPES))}"
        )
    return np.dtype(text)


_NON_INT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "bool", "object", "complex64", "complex128"})
NDARRAY_TAG = "ndarray"  # Megatron's serialize_ndarray wrapper: ["ndarray", {"data": [...], "dtype": "int16"}]


def is_ndarray_wrapper(value: Any) -> bool:
    """Whether `value` is tagged as Megatron's serialised ndarray (well-formed or not)."""
    return (
        isinstance(value, (list, tuple)) and len(value) >= 1 and isinstance(value[0], str) and value[0] == NDARRAY_TAG
    )


def unwrap_ndarray(value: Any, what: str) -> np.ndarray:
    """`["ndarray", {"data": nested lists, "dtype": name}]` -> the array, dtype checked and enforced.

    Megatron-LM's inference server (0.20, `InferenceClient(deserialize=False)`) sends numpy fields
    this way. The dtype name must be in `WIRE_INT_DTYPES`, and every value must fit it.
    """
    if len(value) != 2 or not isinstance(value[1], dict):
        raise PayloadEncodingError(
            f'{what}: malformed ["ndarray", ...] wrapper of {len(value)} items; expected '
            '["ndarray", {"data": [...], "dtype": "int16"}] (Megatron serialize_ndarray)'
        )
    body = value[1]
    if set(body) != {"data", "dtype"}:
        raise PayloadEncodingError(
            f'{what}: ["ndarray", {{...}}] wrapper has keys {sorted(map(str, body))[:5]}; expected exactly '
            "data and dtype"
        )
    dtype = dtype_named(body["dtype"], f"{what} (ndarray wrapper)")
    if not isinstance(body["data"], list):
        raise PayloadEncodingError(
            f"{what}: ndarray wrapper data is {type(body['data']).__name__}; expected nested lists [T][L][K]"
        )
    array = lists_to_array(body["data"], what)
    span = overflow_span(array, dtype)
    if span is not None:
        held = span[0] if span[0] < np.iinfo(dtype).min else span[1]
        raise DtypeError(
            f"{what}: ndarray wrapper declares dtype {dtype} but holds {held}, "
            "outside its range; the wrapper was altered in transit"
        )
    return array.astype(dtype, copy=False)


def to_numpy(value: Any) -> np.ndarray:
    """An ndarray as is; a torch tensor copied to host memory (named error where that is impossible)."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return value.detach().cpu().numpy()  # torch.Tensor
    except Exception as exc:  # meta tensors, tensors of types numpy lacks (bfloat16), fake tensors
        raise PayloadEncodingError(
            f"routes tensor (dtype {getattr(value, 'dtype', '?')}, device {getattr(value, 'device', '?')}) cannot "
            f"be read on the host ({type(exc).__name__}); pass a materialised integer tensor"
        ) from None


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
