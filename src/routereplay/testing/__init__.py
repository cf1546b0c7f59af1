"""Fixtures for tests, benchmarks, scripts and the docs' examples: tiny models and synthetic routes.

Nothing here downloads anything, and the core never imports this package (`tests/test_layering.py`).
Files:
- `hf/`              tiny Hugging Face MoE models of every MoE model type, built from their configs
- `vllm_models.py`   tiny models vLLM's CPU backend serves, a word tokenizer, checkpoints on disk
- `synthetic.py`     seeded random routes: distinct ids, optional skew and -1 rows
"""

from routereplay.testing.hf import MOE_MODEL_TYPES, tiny_config, tiny_model
from routereplay.testing.synthetic import distinct_experts, random_trace
from routereplay.testing.vllm_models import TinyFamily, build_checkpoint, tiny_vllm_model, word_tokenizer

__all__ = [
    "MOE_MODEL_TYPES",
    "TinyFamily",
    "build_checkpoint",
    "distinct_experts",
    "random_trace",
    "tiny_config",
    "tiny_model",
    "tiny_vllm_model",
    "word_tokenizer",
]
