"""`routereplay demo` end to end in a reduced size, the report, and the --model loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.errors import ConfigError, NoRoutersError

pytestmark = pytest.mark.hf

SMALL = ["--prompts", "24", "--train-steps", "25", "--max-new-tokens", "4", "--rl-steps", "0"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_demo_json_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report"
    assert main(["demo", *SMALL[:-1], "1", "--json", "--report", str(report)]) == EXIT_OK  # one GRPO step per mode
    record = json.loads(capsys.readouterr().out)
    assert set(record["modes"]) == {"off", "R2", "R3"}
    assert record["modes"]["R2"]["update_drift"] == 0.0 and record["modes"]["R3"]["update_routing_disagreement"] == 0.0
    assert {(row["mode"], row["step"]) for row in record["steps"]} == {("off", 0), ("R2", 0), ("R3", 0)}
    for mode in record["modes"].values():
        for key in ("routing_disagreement", "token_disagreement", "extreme_frac_2", "jaccard"):
            assert 0.0 <= mode[key] <= 1.0
        assert mode["k3_kl"] >= 0
    assert record["modes"]["R3"]["routing_disagreement"] == 0.0, "R3 replays the engine's routes exactly"
    assert record["modes"]["R3"]["fallback_rows"] == 24 * len(record["model"]["layers"])
    assert record["rollouts"]["sequences"] == 24 and "dlogp" not in record
    assert record["config"]["engine_dtype"] == "bfloat16" and record["config"]["trainer_dtype"] == "float32"
    files = {p.name for p in report.iterdir()}
    assert {"report.html", "per_layer_disagreement.png", "dlogp_hist.png", "kl.png", "steps.png"} <= files
    assert "R3" in (report / "report.html").read_text()


def test_demo_table_and_cached_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--no-report"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Routing disagreement" in out and "k3 KL" in out and "R3 / off" in out
    assert main(["demo", *SMALL, "--no-report", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["model"]["source"].startswith("cached")


def test_demo_threshold_mode_reports_its_replace_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report"
    assert main(["demo", *SMALL, "--threshold", "0", "--json", "--report", str(report)]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    modes = record["modes"]
    assert list(modes) == ["off", "R3", "R3-threshold"]
    # margin 0: every row the trainer would not choose goes back to it, so the mode routes like `off`
    assert modes["R3-threshold"]["replace_rate"] > 0 and modes["R3-threshold"]["k3_kl"] == modes["off"]["k3_kl"]
    per_layer = modes["R3-threshold"]["replaced_rows_by_layer"]
    assert sorted(int(layer) for layer in per_layer) == record["model"]["layers"]
    assert "replace_rate" not in modes["R3"]
    assert "Replace rate (threshold)" in (report / "report.html").read_text()
    assert main(["demo", *SMALL, "--threshold", "0", "--no-report"]) == EXIT_OK
    assert "Replace rate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", *SMALL, "--threshold", "-1", "--no-report"])
    assert "must be a finite number in [0, inf)" in capsys.readouterr().err


def test_demo_deepseek_v3_arch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--arch", "deepseek_v3", "--no-report", "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    assert record["model"]["model_type"] == "deepseek_v3"
    assert 0 not in record["model"]["layers"], "the dense first layer is not an MoE layer"
    assert record["modes"]["R3"]["routing_disagreement"] == 0.0


def test_model_flag_loads_a_local_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from routereplay.rl.model import train_demo_model

    model, tokenizer = train_demo_model("qwen3_moe", steps=2)
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    args = [
        "demo",
        "--model",
        str(tmp_path / "ckpt"),
        "--prompts",
        "8",
        "--max-new-tokens",
        "3",
        "--no-report",
        "--json",
    ]
    assert main(args) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["model"]["source"] == f"--model {tmp_path / 'ckpt'}"


def test_model_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    from routereplay.rl.model import load_checkpoint
    from routereplay.rl.tasks import build_tokenizer

    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        load_checkpoint(tmp_path / "missing")
    assert main(["demo", "--model", str(tmp_path / "missing"), "--no-report"]) == EXIT_ERROR
    assert "not a checkpoint folder" in capsys.readouterr().err
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    dense = transformers.AutoModelForCausalLM.from_config(config)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_checkpoint(tmp_path / "dense")
    build_tokenizer().save_pretrained(tmp_path / "dense")
    with pytest.raises(NoRoutersError, match="has no MoE layers"):
        load_checkpoint(tmp_path / "dense")
