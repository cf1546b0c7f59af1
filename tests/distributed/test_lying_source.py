"""`scatter_bundles` against a lying source: a real second process forges the header and the payload.

The job (tests/distributed/lying_source.py, 2 gloo ranks on 127.0.0.1) has rank 0 send a status word
no release sends, a payload half as long as announced, and a payload without its size trailer; rank 1
checked each with `pytest.raises(DeliveryError, match=...)`, which ends the job if it fails.

Defects guarded against: status 7 raised `ValueError: 7 is not a valid Refusal` (not a routereplay
error), and a short payload was returned as the announced 100 bytes, 50 of them never sent
(uninitialised memory, caught only later, by luck, by the bundle's CRC).
"""

from __future__ import annotations

from pathlib import Path

from tests.distributed.case import load, save
from tests.distributed.launch import launch


def test_a_lying_source_gets_named_errors_and_the_group_still_delivers(tmp_path: Path) -> None:
    save(tmp_path / "case.pt", {})
    launch("lying_source", tmp_path, world_size=2)
    receiver = load(tmp_path / "rank1.pt")
    assert receiver["checked"] == 3, "rank 1 must have checked the three lies"
    assert all(load(tmp_path / f"rank{rank}.pt")["honest_delivered"] for rank in range(2)), (
        "after the refusals an honest scatter must still deliver each rank its own bytes"
    )
