"""`routereplay bench verl` (issue 25): bytes per sample of a verl batch's routes, compact against verl's forms.

No verl is needed: verl's padded layout is built by routereplay's own `padded_routes` (checked against verl's
agent loop in tests/integrations/verl), and every form is measured on the same traces."""

from __future__ import annotations

import json

import pytest

from routereplay.bench import verl_routes
from routereplay.cli.main import EXIT_OK, main


def test_bench_verl_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "verl", "--quick", "--json"]) == EXIT_OK
    record = json.loads(capsys.readouterr().out)
    sizes = record["bytes_per_sample"]
    assert record["config"]["samples"] == 4 and record["set_bits_per_row"] == 41  # ceil(log2 C(128, 8))
    assert sizes["verl_dense_int16_padded"] == (2048 + 6144) * 48 * 8 * 2  # verl pads every sample to P + R
    assert sizes["verl_dense_int16_padded"] > sizes["verl_jagged_int16"] > sizes["vllm_uint8_ndarray"]
    assert sizes["vllm_uint8_ndarray"] > sizes["routereplay_compact_ordered"] > sizes["routereplay_compact_set"]
    assert record["ratios"]["dense_over_compact"] > 4  # ~5.1 x: 16 bits per id padded against 41 bits per row
    assert "x smaller than verl's padded tensor" in verl_routes.markdown(record)


def test_bench_verl_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"tokens 1-8192 must lie in \[2, prompt_length"):
        verl_routes.VerlRoutesBenchConfig(min_tokens=1)
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        verl_routes.VerlRoutesBenchConfig(tool_fraction=1.0)
