"""A route store from the outside: its file envelope (hostile header JSON under a valid CRC is a
`StoreHeaderError`), snapshots saved while another thread adds turns, the verl #6029 prefix re-sent
after a weight update named, and a saved file's mode and a killed writer's temporary."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteStore, RouteTrace
from routereplay.errors import RowCountError, StoreHeaderError
from tests.store.test_hostile import container
from tests.wire.payloads import distinct_routes


def test_the_forged_envelope_is_a_real_stores() -> None:
    """The forged envelope is the real one (an empty store round-trips)."""
    real = RouteStore().to_bytes()
    header = json.dumps({"geometry": None, "samples": []}).encode()
    assert RouteStore.from_bytes(container(header)).stats() == RouteStore.from_bytes(real).stats()


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
def test_non_finite_deep_or_huge_header_json_is_a_store_header_error(header: bytes) -> None:
    """RouteStore.from_bytes with a valid
    envelope and CRC but Infinity / NaN / deep nesting / huge numbers in the header raises
    StoreHeaderError, not OverflowError / RecursionError / ValueError."""
    with pytest.raises(StoreHeaderError):
        RouteStore.from_bytes(container(header))


def test_snapshots_taken_while_another_thread_adds_turns_load_back() -> None:
    """RouteStore.to_bytes running while another thread calls add_turn
    never raises 'dictionary changed size', and every saved snapshot loads back."""
    rng = np.random.default_rng(1)
    store = RouteStore()
    routes = [distinct_routes(rng, 4, 2, 2, 8).astype(np.int16) for _ in range(8)]
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


def test_a_prefix_resent_after_a_weight_update_is_named() -> None:
    """A resumed rollout after a weight update re-sends its prefix
    (routed differently by the new weights) and the engine concatenates old rows + full re-send; the
    store names the duplicated prefix (verl #6029) instead of a generic RowCountError."""
    rng = np.random.default_rng(2)
    store = RouteStore()
    tokens = list(range(100, 120))
    first = distinct_routes(rng, 9, 2, 2, 16).astype(np.int16)
    store.add_turn("s", tokens[:10], RouteTrace(first, 16), policy_version=0)
    resent = distinct_routes(rng, 19, 2, 2, 16).astype(np.int16)
    assert not np.array_equal(resent[:9], first)
    with pytest.raises(RowCountError, match=r"(?s)9 extra rows.*already holds.*6029") as info:
        store.add_turn("s", tokens, RouteTrace(np.concatenate([first, resent]), 16), policy_version=1)
    assert type(info.value).__name__ == "DuplicatedPrefixError"
    assert store.tokens("s") == tokens[:10]


def test_a_saved_store_follows_the_umask_and_clears_a_killed_writers_temporary(tmp_path: Path) -> None:
    """A saved store is created with the umask's
    mode (not 0600), and a temp file left by a killed earlier save of the same target is removed by
    the next save."""
    rng = np.random.default_rng(3)
    store = RouteStore()
    store.add_turn("s", list(range(5)), RouteTrace(distinct_routes(rng, 4, 2, 2, 8).astype(np.int16), 8))
    target = tmp_path / "routes.rrs"
    old = os.umask(0o022)
    try:
        store.save(target)
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    before = set(os.listdir(tmp_path))
    # simulate a save killed mid-write: run a real save in a child that is SIGKILLed while writing
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
