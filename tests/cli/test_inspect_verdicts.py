"""`inspect` as a new user met it: ids beyond E, and flags that contradict what a codec file records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routereplay import encode
from routereplay.cli.main import EXIT_ERROR, EXIT_INVALID, main
from routereplay.testing.synthetic import random_trace
from tests.wire.payloads import distinct_routes

E = 64


@pytest.mark.parametrize("bad_layer", [0, 47])
def test_ids_beyond_e_give_a_verdict_and_a_true_load_table(
    bad_layer: int, tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    """An id >= E in the last layer crashed `inspect --json` (a reshape in the load table, no verdict);
    in an earlier layer the load table counted it as the next layer's expert. Now: exit 1, a verdict
    naming ExpertIdRangeError, and every layer's load counts only its own valid ids."""
    routes = distinct_routes(rng, 8, 48, 8, E).astype(np.int32)  # (T, L, K)
    routes[3, bad_layer, 0] = E + 5
    path = tmp_path / "q.npy"
    np.save(path, routes)
    assert main(["inspect", str(path), "--num-experts", str(E), "--json"]) == EXIT_INVALID
    record = json.loads(capsys.readouterr().out)
    assert record["valid"] is False and record["error_type"] == "ExpertIdRangeError"
    loads = {load["layer"]: load["routed_rows"] for load in record["layer_load"]}
    assert len(loads) == 48
    for load in record["layer_load"]:
        expected = np.bincount(routes[:, load["layer"]].ravel(), minlength=E + 6)[:E]
        assert load["busiest_expert"] == int(expected.argmax())
        assert load["unused_experts"] == int((expected == 0).sum())
        assert load["max_over_mean"] == pytest.approx(expected.max() / (expected.sum() / E))  # no stray count
    assert main(["inspect", str(path), "--num-experts", str(E)]) == EXIT_INVALID  # the table renders too
    assert "ExpertIdRangeError" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "recorded"),
    [
        ("--num-experts", "64", "num_experts=32"),
        ("--num-layers", "7", "num_layers=3"),
        ("--top-k", "4", "top_k=2"),
        ("--moe-layers", "1-3", "moe_layers=0-2"),
    ],
)
def test_codec_file_refuses_flags_that_contradict_it(
    flag: str, value: str, recorded: str, tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect FILE.rrt --num-experts 64` on a file that records 32 used to be silently ignored."""
    path = tmp_path / "t.rrt"
    path.write_bytes(encode(random_trace(rng, num_tokens=10, num_layers=3, top_k=2, num_experts=32)))
    assert main(["inspect", str(path), flag, value]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert recorded in err and f"drop {flag}" in err
    assert main(["inspect", str(path), flag, value, "--json"]) == EXIT_ERROR
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["readable"] is False and verdict["error_type"] == "ConfigError"
    agreeing = {"--num-experts": "32", "--num-layers": "3", "--top-k": "2", "--moe-layers": "0-2"}[flag]
    assert main(["inspect", str(path), flag, agreeing, "--json"]) == 0


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--num-experts", "0"], "argument --num-experts: must be an integer >= 1, got '0'"),
        (["--moe-layers", "3-1"], "argument --moe-layers: layer range '3-1' in '3-1' runs backwards"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_flag_still_gets_a_json_verdict(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect --json` printed nothing on stdout for a bad flag, though its help promises a verdict in every case:
    the verdict now says unreadable, ArgumentError, and argparse's message; exit 2 as before."""
    with pytest.raises(SystemExit) as exited:
        main(["inspect", "m.json", *flags, "--json"])
    assert exited.value.code == EXIT_ERROR
    captured = capsys.readouterr()
    verdict = json.loads(captured.out)
    assert verdict["file"] == "m.json" and verdict["readable"] is False and verdict["valid"] is False
    assert verdict["error_type"] == "ArgumentError" and needle in verdict["error"]
    assert needle in captured.err, "argparse's usage error still goes to stderr"
    with pytest.raises(SystemExit):
        main(["inspect", "m.json", *flags])
    assert capsys.readouterr().out == "", "without --json, stdout stays empty"
