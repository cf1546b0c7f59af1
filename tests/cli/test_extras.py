"""Optional packages are checked before a command starts its work (matplotlib, tensorboard, zstandard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, encode
from routereplay.cli.extras import EXTRAS, Extra, importable, require
from routereplay.cli.main import EXIT_ERROR
from routereplay.errors import MissingDependencyError, RouteReplayError
from tests.wire.payloads import distinct_routes

SRC = Path(__file__).resolve().parents[2] / "src"

# run the CLI with some modules made unimportable, as if their package were not installed
WITHOUT = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "from routereplay.cli.main import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def run_without(modules: list[str], args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "ROUTEREPLAY_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(modules), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.hf
def test_demo_without_matplotlib_stops_before_training(tmp_path: Path) -> None:
    """Data loss (issue 11 item 24): `routereplay demo --json` without matplotlib trained for minutes, then
    failed writing the report and lost the output; it now refuses at once, naming the extra to install."""
    cache = tmp_path / "cache"
    result = run_without(["matplotlib"], ["demo", "--json", "--prompts", "8", "--train-steps", "3"], cache)
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "MissingDependencyError" in result.stderr and "matplotlib" in result.stderr
    assert "pip install 'routereplay[demo]'" in result.stderr and "--no-report" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not cache.exists(), "no demo model was trained before the refusal"
    assert "training" not in result.stderr


@pytest.mark.hf
def test_train_plot_and_tensorboard_need_their_packages_before_training(tmp_path: Path) -> None:
    """Data loss (issue 11 item 24): `train --plot` / `--tensorboard` without their packages are refused before
    the demo model is trained, naming what to install."""
    cache = tmp_path / "cache"
    args = ["train", "--steps", "1", "--train-steps", "3", "--plot", str(tmp_path / "p.png")]
    result = run_without(
        ["matplotlib", "torch.utils.tensorboard"], [*args, "--tensorboard", str(tmp_path / "tb")], cache
    )
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "matplotlib for --plot" in result.stderr and "pip install 'routereplay[demo]'" in result.stderr
    assert "tensorboard for --tensorboard" in result.stderr and "pip install tensorboard" in result.stderr
    assert not cache.exists() and not (tmp_path / "p.png").exists()


def test_convert_zstd_without_zstandard_writes_nothing(tmp_path: Path, rng: np.random.Generator) -> None:
    """Error that is not a RouteReplayError (issue 11 item 24): `convert --zstd` without zstandard raised a bare
    ImportError traceback after reading; it is refused first, one line naming the `zstd` extra."""
    source = tmp_path / "t.rrt"
    source.write_bytes(encode(RouteTrace(distinct_routes(rng, 4, 2, 2, 8), 8)))
    target = tmp_path / "out.rrt"
    result = run_without(["zstandard"], ["convert", str(source), str(target), "--zstd"], tmp_path / "cache")
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "zstandard for --zstd (pip install 'routereplay[zstd]')" in result.stderr
    assert "Traceback" not in result.stderr and not target.exists()


def test_require_names_every_missing_package_and_is_a_route_replay_error() -> None:
    """Error that is not a RouteReplayError (issue 11 item 24): the refusal is a named RouteReplayError that is
    also an ImportError, listing every missing package with what needs it and its install command."""
    extras = {
        **EXTRAS,
        "ghost": Extra("routereplay_no_such_module", "pip install ghost"),
        "phantom": Extra("routereplay_no_such_module.sub", "pip install 'routereplay[phantom]'"),
    }
    require("demo", {"json": "parsing"}, extras={"json": Extra("json", "-")})  # present: no error
    with pytest.raises(MissingDependencyError) as refusal:
        require(
            "demo",
            {"json": "x", "ghost": "--ghost", "phantom": "the plots"},
            extras={**extras, "json": Extra("json", "-")},
        )
    message = str(refusal.value)
    assert message == (
        "routereplay demo needs ghost for --ghost (pip install ghost); phantom for the plots "
        "(pip install 'routereplay[phantom]'); nothing was run"
    )
    assert isinstance(refusal.value, RouteReplayError) and isinstance(refusal.value, ImportError)
    assert importable("json") and not importable("routereplay_no_such_module")


@pytest.mark.zstd
def test_inspect_zstd_file_without_zstandard_is_unreadable_in_one_line(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """Error that is not a RouteReplayError (issue 11 item 24): a zstd codec file read without zstandard raised a
    bare ImportError traceback; inspect calls it unreadable (exit 2, a JSON verdict) and names the extra."""
    path = tmp_path / "t.rrt"
    path.write_bytes(encode(RouteTrace(distinct_routes(rng, 40, 2, 2, 8), 8), compress=True))
    result = run_without(["zstandard"], ["inspect", str(path), "--json"], tmp_path / "cache")
    assert result.returncode == EXIT_ERROR, result.stderr
    assert "Traceback" not in result.stderr and "routereplay[zstd]" in result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["readable"] is False and "routereplay[zstd]" in verdict["error"]


# -- issue 38 items 15 and 18: a missing vLLM and a bad --url, before any heavy import ----------------------------

# run each command line (JSON lists on argv) with vLLM not installed; print its exit status and whether torch (the
# heavy import every such command makes before its work) was imported by then
NO_VLLM = (
    "import json, sys\n"
    "sys.modules['vllm'] = None\n"
    "from routereplay.cli.main import main\n"
    "for args in map(json.loads, sys.argv[1:]):\n"
    "    print(main(args), 'torch' in sys.modules, flush=True)\n"
)


def test_a_missing_vllm_and_a_bad_url_are_refused_before_any_heavy_import(tmp_path: Path) -> None:
    """Issue 38 item 18: a missing vLLM was named after seconds of imports (7-14 s under load), and
    `bench replay-options --engine vllm` even trained the demo model's vLLM variant first (108 s here);
    `train --url not-a-url` trained or loaded the demo model first. Each is refused before torch is imported.
    Item 15: the advice names the CPU extra and how to keep a GPU vLLM."""
    commands = [
        ["demo", "--engine", "vllm", "--no-report"],
        ["train", "--engine", "vllm", "--mode", "R3"],
        ["bench", "vllm"],
        ["bench", "replay-options", "--engine", "vllm"],
        ["bench", "async", "--engine", "vllm"],
        ["train", "--engine", "vllm", "--url", "not-a-url"],
    ]
    env = {**os.environ, "PYTHONPATH": str(SRC), "ROUTEREPLAY_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", NO_VLLM, *map(json.dumps, commands)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.stdout.splitlines() == [f"{EXIT_ERROR} False"] * len(commands), result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == len(commands) and "Traceback" not in result.stderr
    for line in lines[:-1]:
        assert "MissingDependencyError" in line and "needs vLLM" in line and "is not installed" in line
        assert "pip install 'routereplay[vllm]'" in line and "without the vllm extra" in line
        assert "'Beside a GPU vLLM'" in line
    assert "ConfigError: --url not-a-url: a server URL starts with http:// or https://" in lines[-1]
    assert not (tmp_path / "cache").exists()
