"""`DeliveryJob`: one batch's routes delivered to every rank of a real gloo job, compact vs dense.

`world` processes are started on this machine (forked from a fresh forkserver; torch.distributed,
gloo, TCP on 127.0.0.1, one intra-op thread each). Rank 0 holds the batch; every rank knows only its
own layout plan. Two ways to get each rank its replay-ready (P, L, K) rows are timed, alternating
which goes first from repeat to repeat, each after a barrier:

- `compact`: `scatter_bundles` of the per-rank `RankBundle` bytes (`bundles_for`), then the rank
  decodes its bundle (`RankBundle(...).to_torch()`);
- `dense`: `broadcast_dense` of the whole padded [B, S, L, K] int16 batch (what verl ships), then the
  rank gathers its rows with its plan (`layout.plan.gather`).

Before timing, each rank checks that both give it the same rows. A repeat's time is its slowest
rank's (the step waits for it); `collective` is the send alone, `to_rows` the send plus the rank's
own work. A rank that fails ends the job: the others are stopped and the error is raised with the
failing rank's traceback.

Legend: B = samples, S = padded positions, L = layers, K = top-k, P = rows of one rank's layout.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# what the forkserver imports once, before it forks the ranks (not __main__: the CLI or pytest)
PRELOAD = (
    "torch",
    "torch.distributed",
    "routereplay.transport.bundle",
    "routereplay.layout.plan",
    "routereplay.transport",
)
STARTUP_TIMEOUT_S = 120.0  # starting the forkserver (it imports torch) and the ranks, on a busy 2-core machine
METHODS = ("compact", "dense")
STAGES = ("collective", "to_rows")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTask:
    """What rank `rank` is given: the batch only on the source rank, its own plan everywhere."""

    rank: int
    world: int
    port: int
    repeats: int
    timeout_s: float
    plan_P: torch.Tensor
    shape: tuple[int, int, int, int]
    bundles_N: torch.Tensor | None = None  # every bundle's bytes back to back (uint8, in shared memory)
    sizes: tuple[int, ...] = ()
    routes_BSLK: torch.Tensor | None = None

    def bundles(self) -> list[bytes] | None:
        """The bundles as the source rank holds them (bytes), None on the other ranks."""
        if self.bundles_N is None:
            return None
        data = self.bundles_N.numpy().tobytes()
        offsets = [0, *itertools.accumulate(self.sizes)]
        return [data[a:b] for a, b in itertools.pairwise(offsets)]


@dataclass(frozen=True, slots=True)
class DeliveryJob:
    """The batch at rank 0 and each rank's plan; `run()` starts the ranks and returns their timings."""

    bundles: list[bytes]
    routes_BSLK: torch.Tensor
    plans: list[torch.Tensor]
    repeats: int
    timeout_s: float = 300.0

    def run(self, report: Callable[[str], None] | None = None) -> dict[str, Any]:
        """{"seconds": {method: {stage: [slowest rank's seconds per repeat]}}, "bytes_received": {method:
        [bytes per rank]}, "world": ranks}."""
        report = report or (lambda _step: None)
        world = len(self.plans)
        # forkserver: one fresh server imports torch once and forks every rank (4 spawned interpreters would
        # each import torch: seconds on 2 cores); forked from a clean process, not from this one
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        results = context.Queue()
        port = _free_port()
        # big inputs go as tensors (shared memory, a small handle through the start pipe): a child that dies
        # before reading its pipe would leave `start()` blocked on writing more than the pipe holds
        sizes = tuple(len(b) for b in self.bundles)
        bundles_N = torch.frombuffer(bytearray(b"".join(self.bundles)), dtype=torch.uint8)
        processes = []
        for rank in range(world):
            task = RankTask(
                rank=rank,
                world=world,
                port=port,
                repeats=self.repeats,
                timeout_s=self.timeout_s,
                plan_P=self.plans[rank],
                shape=tuple(self.routes_BSLK.shape),  # type: ignore[arg-type]
                bundles_N=bundles_N if rank == 0 else None,
                sizes=sizes if rank == 0 else (),
                routes_BSLK=self.routes_BSLK if rank == 0 else None,
            )
            processes.append(context.Process(target=rank_main, args=(task, results), daemon=True))
        report(f"starting {world} gloo ranks")
        try:
            for process in processes:
                process.start()
            records = _collect(results, processes, self.timeout_s + STARTUP_TIMEOUT_S)
        except BaseException:  # the other ranks would wait in a collective until the group's timeout
            for process in processes:
                if process.is_alive():
                    process.terminate()
            raise
        finally:
            for process in processes:
                if process.pid is not None:
                    process.join(timeout=30)
                    if process.is_alive():
                        process.kill()
                        process.join()
        return _combine(records, world)


def _collect(results: Any, processes: list[Any], timeout_s: float) -> dict[int, dict[str, Any]]:
    """Every rank's record, or RuntimeError naming the first rank that failed, died or hung."""
    records: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(records) < len(processes):
        try:
            rank, record = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(processes) if r not in records and p.exitcode not in (None, 0)]
            if dead:
                code = processes[dead[0]].exitcode
                raise RuntimeError(f"delivery bench: rank {dead[0]} exited with code {code}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"delivery bench: the gloo job gave no result within {timeout_s:g} s") from None
            continue
        if "error" in record:
            raise RuntimeError(f"delivery bench: rank {rank} failed:\n{record['error']}")
        records[rank] = record
    return records


def _combine(records: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """Per repeat, the slowest rank's seconds of each method and stage."""
    seconds = {
        method: {
            stage: [
                max(repeat)
                for repeat in zip(*(records[r]["seconds"][method][stage] for r in range(world)), strict=True)
            ]
            for stage in STAGES
        }
        for method in METHODS
    }
    return {
        "world": world,
        "seconds": seconds,
        "bytes_received": {method: [records[r]["bytes_received"][method] for r in range(world)] for method in METHODS},
        "rows": [records[r]["rows"] for r in range(world)],
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_main(task: RankTask, results: Any) -> None:
    """One rank of the job (the target of each started process): join the group, check, time, report."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname resolves to
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{task.port}",
            rank=task.rank,
            world_size=task.world,
            timeout=timedelta(seconds=task.timeout_s),
        )
        record = _rank(task)
    except BaseException:
        # the error reaches the parent before this rank's sockets close, so it comes before the errors its
        # peers then hit ("connection closed by peer"); the parent stops them
        results.put((task.rank, {"error": traceback.format_exc()}))
        results.close()
        results.join_thread()
        sys.exit(1)
    dist.destroy_process_group()
    results.put((task.rank, record))


def _rank(task: RankTask) -> dict[str, Any]:
    """This rank's bytes received and seconds per repeat of each method, after checking both give the same rows."""
    import torch.distributed as dist

    from routereplay.layout.plan import gather
    from routereplay.transport.bundle import RankBundle
    from routereplay.transport.distributed import broadcast_dense, scatter_bundles

    rows = int(task.plan_P.numel())
    bundles = task.bundles()

    def compact() -> tuple[int, float, torch.Tensor]:
        data = scatter_bundles(bundles, src=0)
        sent = time.perf_counter()
        return len(data), sent, RankBundle(data, expected_rows=rows).to_torch()  # type: ignore[return-value]

    def dense() -> tuple[int, float, torch.Tensor]:
        routes_BSLK = broadcast_dense(task.routes_BSLK, shape=task.shape, dtype=torch.int16, src=0)
        sent = time.perf_counter()
        rows_PLK = gather(routes_BSLK, task.plan_P, source_dims=2)
        return routes_BSLK.numel() * routes_BSLK.element_size(), sent, rows_PLK

    methods = {"compact": compact, "dense": dense}
    received: dict[str, int] = {}
    checked: dict[str, torch.Tensor] = {}
    for name, method in methods.items():
        received[name], _, checked[name] = method()
    if not torch.equal(checked["compact"].to(torch.int16), checked["dense"]):
        raise AssertionError(f"delivery bench: rank {task.rank}'s rows differ between the bundle and the dense batch")
    del checked
    seconds: dict[str, dict[str, list[float]]] = {m: {s: [] for s in STAGES} for m in METHODS}
    for repeat in range(task.repeats):
        for name in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            dist.barrier()
            begin = time.perf_counter()
            _, sent, rows_PLK = methods[name]()
            done = time.perf_counter()
            del rows_PLK
            seconds[name]["collective"].append(sent - begin)
            seconds[name]["to_rows"].append(done - begin)
    dist.barrier()
    return {"seconds": seconds, "bytes_received": received, "rows": rows}


__all__ = ["DeliveryJob", "RankTask", "rank_main"]
