"""Hostile JSON trace files (nesting 100 000 deep, a 5000-digit number, "choices" of the wrong type):
`read_trace` raises a RouteReplayError, never RecursionError / ValueError / TypeError, and `inspect` exits
1 or 2 with one line and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from routereplay import RouteReplayError
from routereplay.cli.main import main
from routereplay.tracefile.io import read_trace
from routereplay.tracefile.payload import PayloadHints

HOSTILE_JSON = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep_dict": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "long_number": '{"choices": [{"routed_experts": ' + "9" * 5000 + "}]}",
    "choices_int": '{"choices": 5}',
    "choices_true": '{"choices": true}',
    "choices_float": '{"choices": 1.5}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_read_trace_refuses_hostile_json_by_name(tmp_path: Path, name: str) -> None:
    """Read_trace on deeply nested JSON, a
    5000-digit number, "choices": 5 / true / 1.5 raises a RouteReplayError (no RecursionError,
    ValueError or TypeError)."""
    path = tmp_path / f"{name}.json"
    path.write_text(HOSTILE_JSON[name])
    with pytest.raises(RouteReplayError):
        read_trace(path, PayloadHints(num_experts=8, num_layers=2, top_k=2))


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_inspect_on_hostile_json_exits_1_or_2_in_one_line(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11 item 10 (error that is not a RouteReplayError): `inspect` on hostile JSON prints no
    traceback and exits 1 (invalid) or 2 (unreadable), never a crash."""
    path = tmp_path / f"{name}.json"
    path.write_text(HOSTILE_JSON[name])
    code = main(["inspect", str(path), "--num-experts", "8"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code in (1, 2)
    assert err.strip().count("\n") == 0, err
