"""SGLang's n > 1 answers: routes in `sglext` (choice 0's only) are refused for choice 1, not answered with
choice 0's; per-choice `sgl_ext` gives each choice its own routes."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from routereplay import decode_sglang
from routereplay.errors import AmbiguousChoiceError


def _openai_n2(choice_rows: list[np.ndarray]) -> dict:
    """An SGLang OpenAI-style n=2 response: sglext.routed_experts filled from choice 0 only."""
    blob = base64.b64encode(choice_rows[0].astype(np.int32).tobytes()).decode()
    return {
        "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
        "sglext": {"routed_experts": blob},
    }


def test_choice_1_of_routes_held_for_choice_0_only_is_refused() -> None:
    """Decode_sglang(resp, choice=1) on an n=2 OpenAI response whose
    routes sit in sglext (choice 0's only) is refused, not answered with choice 0's routes."""
    rows = [np.arange(3 * 2 * 2).reshape(3, 2, 2) % 8, (np.arange(3 * 2 * 2).reshape(3, 2, 2) + 3) % 8]
    response = _openai_n2(rows)
    first = decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=0)
    np.testing.assert_array_equal(np.asarray(first.experts), rows[0])
    with pytest.raises(AmbiguousChoiceError, match="choice"):
        decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=1)


def test_per_choice_sgl_ext_gives_each_choice_its_routes() -> None:
    """With per-choice sgl_ext, choice=1 gets choice 1's routes."""
    rows = [np.arange(12).reshape(3, 2, 2) % 8, (np.arange(12).reshape(3, 2, 2) + 3) % 8]
    response = {
        "choices": [
            {"index": i, "sgl_ext": {"routed_experts": base64.b64encode(r.astype(np.int32).tobytes()).decode()}}
            for i, r in enumerate(rows)
        ]
    }
    # distinct ids per row are needed for validation; build them from permutations instead
    trace = decode_sglang(response, num_layers=2, top_k=2, num_experts=8, choice=1, validate=False)
    np.testing.assert_array_equal(np.asarray(trace.experts), rows[1])
