"""`routereplay bench vllm` (issue 12 item 6): route capture on/off and sync_weights timing with a real vLLM."""

from __future__ import annotations

import json
import sys

import pytest

from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.cli.train import VLLM_CLI_LOGGING

pytestmark = pytest.mark.hf


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-live")
def test_bench_vllm_quick_json(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Misleading message (issue 12 item 6): the suite times a routes-on and a routes-off vLLM (it refuses to
    report a ratio if the switch had no effect) and sync_weights, and prints one JSON record on stdout (vLLM's
    log goes to stderr), captured at the file-descriptor level."""
    for name in VLLM_CLI_LOGGING:  # the command sets them for its process; restored after the test
        monkeypatch.delenv(name, raising=False)
    assert main(["bench", "vllm", "--quick", "--repeats", "1", "--json"]) == EXIT_OK
    record = json.loads(capfd.readouterr().out)
    assert set(record["seconds"]) == {"unrouted", "routed", "routed_decoded", "resumed", "resumed_forced"}
    ratios = {"routed_over_unrouted", "routed_decoded_over_unrouted", "best_routed_over_unrouted"}
    assert set(record["ratios"]) == ratios | {"forced_over_resumed", "best_forced_over_resumed"}
    assert record["forced_rows_per_call"] > 0  # every prefix row of the resumed prompts, forced and checked
    goal = record["targets"]["forced_over_resumed"]
    assert (goal["target"], goal["met"]) == (1.05, None)  # --quick: not graded
    assert record["model"]["head_dim"] == 64 and record["model"]["tensors"] > 0
    assert record["sync_weights_seconds"]["median"] > 0 and record["machine"]["vllm"].startswith("0.30")


def test_bench_vllm_without_vllm_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Error that is not a RouteReplayError (issue 12 item 6): without vLLM the suite fails with
    MissingDependencyError naming the extra, not a bare ImportError."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["bench", "vllm", "--quick", "--json"]) == EXIT_ERROR
    assert "pip install 'routereplay[vllm]'" in capsys.readouterr().err
