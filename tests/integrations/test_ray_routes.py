"""Per-rank route delivery through a real local Ray runtime: each trainer rank pulls only its own bytes.

One Ray runtime for the module (2 CPUs, no dashboard, loopback only). The batch and layout are those
of the distributed delivery test (tests/distributed/delivery_case.py: 8 samples, DP = 2 x SP = 2,
packed THD rows sharded by Ulysses); trainer ranks are Ray tasks that fetch their bundle, from the
object store or from a rollout-worker actor holding the `RouteStore`, and decode it. Each must equal
the single-process layout's rows for that rank exactly.

Defects guarded against: a rank pulling the whole batch's routes (the dense broadcast of verl #6211),
a rank handed or cut another rank's rows (another token's experts replayed), a reference resolved
into the wrong object, and a driver that puts something other than a bundle.

Legend: B = samples, S = positions, P = rows of one rank's layout, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import DeliveryError
from routereplay.integrations.ray_routes import fetch_bundle, import_ray, put_bundles, start_route_source
from routereplay.layout.plan import gather
from routereplay.transport.bundle import RankBundle
from tests.distributed import delivery_case as case

pytestmark = pytest.mark.ray

OBJECT_STORE_BYTES = 80 * 2**20  # Ray's floor is 75 MiB; the bundles here are a few KiB


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[Any]:
    """A local Ray runtime bound to 127.0.0.1, shut down after the module."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Linux Ray binds the machine's address unless clusters are "disabled" (read when ray is imported)
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = import_ray()
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=OBJECT_STORE_BYTES,
            configure_logging=False,
            log_to_driver=False,
        )
        try:
            addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
            if addresses != {"127.0.0.1"}:
                raise RuntimeError(f"the test Ray runtime must listen on loopback only, it uses {addresses}")
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def batch() -> dict[str, Any]:
    return case.reference()


def trainer_rank(box: list[Any], rows: int) -> tuple[bytes, np.ndarray]:
    """A trainer rank (a Ray task): fetch its own bundle, decode its (P, L, K) rows."""
    data = fetch_bundle(box[0])
    return data, RankBundle(data, expected_rows=rows).decode()


def trainer_rank_from_source(source: Any, sample_ids: list[str], plan_P: torch.Tensor, S: int) -> tuple[bytes, Any]:
    """A trainer rank asking the rollout worker's actor to cut its rows at the source."""
    import ray

    data = ray.get(source.cut.remote(sample_ids, plan_P, S))
    return data, RankBundle(data, expected_rows=plan_P.numel()).decode()


def _check_ranks(results: list[tuple[bytes, np.ndarray]], batch: dict[str, Any]) -> None:
    whole = len(batch["whole"])
    for rank, (data, rows_PLK) in enumerate(results):
        expected_PLK = gather(batch["dense"], batch["plans"][rank], source_dims=2)
        assert np.array_equal(rows_PLK, expected_PLK.numpy()), f"rank {rank}: rows differ from its layout's"
        assert data == batch["bundles"][rank], f"rank {rank} fetched other bytes than its own bundle"
        assert len(data) < 0.3 * whole, f"rank {rank} fetched {len(data)} of the whole batch's {whole} bytes"


def test_ranks_fetch_only_their_object(ray_runtime: Any, batch: dict[str, Any]) -> None:
    """The driver puts one object per rank and hands rank r only refs[r]: every rank fetches exactly its
    own bundle (a quarter of the batch's encoded rows, not the batch) and decodes its layout's rows."""
    refs = put_bundles(batch["bundles"])
    task = ray_runtime.remote(trainer_rank)
    results = ray_runtime.get([task.remote([refs[rank]], plan_P.numel()) for rank, plan_P in enumerate(batch["plans"])])
    _check_ranks(results, batch)


def test_rollout_worker_actor_cuts_each_rank_its_rows(ray_runtime: Any, batch: dict[str, Any]) -> None:
    """A rollout worker's actor holding the RouteStore cuts each rank's bundle at the source, on the
    rank's request (`cut`) or for every rank at once into the object store (`put`); either way each
    rank gets its own rows and only them."""
    source = start_route_source(batch["store"], num_cpus=0)
    S = case.positions()
    task = ray_runtime.remote(trainer_rank_from_source)
    asked = ray_runtime.get([task.remote(source, case.SAMPLE_IDS, plan_P, S) for plan_P in batch["plans"]])
    _check_ranks(asked, batch)

    refs = ray_runtime.get(source.put.remote(case.SAMPLE_IDS, batch["plans"], S))
    fetch = ray_runtime.remote(trainer_rank)
    put = ray_runtime.get([fetch.remote([refs[rank]], p.numel()) for rank, p in enumerate(batch["plans"])])
    _check_ranks(put, batch)
    assert ray_runtime.get(source.nbytes.remote()) == batch["store"].nbytes
    ray_runtime.kill(source)


def test_fetch_and_put_refuse_what_is_not_a_bundle(ray_runtime: Any) -> None:
    """A reference to something other than bundle bytes, a value passed where the reference belongs
    (Ray resolved it), or a non-bytes bundle raise a DeliveryError saying what to pass."""
    with pytest.raises(DeliveryError, match=r"holds list, not a bundle's bytes"):
        fetch_bundle(ray_runtime.put([1, 2, 3]))
    with pytest.raises(DeliveryError, match=r"needs the ObjectRef of this rank's bundle, got bytes"):
        fetch_bundle(b"RRRB")
    with pytest.raises(DeliveryError, match=r"the bundle of rank 1 is int, not bytes"):
        put_bundles([b"", 3])
