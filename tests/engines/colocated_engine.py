"""The colocated vLLM engine the live tests share: one per tiny model per test session.

`start(family)` builds the tiny vLLM-servable model, rounds its weights to bf16 (what vLLM loads, so
the HF trainer holding them differs from vLLM by bf16 kernels only), starts `VLLMEngine` on it at
policy version 0, and records whether the start changed the trainer's random generators or the
in-process switch. `tests/engines/conftest.py` keeps one such engine per session (`colocated_qwen3`),
so every test module that drives it (`test_vllm_colocated`, `test_vllm_abort`) reuses one engine.
A test that syncs other weights into it syncs the original model back (policy version 0) before it ends.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

MAX_MODEL_LEN = 256
PERTURBATION = (
    0.05  # std of the noise on trainer weights (init std 0.02): log-probs move ~1-2 nats, every served tensor changes
)


@dataclass(slots=True)
class Colocated:
    """A running engine, the trainer model it was built from, and the RNG states around its start."""

    engine: Any  # routereplay.engines.vllm.colocated.VLLMEngine
    model: nn.Module
    rng_kept: bool
    env_before: str | None  # VLLM_ENABLE_V1_MULTIPROCESSING before the engine started


def bf16_rounded(model: nn.Module) -> nn.Module:
    """Round every float tensor to bf16 in place (kept fp32): the values the engine holds."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(torch.bfloat16).to(tensor.dtype))
    return model


def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """A bf16-rounded copy with seeded noise on every trainable tensor and on DeepSeek-V3's
    `e_score_correction_bias` buffers: the new weights of a weight sync."""
    trainer = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*trainer.named_parameters(), *trainer.named_buffers()]:
            if tensor.is_floating_point() and (tensor.requires_grad or name.endswith("e_score_correction_bias")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * PERTURBATION)
    return bf16_rounded(trainer)


def rng_states() -> bytes:
    """Python's, NumPy's and torch's global generator states, comparable."""
    return pickle.dumps((random.getstate(), np.random.get_state(), torch.random.get_rng_state().tolist()))


def start(family: str) -> Iterator[Colocated]:
    """A `VLLMEngine` on the family's bf16-rounded tiny model, closed when the generator is."""
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer

    model = bf16_rounded(tiny_vllm_model(family))
    before = rng_states()
    env_before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    engine = VLLMEngine(model, word_tokenizer(), config=EngineConfig(max_model_len=MAX_MODEL_LEN), policy_version=0)
    try:
        yield Colocated(engine, model, rng_states() == before, env_before)
    finally:
        engine.close()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random word-token prompts (ids 4..999: no special token) of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 1000, size=n).tolist() for n in lengths]
