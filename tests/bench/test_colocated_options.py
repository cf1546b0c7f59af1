"""`bench replay-options --engine vllm`: off / R3 ids / R3 ids + weights / threshold against the in-process vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from routereplay.bench import colocated_options
from routereplay.errors import ConfigError
from tests.bench.options_record import MARGINS, checked_options

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]


def test_options_side_by_side_against_vllm_on_a_quickly_trained_demo_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path))
    config = colocated_options.VLLMOptionsBenchConfig(prompts=16, max_new_tokens=3, train_steps=2, margins=MARGINS)
    record = colocated_options.run(config)
    checked_options(record)  # the trainer dispatches vLLM's expert sets on every row, with or without its weights
    assert "| r3_ids_weights |" in colocated_options.markdown(record) and record["machine"]["vllm"].startswith("0.")


def test_the_vllm_variant_names_its_engine() -> None:
    with pytest.raises(ConfigError, match="this is the vLLM variant"):
        colocated_options.VLLMOptionsBenchConfig(engine="hf")
