"""Fixtures of the rl tests that serve the demo model with vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TRAIN_STEPS = 60  # a model that runs; rewards do not matter to what the vLLM tests check


@pytest.fixture(scope="module")
def servable(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Any, Path]:
    """(model, tokenizer, checkpoint folder) of a small demo sibling that vLLM's CPU backend serves (head_dim
    64), trained briefly and saved with its tokenizer so the CLI can load it; one per test module."""
    from routereplay.rl.model import train_demo_model

    model, tokenizer = train_demo_model(
        "qwen3_moe", steps=TRAIN_STEPS, num_experts=16, num_hidden_layers=3, head_dim=64
    )
    folder = tmp_path_factory.mktemp("servable")
    model.save_pretrained(folder)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)
    return model, tokenizer, folder
