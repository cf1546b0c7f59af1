"""What both variants of `bench replay-options` report on the demo (`bench/options.py`, `bench/colocated_options.py`),
run with margins (0, 1e9)."""

from __future__ import annotations

from typing import Any

import pytest

MARGINS = (0.0, 1e9)


def checked_options(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The record's options, checked: side by side in order; R3 dispatches the engine's expert sets on every row,
    with or without its weights; a huge margin is plain R3; the weights cost 4 bytes a row (top-2, float16)."""
    found: dict[str, dict[str, Any]] = record["options"]
    assert list(found) == ["off", "r3_ids", "r3_ids_weights", "threshold_0", "threshold_1e+09"]
    assert found["r3_ids"]["routing_disagreement"] == found["r3_ids_weights"]["routing_disagreement"] == 0.0
    assert found["threshold_1e+09"]["replace_rate"] == 0.0
    assert found["threshold_1e+09"]["k3_kl"] == found["r3_ids"]["k3_kl"]  # a huge margin is plain R3
    size = record["bytes_per_row"]
    assert size["weights"] == 4 and size["blob_ids_weights"] - size["blob_ids"] == pytest.approx(4.0)
    return found
