"""`routereplay demo --engine vllm` (issue 12 item 3): the demo's engine-vs-trainer comparison with a real vLLM.

The demo model's vLLM-servable variant (head_dim 64) is trained briefly into a per-module cache; the
live test starts one in-process vLLM for the comparison and the GRPO steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.cli.train import VLLM_CLI_LOGGING
from routereplay.errors import ConfigError

pytestmark = pytest.mark.hf

SMALL = ["--prompts", "16", "--train-steps", "30", "--max-new-tokens", "4", "--rl-steps", "1", "--no-report", "--json"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(folder))
    for name in VLLM_CLI_LOGGING:  # the command sets them for its process; restored after the test
        monkeypatch.delenv(name, raising=False)
    return folder


def _keys(record: Any) -> Any:
    """The nested key structure of a JSON record (lists of records by their first element)."""
    if isinstance(record, dict):
        return {key: _keys(value) for key, value in record.items()}
    if isinstance(record, list) and record and isinstance(record[0], dict):
        return [_keys(record[0])]
    return None


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-live")
def test_demo_engine_vllm_replays_vllm_routes_exactly(cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Silent misroute (issue 12 item 3): `routereplay demo --engine vllm` samples with a real vLLM; under R3
    the trainer routes exactly like vLLM on every routed row (comparison and GRPO updates), on the demo
    model's servable variant (head_dim 64, cached under its own key), and the JSON has the built-in demo's
    keys. stdout holds only the JSON (vLLM's log goes to stderr), captured at the file-descriptor level."""
    assert main(["demo", "--engine", "vllm", *SMALL]) == EXIT_OK
    record = json.loads(capfd.readouterr().out)
    modes = record["modes"]
    assert modes["R3"]["routing_disagreement"] == 0.0, "R3 replays vLLM's routes exactly"
    assert modes["R3"]["update_routing_disagreement"] == 0.0
    assert all(row["routing_disagreement"] == 0.0 for row in record["steps"] if row["mode"] == "R3")
    assert modes["R3"]["fallback_rows"] == 16 * len(record["model"]["layers"]), "only each last token is unrouted"
    assert record["config"]["engine"] == "vllm" and record["rollouts"]["sequences"] == 16
    assert "head_dim64" in record["model"]["source"], record["model"]["source"]
    served = next(cache.glob("demo-qwen3_moe-head_dim64-*"))
    assert json.loads((served / "config.json").read_text())["head_dim"] == 64
    assert main(["demo", *SMALL]) == EXIT_OK  # the built-in engine: same record shape
    builtin = json.loads(capfd.readouterr().out)
    assert builtin["config"]["engine"] == "hf"
    assert _keys(record) == _keys(builtin)
    assert "head_dim64" not in builtin["model"]["source"], "the built-in demo keeps the default model"
    assert json.loads((next(cache.glob("demo-qwen3_moe-v*")) / "config.json").read_text())["head_dim"] == 16
    off, r3 = modes["off"]["k3_kl"], modes["R3"]["k3_kl"]
    print(  # the R3/off k3 KL ratio, reported (a tiny run proves nothing about it)
        f"vLLM demo (small): disagreement off {modes['off']['routing_disagreement']:.4%}, k3 KL off {off:.3e}, "
        f"R3 {r3:.3e}, ratio {r3 / off if off else float('nan'):.3f}"
    )


def test_demo_engine_vllm_without_vllm_names_the_extra(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Error that is not a RouteReplayError (issue 12 item 3): `demo --engine vllm` without vLLM fails with
    MissingDependencyError naming the extra, before the demo model is trained."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where vLLM is not installed
    assert main(["demo", "--engine", "vllm", *SMALL]) == EXIT_ERROR
    assert "pip install 'routereplay[vllm]'" in capsys.readouterr().err
    assert not cache.exists(), "the demo model was trained before the refusal"


@pytest.mark.vllm
def test_demo_engine_vllm_refuses_an_arch_without_servable_variant(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Misleading message (issue 12 item 3): the DeepSeek-V3 demo model has no variant vLLM's CPU backend
    serves (MLA needs kv_lora_rank 512); the command says so and what to pass, before training."""
    assert main(["demo", "--engine", "vllm", "--arch", "deepseek_v3", *SMALL]) == EXIT_ERROR
    message = capsys.readouterr().err
    assert "--arch deepseek_v3 has no variant" in message and "--model" in message
    assert not cache.exists(), "the demo model was trained before the refusal"


def test_demo_config_refuses_an_unknown_engine() -> None:
    """Misleading message (issue 12 item 3): DemoConfig(engine=...) names the engines it runs."""
    from routereplay.rl.demo import DemoConfig

    with pytest.raises(ConfigError, match=r"DemoConfig.engine='sglang' must be one of \('hf', 'vllm'\)"):
        DemoConfig(engine="sglang")
