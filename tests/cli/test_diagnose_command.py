"""`routereplay diagnose` from the command line: a second family (a tiny DeepSeek-V3, dense layer 0, saved to a
folder) from vLLM payloads and from `.rrt` files, the JSON checked against the trainer's own recording, one
self-contained HTML file; `--help`; bad inputs refused with one line before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.cli.main import main
from tests.report.test_diagnose_report import check_self_contained, vllm_payload

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny DeepSeek-V3 (router scaled down to near-ties) saved to a folder, and 4 rollouts of its bf16 engine
    as vLLM payloads and .rrt files."""
    from routereplay.engines.hf import HFEngine, SamplingParams
    from routereplay.testing.hf import tiny_model
    from routereplay.tracefile.io import write_trace

    folder = tmp_path_factory.mktemp("diagnose")
    model = tiny_model(FAMILY, seed=1)
    with torch.no_grad():  # near-tied router scores, as a trained router has on some tokens: bf16 flips a few
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                weight.mul_(0.03)
    model.save_pretrained(folder / "model")  # type: ignore[operator]
    vocab = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]
    generator = np.random.default_rng(0)
    prompts = [generator.integers(1, vocab, size=n).tolist() for n in (12, 16, 14, 20)]
    params = SamplingParams(max_new_tokens=6, seed=2)
    rollouts = HFEngine(model, dtype=torch.bfloat16, policy_version=0).generate(prompts, params)
    payloads, codec_files = [], []
    for i, rollout in enumerate(rollouts):
        payloads.append(folder / f"seq{i}.json")
        payloads[-1].write_text(json.dumps(vllm_payload(rollout)))
        codec_files.append(folder / f"seq{i}.rrt")
        assert rollout.trace is not None
        write_trace(rollout.trace.with_token_ids(np.array(rollout.token_ids[:-1])), codec_files[-1], "rrt")
    return {"folder": folder, "model": model, "rollouts": rollouts, "payloads": payloads, "rrt": codec_files}


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["diagnose", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if code == 0 else {}


def trainer_disagreement(checkpoint: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Per MoE layer, the engine's routes against the trainer's own routing, recorded here with `record()`."""
    from routereplay.metrics import routing_agreement
    from routereplay.rl.scoring import engine_routes, score
    from routereplay.runtime import attach

    model, rollouts = checkpoint["model"], checkpoint["rollouts"]
    replayer = attach(model)
    try:
        scored = score(model, rollouts, 0, replayer=replayer)
        engine_BSLK = engine_routes(rollouts, scored.ids_BS.shape, len(replayer.layers), replayer.top_k)
        layers = list(replayer.layers)
    finally:
        replayer.detach()
    assert scored.routes_BSLK is not None
    return layers, routing_agreement(scored.routes_BSLK, engine_BSLK, scored.mask_BS.bool())["per_layer_disagreement"]


def test_diagnose_a_second_family_from_payloads_and_rrt_files(
    checkpoint: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = str(checkpoint["folder"] / "model")
    report = tmp_path / "diag.html"
    code, record = run_json(capsys, *map(str, checkpoint["payloads"]), "--model", model_dir, "--report", str(report))
    assert code == 0
    layers, per_layer = trainer_disagreement(checkpoint)
    assert record["model"]["model_type"] == FAMILY and record["model"]["layers"] == layers
    assert 0 not in layers, "the dense first layer is not a routed layer"
    assert any(per_layer), "the fixture must show some disagreement to be a test"
    assert record["routing"]["per_layer_disagreement"] == pytest.approx(per_layer)
    assert record["routing"]["replayed_disagreement"] == 0.0
    assert record["logprobs"]["off"]["tokens"] == sum(len(r.response_ids) for r in checkpoint["rollouts"])
    assert record["inputs"]["missing"] == []
    assert record["summary"]["next_steps"][-1].endswith("docs/diagnose.md.")
    check_self_contained(report.read_text(encoding="utf-8"))
    code, from_rrt = run_json(
        capsys, *map(str, checkpoint["rrt"]), "--model", model_dir, "--no-report", "--batch-size", "3"
    )
    assert code == 0
    assert from_rrt["logprobs"] is None and from_rrt["inputs"]["missing"]
    assert from_rrt["routing"]["per_layer_disagreement"] == pytest.approx(per_layer)


def test_diagnose_help_explains_inputs_outputs_and_the_walkthrough(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["diagnose", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "vLLM response",
        ".rrt",
        "route store",
        "--model",
        "--device",
        "(off)",
        "(R3)",
        "k3 KL",
        "per token position",
        "load skew",
        "one HTML file",
        "docs/diagnose.md",
        "--json",
    ):
        assert needle in text, needle


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.json", "--model", "demo"], "missing.json"),
        (["{folder}", "--model", "demo"], "is a folder; pass the rollout files in it"),
        (["{rrt}", "--model", "{folder}"], "not a checkpoint folder (no config.json there)"),
        (["{rrt}", "--model", "demo", "--arch", "gpt2"], "is not a demo family"),
        (["{rrt}", "--model", "demo", "--no-report", "--report", "x.html"], "contradict each other"),
        (["{rrt}", "--model", "demo", "--device", "tpu"], "pass cpu or cuda"),
    ],
)
def test_diagnose_refuses_bad_inputs_with_one_line(
    checkpoint: dict[str, Any],
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(checkpoint["folder"])
    filled = [a.format(folder=checkpoint["folder"], rrt=checkpoint["rrt"][0]) for a in args]
    assert main(["diagnose", *filled]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_diagnose_on_cuda_without_a_cuda_device_is_refused_before_loading(
    checkpoint: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["diagnose", str(checkpoint["rrt"][0]), "--model", "/no/such/ckpt-never-read", "--device", "cuda"])
    assert code == 2
    assert "not a checkpoint folder" in capsys.readouterr().err  # the model flag is checked first, then the device
    code = main(["diagnose", str(checkpoint["rrt"][0]), "--model", "demo", "--device", "cuda", "--no-report"])
    assert code == 2
    assert "sees no CUDA device here; pass --device cpu" in capsys.readouterr().err


def test_diagnose_refuses_a_model_the_routes_do_not_belong_to(
    checkpoint: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo model (128 experts, layers 0-7) is not the model the DeepSeek-V3 rollouts were sampled with."""
    code = main(["diagnose", str(checkpoint["rrt"][0]), "--model", "demo", "--no-report"])
    assert code == 2
    err = capsys.readouterr().err
    assert "pass the model the rollouts were sampled with (--model)" in err and "Traceback" not in err, err


@pytest.mark.gpu
def test_diagnose_on_cuda_routes_like_the_cpu(checkpoint: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = str(checkpoint["folder"] / "model")
    files = list(map(str, checkpoint["payloads"]))
    code, on_gpu = run_json(capsys, *files, "--model", model_dir, "--device", "cuda", "--no-report")
    assert code == 0
    _code, on_cpu = run_json(capsys, *files, "--model", model_dir, "--no-report")
    assert on_gpu["routing"]["compared_rows"] == on_cpu["routing"]["compared_rows"]
    assert on_gpu["routing"]["replayed_disagreement"] == 0.0
    assert on_gpu["logprobs"]["R3"]["tokens"] == on_cpu["logprobs"]["R3"]["tokens"]
