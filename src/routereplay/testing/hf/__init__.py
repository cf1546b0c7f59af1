"""Tiny Hugging Face MoE models built from config: every MoE model type of transformers, shrunk.

Files:
- `models.py`   `tiny_model` / `tiny_config` by model type, `MOE_MODEL_TYPES`, `EXCLUDED` (with reasons), and
                which of them the installed transformers release has (`installed_moe_model_types`)
- `sizes.py`    the shrunk sizes and the per-family overrides
- `surgery.py`  how a config is shrunk: layers kept (dense-first, hybrid patterns), heads, ropes, encoders
"""

from routereplay.testing.hf.models import (
    ADDED_IN,
    BROKEN_IN,
    EXCLUDED,
    MOE_MODEL_TYPES,
    installed_exclusions,
    installed_moe_model_types,
    moe_layer_indices,
    text_vocab_size,
    tiny_config,
    tiny_model,
)

__all__ = [
    "ADDED_IN",
    "BROKEN_IN",
    "EXCLUDED",
    "MOE_MODEL_TYPES",
    "installed_exclusions",
    "installed_moe_model_types",
    "moe_layer_indices",
    "text_vocab_size",
    "tiny_config",
    "tiny_model",
]
