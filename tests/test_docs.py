"""Every fenced Python block of README.md and docs/*.md runs, so the documentation cannot rot.

The blocks of one page run in order, in one fresh interpreter (a page's later blocks may use its
earlier names), in an empty folder with the demo cache pointed there, so a block can neither read
nor litter the checkout. A page whose blocks need an optional framework says so in `PAGE_MARKS`;
every page with a Python block must be listed there, so a new page is never skipped silently.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)

# the optional parts each page's blocks use (markers in tests/conftest.py turn them into skips)
PAGE_MARKS: dict[str, list[pytest.MarkDecorator]] = {
    "README.md": [pytest.mark.hf],
    "replay.md": [pytest.mark.hf],
    "engines.md": [pytest.mark.hf, pytest.mark.vllm, pytest.mark.xdist_group("vllm-live")],
    "layouts.md": [],
    "cluster-scale.md": [],
    "megatron.md": [pytest.mark.megatron],
    "trl.md": [pytest.mark.hf, pytest.mark.trl],
    "verl.md": [],
    "skyrl.md": [],
    "areal.md": [],
    "sglang.md": [],
    "route-forcing.md": [pytest.mark.hf, pytest.mark.vllm, pytest.mark.xdist_group("vllm-live")],
}


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def page_params() -> list[object]:
    return [pytest.param(page, marks=PAGE_MARKS.get(page.name, []), id=page.name) for page in PAGES if blocks(page)]


def test_every_page_with_python_is_listed() -> None:
    """A page with Python blocks and no entry in PAGE_MARKS would run without its markers: list it."""
    unlisted = [page.name for page in PAGES if blocks(page) and page.name not in PAGE_MARKS]
    assert unlisted == [], f"add {unlisted} to PAGE_MARKS in tests/test_docs.py"
    assert len(PAGES) > 5 and any(blocks(page) for page in PAGES)


def test_readme_fits_on_a_screen_and_links_its_guides() -> None:
    """README.md stays short (what, why, two commands, an example, the CLI, benchmarks, a file map) and
    links every guide in docs/, each of which exists."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)\)", readme))
    pages = {page.name for page in PAGES if page.parent.name == "docs"}
    assert linked == pages, f"linked but missing: {linked - pages}; not linked: {pages - linked}"


@pytest.mark.slow
@pytest.mark.parametrize("page", page_params())
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    source = "\n\n".join(blocks(page))
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text(source, encoding="utf-8")
    # a free port of its own: a page that starts a process group (accelerate in trl.md) must not collide
    # with a distributed test running on the other xdist worker (torch's default port is 29500)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "ROUTEREPLAY_CACHE": str(tmp_path / "cache"), "MASTER_PORT": str(port)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{page.name}: a Python block failed\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
