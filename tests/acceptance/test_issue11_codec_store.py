"""Acceptance tests for issue 11, codec and store (items 3 (store part), 5, 6, 7, 11, 18, 22), public API only."""

from __future__ import annotations

import json
import os
import stat
import struct
import threading
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteStore, RouteTrace, decode, encode
from routereplay.codec.limits import CodecLimits
from routereplay.errors import CodecError, CodecLimitError, RowCountError, StoreHeaderError

MEMORY_BOUND = 64 << 20

# The codec's version 1 layout as its module docstring documents it (forged from outside).
FIXED = struct.Struct("<4sBBBBQIHIQ")  # magic, version, mode, flags, reserved, T, L, K, E, start
SEGMENT = struct.Struct("<QQqH")
LENGTHS = struct.Struct("<QQ")
SET, ORDERED, FLAG_ZSTD = 0, 1, 1


def forge(
    *, T: int, L: int, K: int, E: int, mode: int, flags: int = 0, payload: bytes = b"", raw: int | None = None
) -> bytes:
    body = FIXED.pack(b"RRTC", 1, mode, flags, 0, T, L, K, E, 0)
    body += struct.pack(f"<{L}I", *range(L))
    body += struct.pack("<I", 1) + SEGMENT.pack(0, T, -1, 0)
    body += LENGTHS.pack(len(payload) if raw is None else raw, len(payload)) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def peak_of(call):
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def distinct(rng: np.random.Generator, T: int, L: int, K: int, E: int) -> np.ndarray:
    return np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)


# -- item 5 ---------------------------------------------------------------------------------------
def test_item5_88_byte_ordered_e1_blob_declaring_1e8_rows() -> None:
    """Issue 11 item 5 (resource exhaustion): an 88-byte codec blob, ordered mode with E = 1 (0 bits per
    row), declaring 1e8 rows is refused with CodecLimitError before the 954 MiB output is allocated."""
    blob = forge(T=10**8, L=1, K=1, E=1, mode=ORDERED)
    assert len(blob) == 88
    result, peak = peak_of(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert peak < MEMORY_BOUND


def test_item5_set_mode_k_equals_e_and_t_2_pow_32() -> None:
    """Issue 11 item 5 (resource exhaustion): set mode with K = E (0 bits per row) and T = 2**32 rows is
    refused with CodecLimitError within a small memory bound (it asked for 32 GiB)."""
    blob = forge(T=2**32, L=1, K=4, E=4, mode=SET)
    result, peak = peak_of(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert peak < MEMORY_BOUND


def test_item5_small_zero_bit_blob_within_limits_decodes() -> None:
    """Issue 11 item 5 (guard): a legitimate small E = 1 trace still round-trips."""
    trace = RouteTrace(np.zeros((5, 2, 1), dtype=np.int16), 1)
    assert decode(encode(trace, mode="ordered")) == trace


# -- item 6 ---------------------------------------------------------------------------------------
def test_item6_set_mode_e_k_2000_in_88_bytes() -> None:
    """Issue 11 item 6 (resource exhaustion): set mode with E = K = 2000 in a tiny blob is refused by the
    set-table limit (CodecLimitError naming max_set_table), not decoded for 11-21 s of CPU."""
    blob = forge(T=1, L=1, K=2000, E=2000, mode=SET)
    assert len(blob) == 88
    with pytest.raises(CodecLimitError, match="max_set_table"):
        decode(blob)


# -- item 7 ---------------------------------------------------------------------------------------
def test_item7_zstd_frame_claiming_2_56_gib_refused_before_allocation() -> None:
    """Issue 11 item 7 (resource exhaustion): a zstd payload that claims 2.56 GiB raw is refused with a
    CodecError, not a MemoryError, and nothing near its size is allocated - also with every limit raised."""
    zstd = pytest.importorskip("zstandard")
    frame = zstd.ZstdCompressor().compress(b"\0" * 4096)
    claimed = int(2.56 * (1 << 30))
    T = claimed // 8  # ordered mode, E = 256: 8 bits per id, K = L = 1
    blob = forge(T=T, L=1, K=1, E=256, mode=ORDERED, flags=FLAG_ZSTD, payload=frame, raw=claimed)
    for limits in (None, CodecLimits(max_entries=2**40, max_expansion=2**40)):
        result, peak = peak_of(lambda limits=limits: decode(blob, limits=limits))
        assert isinstance(result, CodecError), result
        assert peak < MEMORY_BOUND


def test_item7_genuine_zstd_bomb_made_by_encode_is_refused_and_limit_adjustable() -> None:
    """Issue 11 item 7 (resource exhaustion): a genuine bomb within the old defaults - an encode(compress=
    True) trace of almost only -1 rows, a few hundred bytes expanding to 16 MiB - is refused by the
    documented max_expansion limit; raising that limit decodes it exactly."""
    pytest.importorskip("zstandard")
    experts_TLK = np.full((1 << 18, 4, 8), -1, dtype=np.int16)
    experts_TLK[0] = np.arange(8)
    trace = RouteTrace(experts_TLK, 64)
    blob = encode(trace, mode="ordered", compress=True)
    assert len(blob) * 4096 < experts_TLK.nbytes
    result, peak = peak_of(lambda: decode(blob))
    assert isinstance(result, CodecLimitError), result
    assert "max_expansion" in str(result)
    assert peak < MEMORY_BOUND
    assert decode(blob, limits=CodecLimits(max_expansion=1 << 20)) == trace


def test_item7_intermediates_bounded_for_a_real_trace() -> None:
    """Issue 11 item 7 (resource exhaustion): decoding a real 8 MiB trace peaks at a small multiple of its
    output, not 4-5x the ids in intermediates."""
    rng = np.random.default_rng(0)
    trace = RouteTrace(distinct(rng, 1 << 14, 32, 8, 64), 64)
    blob = encode(trace, mode="ordered")
    result, peak = peak_of(lambda: decode(blob))
    assert result == trace
    assert peak < 2 * trace.experts.nbytes + (24 << 20)


# -- item 11 --------------------------------------------------------------------------------------
def _store_blob(header: bytes, data: bytes = b"") -> bytes:
    body = struct.pack("<4sB3xQQ", b"RRST", 1, len(header), len(data)) + header + data
    return body + struct.pack("<I", zlib.crc32(body))


def test_item11_store_layout_matches_a_real_store() -> None:
    """Issue 11 item 11 (guard): the forged envelope is the real one (an empty store round-trips)."""
    real = RouteStore().to_bytes()
    header = json.dumps({"geometry": None, "samples": []}).encode()
    assert RouteStore.from_bytes(_store_blob(header)).stats() == RouteStore.from_bytes(real).stats()


@pytest.mark.parametrize(
    "header",
    [
        b'{"geometry": {"num_experts": Infinity, "layers": [0], "top_k": 2}, "samples": []}',
        b'{"geometry": null, "samples": [], "x": -Infinity}',
        b'{"geometry": null, "samples": [], "x": NaN}',
        b'{"geometry": null, "samples": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"geometry": {"num_experts": ' + b"9" * 5000 + b', "layers": [0], "top_k": 2}, "samples": []}',
        b'{"geometry": {"num_experts": 1e400, "layers": [0], "top_k": 2}, "samples": []}',
    ],
    ids=["inf", "neg_inf", "nan", "deep", "long_int", "huge_float"],
)
def test_item11_store_header_hostile_json_with_valid_crc(header: bytes) -> None:
    """Issue 11 item 11 (error that is not a RouteReplayError): RouteStore.from_bytes with a valid
    envelope and CRC but Infinity / NaN / deep nesting / huge numbers in the header raises
    StoreHeaderError, not OverflowError / RecursionError / ValueError."""
    with pytest.raises(StoreHeaderError):
        RouteStore.from_bytes(_store_blob(header))


# -- item 3 (store part) --------------------------------------------------------------------------
def test_item3_to_bytes_concurrent_with_add_turn() -> None:
    """Issue 11 item 3 (concurrency): RouteStore.to_bytes running while another thread calls add_turn
    never raises 'dictionary changed size', and every saved snapshot loads back."""
    rng = np.random.default_rng(1)
    store = RouteStore()
    routes = [distinct(rng, 4, 2, 2, 8) for _ in range(8)]
    failures: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(1500):
                store.add_turn(f"s{i}", list(range(5)), RouteTrace(routes[i % 8], 8))
        except BaseException as exc:
            failures.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    snapshots = 0
    try:
        while not done.is_set() or snapshots == 0:
            data = store.to_bytes()
            loaded = RouteStore.from_bytes(data)
            for key in ("s0", "s1", "s2"):
                if key in loaded:
                    assert loaded.trace(key) == store.trace(key)
            snapshots += 1
    finally:
        thread.join()
    assert not failures, failures
    assert RouteStore.from_bytes(store.to_bytes()).stats() == store.stats()


# -- item 22 --------------------------------------------------------------------------------------
def test_item22_verl_6029_prefix_resent_after_weight_update() -> None:
    """Issue 11 item 22 (misleading message): a resumed rollout after a weight update re-sends its prefix
    (routed differently by the new weights) and the engine concatenates old rows + full re-send; the
    store names the duplicated prefix (verl #6029) instead of a generic RowCountError."""
    rng = np.random.default_rng(2)
    store = RouteStore()
    tokens = list(range(100, 120))
    first = distinct(rng, 9, 2, 2, 16)
    store.add_turn("s", tokens[:10], RouteTrace(first, 16), policy_version=0)
    resent = distinct(rng, 19, 2, 2, 16)
    assert not np.array_equal(resent[:9], first)
    with pytest.raises(RowCountError, match=r"(?s)9 extra rows.*already holds.*6029") as info:
        store.add_turn("s", tokens, RouteTrace(np.concatenate([first, resent]), 16), policy_version=1)
    assert type(info.value).__name__ == "DuplicatedPrefixError"
    assert store.tokens("s") == tokens[:10]


# -- item 18 --------------------------------------------------------------------------------------
def test_item18_saved_store_follows_umask_and_stale_temps_are_cleaned(tmp_path: Path) -> None:
    """Issue 11 item 18 (data loss / resource exhaustion): a saved store is created with the umask's
    mode (not 0600), and a temp file left by a killed earlier save of the same target is removed by
    the next save."""
    rng = np.random.default_rng(3)
    store = RouteStore()
    store.add_turn("s", list(range(5)), RouteTrace(distinct(rng, 4, 2, 2, 8), 8))
    target = tmp_path / "routes.rrs"
    old = os.umask(0o022)
    try:
        store.save(target)
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    before = set(os.listdir(tmp_path))
    # simulate a save killed mid-write: run a real save in a child that is SIGKILLed while writing
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, numpy as np\n"
        "import routereplay.atomicfile as a\n"
        "from routereplay import RouteStore, RouteTrace\n"
        "real = os.replace\n"
        "def die(*args, **kw): os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.replace = die\n"
        "s = RouteStore()\n"
        "rows = np.tile(np.array([[0, 1], [2, 3]], dtype=np.int16), (4, 1, 1))\n"
        "s.add_turn('s', list(range(5)), RouteTrace(rows, 8))\n"
        f"s.save({str(target)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False)
    assert proc.returncode == -signal.SIGKILL
    leftovers = set(os.listdir(tmp_path)) - before
    assert leftovers, "the kill should have left a temporary beside the target"
    store.save(target)
    assert set(os.listdir(tmp_path)) == before, "the next save removes the killed writer's temporary"
    assert RouteStore.load(target).stats() == store.stats()
