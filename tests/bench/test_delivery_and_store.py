"""`routereplay bench delivery` and the compact-store `bench store` (issue 15 item 3): every record and target
field, the gloo job's failure path, and the configs' refusals. No timed assertions."""

from __future__ import annotations

import json

import pytest
import torch

from routereplay.bench import delivery, store
from routereplay.bench.delivery import DeliveryJob
from routereplay.bench.delivery.benchmark import dp_batch
from routereplay.bench.store import SampleSource
from routereplay.cli.main import EXIT_OK, main
from routereplay.transport.spans import bundles_for

TARGET_FIELDS = {"value", "target", "direction", "met", "ungraded", "rate"}  # rate: rows/s or seconds, not a ratio


def test_quick_delivery_json_has_every_record_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    """A delivery record missing a measurement (one of the three parts, a stage, a rank's bytes) or a target
    would leave BENCHMARKS.md and the README table without it; the DP plans must cover every token once."""
    assert main(["bench", "delivery", "--quick", "--json"]) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    config = result["config"]
    assert result["suite"] == "delivery" and config["dp"] == 4 and config["sp"] == 4
    assert [a["case"] for a in result["access"]] == ["routed", "unrouted_1pct"]
    for access in result["access"]:
        assert set(access["ranges"]) == set(access["seconds"]) == {"whole", "sp_slice", "window"}
        assert set(access["time_ratio"]) == set(access["row_fraction"]) == set(access["cost_over_share"])
        assert access["ranges"]["whole"] == [0, access["tokens"]] and access["tokens"] == config["seq"] - 1
        assert access["ranges"]["window"][1] - access["ranges"]["window"][0] == config["window"]
    dp = result["dp"]
    assert dp["ranks"] == 4 and sum(dp["rows_per_rank"]) == result["tokens"]
    compact, dense = dp["bytes_per_rank"]["compact"], dp["bytes_per_rank"]["dense"]
    assert len(compact) == len(dense) == 4 and len(set(dense)) == 1
    assert dense[0] % (config["samples"] * config["layers"] * config["top_k"] * 2) == 0  # B x S x L x K int16
    assert dp["max_bytes_over_dense"] == max(compact) / dense[0] < 1
    assert set(dp["seconds"]) == {"compact_collective", "compact_to_rows", "dense_collective", "dense_to_rows"}
    assert set(dp["dense_over_compact"]) == {"collective", "to_rows"}
    end = result["pipeline"]
    assert end["rows"] == result["rows"] == (result["tokens"] - config["samples"]) * config["layers"]
    assert set(end["seconds"]) == {"decode", "store", "plan", "bundles", "ranks", "total"}
    assert set(end["share"]) == {"decode", "store", "plan", "bundles", "ranks"}
    assert sum(end["share"].values()) == pytest.approx(1.0) and end["rows_per_s"] > 0
    scale = result["scale"]  # issue 26 item 4: the same run's rates at cluster scale, checked against its own job
    assert [(r["model"], r["gpus"]) for r in scale["runs"]] == [
        (model, gpus) for model in ("Qwen3-30B-A3B", "DeepSeek-V3") for gpus in (64, 512, 4096)
    ]
    qwen64 = scale["runs"][0]
    assert qwen64["rows"] == 64 * 8 * 8192 * 48 and qwen64["bytes_per_rank"] == qwen64["rows"] / 64 * 41 / 8
    assert scale["runs"][3]["bytes_per_rank"] > scale["runs"][0]["bytes_per_rank"]  # 58 layers, 50 bits per row
    check = scale["check"]
    assert check["rows_per_rank"] == max(dp["rows_per_rank"]) * config["layers"]
    assert check["bytes_per_rank"]["measured"] == max(compact)
    assert 0.9 < check["bytes_per_rank"]["measured_over_predicted"] < 1.2  # the bundle framing on top of the bits
    targets = result["targets"]
    assert set(targets) == {
        "compact_bytes_per_rank_over_dense",
        "sp_slice_decode_cost_over_row_share",
        "pipeline_rows_per_s",  # issue 26 item 2: vLLM JSON to rank tensors, one thread
    }
    assert targets["pipeline_rows_per_s"]["target"] == 20e6 and targets["pipeline_rows_per_s"]["direction"] == ">="
    assert [name for name, goal in targets.items() if goal["rate"]] == ["pipeline_rows_per_s"]
    assert all(set(goal) == TARGET_FIELDS and goal["met"] is None for goal in targets.values())
    assert targets["compact_bytes_per_rank_over_dense"]["target"] == pytest.approx(0.35 / 4)
    text = delivery.markdown(result)
    assert "`scatter_bundles`" in text and "`broadcast_dense`" in text and "decode_vllm" in text
    assert "| DeepSeek-V3 | 4,096 |" in text and "Checked against the 4-rank gloo job" in text
    assert "target >= 20M: not graded" in text  # --quick sizes are never graded


def test_quick_store_json_has_every_record_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    """The store bench must measure the compact store (encoded) beside today's ragged int16 holder and the
    dense tensors, with its target; a record that measured a decoded store would hold more than the payload."""
    args = ["bench", "store", "--samples", "6", "--max-len", "300", "--layers", "4", "--repeats", "1", "--json"]
    assert main(args) == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    rows = result["tokens"] - 6  # every sample's last token has no route
    assert result["rows"] == rows * 4 and result["payload_bytes"] == rows * 4 * 8 * 2
    holders = {"compact", "ragged_int16", "dense_int16", "dense_int32"}
    assert set(result["peak_bytes"]) == set(result["held_bytes"]) == holders
    peaks, held = result["peak_bytes"], result["held_bytes"]
    assert held["ragged_int16"] >= result["payload_bytes"] + 8 * result["tokens"]  # int16 routes and int64 ids
    assert peaks["dense_int32"] >= 2 * peaks["dense_int16"] - 1024 >= 6 * result["padded_length"] * 4 * 8 * 2 * 2 - 1024
    assert result["store_nbytes"] <= held["compact"] <= peaks["compact"]
    assert result["ratios"]["compact_nbytes_over_payload"] < 0.5  # 5.125 B of 16 per row, plus token ids
    assert set(result["build_seconds"]) == {"median", "low", "high"} and result["encode_rows_per_s"] > 0
    assert set(result["targets"]) == {"compact_over_payload"}
    assert set(result["targets"]["compact_over_payload"]) == TARGET_FIELDS - {"ungraded"}
    assert result["targets"]["compact_over_payload"]["target"] == 0.35
    assert "ragged int16" in store.markdown(result)


def test_a_failing_rank_ends_the_job_with_its_traceback() -> None:
    """A rank that raises must end the whole gloo job (the others would wait in a collective until the group's
    timeout) and surface its own error, not a hang or a bare exit code."""
    source = SampleSource(samples=4, seq=32, min_len=8, layers=2, top_k=2, experts=8, seed=0)
    config = delivery.DeliveryBenchConfig(samples=4, seq=32, min_len=8, layers=2, top_k=2, experts=8, window=4)
    routes, dense_BSLK, plans = dp_batch(config, source)
    bundles = bundles_for(routes, list(range(4)), plans, dense_BSLK.shape[1])
    plans[2] = torch.cat([plans[2], torch.tensor([-1])])  # rank 2 expects one row more than its bundle holds
    job = DeliveryJob(bundles, dense_BSLK, plans, repeats=1, timeout_s=60.0)
    with pytest.raises(RuntimeError, match=r"(?s)rank 2 failed:.*CodecFormatError: rank bundle holds"):
        job.run()


def test_delivery_config_refuses_impossible_sizes() -> None:
    """A batch with fewer samples than DP ranks, or a window past the sample, would measure nothing real."""
    with pytest.raises(ValueError, match="2 samples cannot give each of dp=4 ranks one"):
        delivery.DeliveryBenchConfig(samples=2, dp=4)
    with pytest.raises(ValueError, match=r"window=300 must not exceed the 255 routed rows"):
        delivery.DeliveryBenchConfig(seq=256, min_len=32, window=300)
    with pytest.raises(ValueError, match=r"min_len 1 must be in \[2, seq=256\]"):
        delivery.DeliveryBenchConfig(seq=256, min_len=1)
    with pytest.raises(ValueError, match="min_len must be >= 2"):
        store.StoreBenchConfig(min_len=1)
