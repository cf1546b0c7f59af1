"""The buffers a `RankBundle` reads and writes: bytes it owns, and an `out=` checked before it is written.

What was checked is what is decoded. A bundle parses and checks its bytes once, at construction, and
decodes them later; a receive buffer the caller reuses in between (a bytearray refilled by the next
message) would otherwise be decoded as whatever it holds by then, unchecked. So `owned_bytes` keeps
`bytes` (immutable, also behind a memoryview) as they are and copies anything else the caller could
change (bytearray, a writable memoryview, an mmap, a numpy array's buffer) once, before any check.
The copy is one memcpy of the encoded bytes, about 5 bytes a row against 16 decoded (one core of an AMD
EPYC, shared: 0.2-0.6 ms for the 8.1 MB bundle of 32,768 tokens x 48 layers, top-8 of 128, whose decode
takes 23 ms).

`out=` must be memory the decode can write with plain stores and nothing else reads meanwhile:
- a numpy array: C-contiguous, aligned to its item size (the C kernel writes int16 / int32 through
  typed pointers; a view at an odd byte offset is refused, never written unaligned), writable, of the
  bundle's shape and dtype, and not overlapping the bytes being decoded (writing the rows over the
  encoded spans would change what is still to be read);
- a torch tensor: a dense, strided CPU tensor (not nested, sparse or quantized; not a lazy conj/neg view,
  whose memory holds other values than it shows), contiguous, without grad; then as a numpy array.
Each refusal is a `ConfigError` saying what to pass instead.

Legend: P = rows of the rank's layout, L = layers, K = top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from routereplay.errors import ConfigError


def owned_bytes(data: object) -> memoryview:
    """`data` as a flat byte view nobody else can change: immutable `bytes` as they are, anything else copied."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(f"a rank bundle is bytes, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ConfigError(
            f"a rank bundle is one contiguous run of bytes; got a strided memoryview (shape {view.shape}, strides "
            f"{view.strides}): pass the bytes it views in order, e.g. RankBundle(view.tobytes())"
        )
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if isinstance(view.obj, bytes):  # immutable: what is checked now is what decode() reads later
        return flat
    return memoryview(flat.tobytes())  # a buffer the caller may refill: checked and decoded from one copy


def checked_out(out: object, shape: tuple[int, int, int], dtype: np.dtype, data: memoryview) -> np.ndarray:
    """`out` when the decode may write it (module docstring), else a `ConfigError` naming the fault."""
    rows = shape[0]
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        got = f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}".strip()
        if isinstance(out, np.ndarray) and out.shape == shape and out.dtype == dtype:
            got = f"a {dtype} array of that shape that is not C-contiguous (strides {out.strides})"
        raise ConfigError(
            f"out= must be a C-contiguous {dtype} array of shape {shape} (this bundle's rows, layers, top-k), "
            f"got {got}; slice a larger buffer with buffer[:{rows}] or pass no out="
        )
    if not out.flags.writeable:
        raise ConfigError("out= is read-only; pass a writable array (or no out=)")
    if not out.flags.aligned:
        address = out.__array_interface__["data"][0]
        raise ConfigError(
            f"out= starts at address {address:#x}, not a multiple of its {dtype.itemsize}-byte items (a view at an "
            f"odd byte offset, e.g. np.frombuffer(buf, offset=1) or torch.frombuffer(..., offset=1)); allocate it "
            f"with np.empty / torch.empty, or offset the view by a multiple of {dtype.itemsize} bytes"
        )
    if np.may_share_memory(out, np.frombuffer(data, np.uint8)):
        raise ConfigError(
            "out= overlaps the bundle's own bytes: decoding would overwrite the spans it is still reading; pass "
            "an output buffer separate from the received bytes (or no out=)"
        )
    return out


def checked_out_tensor(out: object, shape: tuple[int, int, int], dtype: np.dtype) -> Any:
    """A CPU tensor `out` as the numpy array the decode writes (its memory), or a `ConfigError`."""
    import torch

    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise ConfigError(f"out= must be a CPU torch tensor, got {type(out).__name__}")
    kind = _unusual_kind(out)
    if kind:
        raise ConfigError(
            f"out= is a {kind} tensor; decode writes plain memory: pass a dense tensor such as "
            f"torch.empty({shape}, dtype=torch.{'int16' if dtype.itemsize == 2 else 'int32'}) (or no out=)"
        )
    want = torch.int16 if dtype == np.int16 else torch.int32
    if out.dtype != want or tuple(out.shape) != shape or not out.is_contiguous() or out.requires_grad:
        raise ConfigError(
            f"out= must be a contiguous {want} CPU tensor of shape {shape} without grad, got "
            f"{out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()}); slice a larger buffer "
            f"with buffer[:{shape[0]}] or pass no out="
        )
    return out.numpy()


def _unusual_kind(out: Any) -> str:
    """What keeps `out`'s memory from being a plain array of its values ("" when nothing does)."""
    import torch

    if out.is_nested:
        return "nested"
    if out.layout != torch.strided:
        return f"{out.layout} (not strided)"
    if out.is_quantized:
        return "quantized"
    if out.is_conj():
        return "lazily conjugated (conj view)"
    if out.is_neg():
        return "lazily negated (negative-bit view; .resolve_neg() makes it plain)"
    return ""


__all__ = ["checked_out", "checked_out_tensor", "owned_bytes"]
