"""The launcher itself: a rank that fails ends the job at once and fails the test with its log.

Without this, a rank dying while its partner waits in a collective would block CI until gloo's
own timeout; with it, the partner is killed as soon as the failure is seen.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.distributed.case import save
from tests.distributed.launch import launch


def test_a_failing_rank_fails_the_test_fast_with_its_log(tmp_path: Path) -> None:
    save(tmp_path / "case.pt", {})
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited with code .*deliberate failure on rank 1"):
        launch("failing_rank", tmp_path, world_size=2, timeout_s=60.0)
    assert time.monotonic() - start < 30.0, "the waiting rank must be killed, not left to gloo's timeout"
