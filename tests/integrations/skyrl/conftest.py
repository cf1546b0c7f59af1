"""The SkyRL tests' two test-venv shims, and one gloo rank.

SkyRL 0.4.0 declares Requires-Python >= 3.12; its modules run on this 3.11 venv (.venv-skyrl, `make test-skyrl`)
with two shims that users on 3.12 with SkyRL's CUDA stack never need (named in the Makefile and docs/skyrl.md):

- `typing.TypedDict` is aliased to `typing_extensions.TypedDict` before SkyRL is imported: pydantic refuses
  `typing.TypedDict` on Python < 3.12 ("use typing_extensions.TypedDict"), which `skyrl/tinker/types.py` uses;
- `shims/` goes on sys.path when `flash_attn` does not import: SkyRL's `workers/model_wrapper.py` imports
  `flash_attn.bert_padding` (`pad_input`, `unpad_input`), and flash-attn does not build without CUDA;
  `shims/flash_attn/bert_padding.py` is a pure-PyTorch module of our own with the same signatures.
"""

from __future__ import annotations

import importlib.util
import sys
import typing
from pathlib import Path

import pytest
import typing_extensions

SHIMS = Path(__file__).parent / "shims"


def install_shims() -> None:
    """Both shims, idempotent, only where SkyRL is installed (.venv-skyrl: the main venv's test session, which
    collects these tests and skips them, keeps its typing and finds no flash_attn); also called in the ranks a
    test spawns (they do not run this conftest)."""
    if importlib.util.find_spec("skyrl") is None:
        return
    if sys.version_info < (3, 12):
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    if importlib.util.find_spec("flash_attn") is None and str(SHIMS) not in sys.path:
        sys.path.append(str(SHIMS))


install_shims()


@pytest.fixture(scope="module")
def world() -> None:
    """One gloo rank (world size 1), as SkyRL's worker would have set up on its device."""
    pytest.importorskip("skyrl")
    import torch.distributed as dist

    from tests.distributed.launch import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
