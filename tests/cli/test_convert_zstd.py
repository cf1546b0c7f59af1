"""`convert --zstd` says when compression made the file larger (issue 11 item 33)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from routereplay.cli.main import EXIT_OK, main

EXAMPLE = Path(__file__).resolve().parents[2] / "src" / "routereplay" / "examples" / "qwen3_30b_a3b_sglang.json"
FACTS = ["--num-layers", "48", "--top-k", "8", "--num-experts", "128"]


@pytest.mark.zstd
def test_zstd_that_grows_the_file_prints_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Misleading message (issue 11 item 33): random routes are already near their entropy after bit
    packing, so zstd adds its frame and the file grows; convert now says so instead of staying silent."""
    plain, packed = tmp_path / "plain.rrt", tmp_path / "zstd.rrt"
    assert main(["convert", str(EXAMPLE), str(plain), *FACTS]) == EXIT_OK
    assert "note: --zstd" not in capsys.readouterr().err
    assert main(["convert", str(EXAMPLE), str(packed), *FACTS, "--zstd"]) == EXIT_OK
    err = capsys.readouterr().err
    if packed.stat().st_size > plain.stat().st_size:
        match = re.search(r"note: --zstd made .* larger \((\d+) B against (\d+) B without it\)", err)
        assert match, err
        assert (int(match[1]), int(match[2])) == (packed.stat().st_size, plain.stat().st_size)
    else:
        assert "note: --zstd" not in err
