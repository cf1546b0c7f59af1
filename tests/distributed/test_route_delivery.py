"""Per-rank route delivery on a real 4-process gloo job: every rank gets its own rows, and only them.

One job (tests/distributed/delivery.py, on the batch of delivery_case.py: 8 samples, DP = 2 x SP = 2,
packed THD rows sharded by Ulysses) runs `scatter_bundles`, the `broadcast_dense` baseline,
`exchange_bundles` and the refusals on every rank; the tests below check what the ranks got against
the single-process layout (`layout.plan.gather` of the dense padded batch by each rank's plan).

Defects guarded against: a rank receiving the whole batch (verl #6211 broadcast the dense routes of
every step, 45 GB, to every rank), a rank replaying another rank's rows or a span cut one token off
(another token's experts), a holder's rows lost or sent twice in the all-to-all, and a receiver that
allocates whatever size a peer announces.

Legend: B = samples, S = positions, P = rows of one rank's layout, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from routereplay.layout.plan import gather
from tests.distributed import delivery_case as case
from tests.distributed.case import load, save
from tests.distributed.launch import launch

BUNDLE_OVERHEAD = 256  # bytes a bundle adds to its rows' encoding: header, layer numbers, span records, CRC


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The delivery job's results, one dict per rank (the job runs once for this module)."""
    workdir: Path = tmp_path_factory.mktemp("delivery")
    save(workdir / "case.pt", {"seed": case.SEED})
    launch("delivery", workdir, world_size=case.WORLD)
    return [load(workdir / f"rank{rank}.pt") for rank in range(case.WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return case.reference()


def test_every_rank_decodes_exactly_its_layout_rows(job: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Each rank's decoded bundle equals the single-process layout's rows for that rank, bit for bit
    (a span misplaced or cut one token off would replay another token's experts), and its routed rows
    are exactly the rows its plan names that have routes (padding and unrouted rows stay -1)."""
    for rank, result in enumerate(job):
        plan_P = reference["plans"][rank]
        expected_PLK = gather(reference["dense"], plan_P, source_dims=2)
        assert result["rows"].shape == (plan_P.numel(), case.LAYERS, case.TOP_K)
        assert torch.equal(result["rows"], expected_PLK), f"rank {rank} decoded other rows than its layout's"
        routed_P = (result["rows"] != -1).all(-1).any(-1)
        assert bool((plan_P[routed_P] >= 0).all()), f"rank {rank} has routes on a padding row"
        assert int(routed_P.sum()) > plan_P.numel() // 2, f"rank {rank}: most of its rows must carry routes"
    padding = [int((reference["plans"][rank] < 0).sum()) for rank in range(case.WORLD)]
    assert padding[case.SP - 1] > 0, "the case must exercise a padded Ulysses slice"


def test_every_rank_receives_only_its_own_bytes(job: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """A rank receives exactly the bytes of its own bundle, never the batch: each is at most 30% of the
    whole batch's encoded rows (a quarter of the rows, the DP shares being equal, plus a bundle's
    overhead and the spread of routed rows between ranks), and the four bundles together are the
    whole batch's encoding plus four overheads (no row sent twice). The dense broadcast verl does
    sends every rank the whole padded batch instead."""
    whole, sizes = len(reference["whole"]), []
    for rank, result in enumerate(job):
        received = bytes(result["received"].numpy())
        assert received == reference["bundles"][rank], f"rank {rank} received other bytes than its bundle"
        assert len(received) < 0.3 * whole, f"rank {rank} received {len(received)} of the batch's {whole} bytes"
        assert len(received) * 10 < result["dense_bytes"], "a rank's bundle must be far below the dense batch"
        sizes.append(len(received))
    assert whole - case.WORLD * BUNDLE_OVERHEAD < sum(sizes) < whole + case.WORLD * BUNDLE_OVERHEAD
    print(f"bytes per rank {sizes}; whole batch encoded {whole}; dense broadcast per rank {job[0]['dense_bytes']}")


def test_dense_broadcast_gives_every_rank_the_whole_batch(job: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """The baseline delivers the same rows (so the comparison is fair), at the cost of the whole
    (B, S, L, K) int16 batch on every rank."""
    dense_bytes = reference["dense"].numel() * reference["dense"].element_size()
    for rank, result in enumerate(job):
        assert result["dense_bytes"] == dense_bytes
        assert torch.equal(result["dense_rows"], result["rows"]), f"rank {rank}: baseline and bundle rows differ"


def test_exchange_merges_every_holders_rows(job: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """All-to-all from colocated holders (rank h holds samples 2h, 2h + 1): each rank merges what every
    holder sent into exactly its layout's rows (no holder's rows lost, none sent twice), and what a
    rank received from h is what h sent it."""
    for rank, result in enumerate(job):
        expected_PLK = gather(reference["dense"], reference["plans"][rank], source_dims=2)
        assert torch.equal(result["exchanged_rows"], expected_PLK), f"rank {rank}: merged rows differ"
        sent_to_me = [job[holder]["exchanged_sent"][rank] for holder in range(case.WORLD)]
        assert result["exchanged_bytes"] == sent_to_me
        assert sum(sent_to_me) < 0.3 * len(reference["whole"]) + case.WORLD * BUNDLE_OVERHEAD


def test_refusals_leave_the_group_working(job: list[dict[str, Any]]) -> None:
    """Every rank checked, with pytest.raises, that a forged 2**62-byte announcement, bundles above
    max_bytes and a short bundles list raise on every rank (a receiver that allocated first would die,
    one that raised alone would leave the others waiting); a scatter after them still delivers."""
    assert all(result["again_equal"] for result in job)


def test_scatter_outside_a_process_group_is_refused() -> None:
    """Called without torch.distributed initialised, the collective says how to start it instead of
    failing inside torch. Run in a fresh process: another test in this worker (accelerate, inside TRL)
    may have left a default process group behind."""
    code = (
        "import pytest\n"
        "from routereplay.errors import ConfigError\n"
        "from routereplay.transport import scatter_bundles\n"
        "with pytest.raises(ConfigError, match='not initialised in this process; call torch.distributed'):\n"
        "    scatter_bundles([b''], src=0)\n"
        "print('refused')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-3000:]
