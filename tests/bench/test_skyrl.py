"""`routereplay bench skyrl` (issue 32): bytes per sample of a SkyRL 0.4.0 batch's routes, compact against its forms.

No SkyRL is needed: SkyRL's generator array comes from `generator_routes`, its wire envelope and packed batch field
are laid out here as SkyRL writes them (checked against SkyRL's own code in tests/integrations/skyrl)."""

from __future__ import annotations

import json

import pytest

from routereplay.bench import skyrl_routes
from routereplay.cli.main import EXIT_OK, main


def test_bench_skyrl_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "skyrl", "--quick", "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    sizes, mean = record["bytes_per_sample"], record["mean_tokens"]
    assert record["suite"] == "skyrl" and record["config"]["samples"] == 4 and record["set_bits_per_row"] == 41
    assert sizes["skyrl_generator_uint8"] == (mean - 1) * 48 * 8  # uint8, one row per routed token
    assert sizes["skyrl_packed_tensor"] == mean * 48 * 8 + 4  # SkyRL's dummy tail row + a cu_seqlens entry
    assert sizes["skyrl_wire_envelope"] > 4 / 3 * sizes["skyrl_generator_uint8"]  # base64
    assert sizes["skyrl_packed_plus_padding_mask"] > sizes["skyrl_packed_tensor"] > sizes["routereplay_compact_ordered"]
    assert sizes["routereplay_compact_ordered"] > sizes["routereplay_compact_set"] and sizes["routereplay_digest"] == 16
    assert record["ratios"]["packed_over_compact"] > 1.4  # 64 bits per (token, layer) row against 41
    assert "x smaller than SkyRL's packed batch field" in skyrl_routes.markdown(record)


def test_bench_skyrl_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="tokens 1-8192 must satisfy 2 <= min <= max"):
        skyrl_routes.SkyRLRoutesBenchConfig(min_tokens=1)
    with pytest.raises(ValueError, match="top_k 9 exceeds experts 8"):
        skyrl_routes.SkyRLRoutesBenchConfig(top_k=9, experts=8)


def test_bench_skyrl_honours_the_size_flags(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = ["--samples", "3", "--max-len", "64", "--layers", "4", "--top-k", "2", "--experts", "16"]
    assert main(["bench", "skyrl", "--json", *sizes]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    config = record["config"]
    assert (config["samples"], config["max_tokens"], config["layers"], config["top_k"], config["experts"]) == (
        3, 64, 4, 2, 16,
    )  # fmt: skip
    assert record["mean_tokens"] <= 64
    assert record["bytes_per_sample"]["skyrl_generator_uint8"] == (record["mean_tokens"] - 1) * 4 * 2
