"""`routereplay bench replay-options`: off / R3 ids / R3 ids + weights / threshold side by side on the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from routereplay.bench import options
from routereplay.errors import ConfigError
from tests.bench.options_record import MARGINS, checked_options

pytestmark = pytest.mark.hf


def test_options_side_by_side_on_a_quickly_trained_demo_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path))
    config = options.OptionsBenchConfig(prompts=24, max_new_tokens=3, train_steps=2, margins=MARGINS)
    record = options.run(config)
    found = checked_options(record)
    # margin 0 gives back every row the trainer would not choose: the live routing, counted
    assert found["threshold_0"]["replace_rate"] == pytest.approx(found["off"]["routing_disagreement"], abs=0.02)
    assert found["threshold_0"]["k3_kl"] == found["off"]["k3_kl"]
    assert "| r3_ids_weights |" in options.markdown(record)


def test_the_built_in_engines_variant_points_vllm_to_its_own_variant() -> None:
    with pytest.raises(ConfigError, match=r"built-in engine's variant.*replay-options --engine vllm"):
        options.OptionsBenchConfig(engine="vllm")
