"""Route delivery through Ray's object store: each trainer rank pulls only its own encoded rows.

In a Ray RL stack (verl, SkyRL, OpenRLHF) rollout workers and trainer ranks are actors, and the
driver moves the batch between them. The routes need not ride along whole: a `RankBundle` per rank
(`routereplay.transport.spans.bundles_for`: the rows of that rank's layout plan, still encoded) is one
object in the object store, and rank r is handed only the reference to its own.

- `put_bundles(bundles)`: one object per rank; give rank r `refs[r]` only (inside a list, so Ray
  passes the reference rather than resolving it), and it calls `fetch_bundle(ref)`: Ray moves that
  one object to its node.
- `RouteSource`: a rollout worker's `RouteStore` behind a Ray actor (`start_route_source`). It cuts
  a rank's bundle where the routes are: `source.cut.remote(sample_ids, plan_P, positions)` returns
  that rank's bytes and nothing else; `source.put.remote(sample_ids, plans, positions)` cuts every
  rank's and returns the references, for a driver to hand out.

Ray is optional (`pip install 'routereplay[ray]'`) and imported only when a function here runs; the
core never imports this module.

Legend: P = rows of one rank's layout (its plan's length), W = trainer ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from routereplay.errors import DeliveryError
from routereplay.integrations.framework import Framework
from routereplay.store.route_store import RouteStore
from routereplay.store.sample import SampleId
from routereplay.trace.route_trace import RouteTrace
from routereplay.transport.spans import bundles_for

INSTALL_HINT = "pip install 'routereplay[ray]'"
OLDEST_RAY = (2, 40)

Plan = torch.Tensor | np.ndarray


RAY = Framework(
    module="ray",
    label="Ray",
    oldest=OLDEST_RAY,
    needed_by="routereplay.integrations.ray_routes",
    requirement=f"needs Ray >= {'.'.join(map(str, OLDEST_RAY))}",
    install_hint=INSTALL_HINT,
)


def import_ray() -> Any:
    """`ray`, or `MissingDependencyError` naming the extra; refuses a Ray older than `OLDEST_RAY`."""
    return RAY.imported()[0]


def put_bundles(bundles: Sequence[bytes]) -> list[Any]:
    """One object-store object per bundle (`ray.put`), in rank order: hand rank r only `refs[r]`."""
    ray = import_ray()
    _check_bundles(bundles, "put_bundles")
    return [ray.put(bytes(bundle)) for bundle in bundles]


def fetch_bundle(ref: Any, *, timeout: float | None = None) -> bytes:
    """A rank's bundle bytes from its reference (`ray.get`): only this object travels to the rank.
    Parse it with `RankBundle(data, expected_rows=P)`, which checks it was built for this rank's P rows."""
    ray = import_ray()
    if not isinstance(ref, ray.ObjectRef):
        raise DeliveryError(
            f"fetch_bundle needs the ObjectRef of this rank's bundle, got {type(ref).__name__}; pass refs[rank] from "
            "put_bundles (inside a list or dict when it is a task argument, so Ray does not resolve it first)"
        )
    data = ray.get(ref, timeout=timeout)
    if not isinstance(data, bytes):
        raise DeliveryError(
            f"the object fetched for this rank holds {type(data).__name__}, not a bundle's bytes; put the bundles "
            "with put_bundles or RouteSource.put"
        )
    return data


class RouteSource:
    """A rollout worker's routes, served per rank: a `RouteStore` plus the cuts trainer ranks ask for.

    Run it as a Ray actor (`start_route_source`) next to the rollout engine; `add_turn` records routes
    as they arrive, `cut` returns one rank's bundle. It holds the routes encoded (`RouteStore`), so a
    cut copies encoded bytes and decodes nothing."""

    __slots__ = ("store",)

    def __init__(self, store: RouteStore | None = None, **store_options: Any) -> None:
        """Serve `store`, or a new `RouteStore(**store_options)`."""
        if store is not None and store_options:
            raise DeliveryError(f"give a store or RouteStore options, not both (got options {sorted(store_options)})")
        self.store = store if store is not None else RouteStore(**store_options)

    def add_turn(
        self, sample_id: SampleId, token_ids: Sequence[int] | np.ndarray, trace: RouteTrace | None, **options: Any
    ) -> None:
        """`RouteStore.add_turn` on the served store (a rollout worker records each engine call)."""
        self.store.add_turn(sample_id, token_ids, trace, **options)

    def cut(self, sample_ids: Sequence[SampleId], plan: Plan, positions: int) -> bytes:
        """One rank's bundle: the rows `plan` (flat b * positions + s into the padded batch of `sample_ids`,
        -1 = padding) names, still encoded."""
        return bundles_for(self.store, sample_ids, [plan], positions)[0]

    def put(self, sample_ids: Sequence[SampleId], plans: Sequence[Plan], positions: int) -> list[Any]:
        """Every rank's bundle (`plans[r]`), each put in the object store: the references in rank order."""
        return put_bundles(bundles_for(self.store, sample_ids, plans, positions))

    def nbytes(self) -> int:
        """Resident bytes of the served store."""
        return self.store.nbytes


def start_route_source(store: RouteStore | None = None, **actor_options: Any) -> Any:
    """A `RouteSource` actor serving `store` (a new empty one when None); `actor_options` go to Ray's
    `.options(...)` (e.g. `num_cpus=0` beside a rollout engine that holds the cores, `name=` to find it)."""
    ray = import_ray()
    return ray.remote(RouteSource).options(**actor_options).remote(store)


def _check_bundles(bundles: Sequence[bytes], where: str) -> None:
    if isinstance(bundles, (bytes, bytearray)) or not isinstance(bundles, Sequence):
        raise DeliveryError(
            f"{where} needs a list of bundles (one bytes object per rank), got {type(bundles).__name__}"
        )
    wrong = [rank for rank, bundle in enumerate(bundles) if not isinstance(bundle, (bytes, bytearray))]
    if wrong:
        raise DeliveryError(
            f"{where}: the bundle of rank {wrong[0]} is {type(bundles[wrong[0]]).__name__}, not bytes; pass what "
            "bundles_for returns"
        )


__all__ = ["INSTALL_HINT", "RouteSource", "fetch_bundle", "import_ray", "put_bundles", "start_route_source"]
