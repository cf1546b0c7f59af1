"""Engine payloads built exactly the way each engine builds them (for decoder tests).

- vLLM >= 0.22: np.save of the uint8/uint16 array, then base64 (per choice).
- vLLM 0.21: nested lists (`.tolist()`), prompt and generated parts apart, -1 for cached rows.
- SGLang: the int32 tensor's raw bytes, then base64, in meta_info / sglext / sgl_ext.
- Megatron: moe_topk_indices as nested lists of an int16 array.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch


def distinct_routes(rng: np.random.Generator, tokens: int, layers: int, top_k: int, num_experts: int) -> np.ndarray:
    keys = rng.random((tokens * layers, num_experts))
    return np.argsort(keys, axis=1)[:, :top_k].reshape(tokens, layers, top_k)


def vllm_npy_b64(routes: np.ndarray, num_experts: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if num_experts <= 256 else np.uint16))
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def vllm_response(choices: list[str | None]) -> dict[str, Any]:
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "model": "test-moe",
        "choices": [
            {"index": i, "text": "x", "finish_reason": "stop", "routed_experts": c} for i, c in enumerate(choices)
        ],
    }


def vllm_021_response(prompt: np.ndarray, generated: np.ndarray) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "prompt_routed_experts": prompt.astype(np.int16).tolist(),
        "choices": [{"index": 0, "text": "x", "routed_experts": generated.astype(np.int16).tolist()}],
    }


def sglang_b64(routes: np.ndarray, dtype: str = "int32") -> str:
    tensor = torch.from_numpy(np.ascontiguousarray(routes)).to(getattr(torch, dtype))
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("utf-8")


def sglang_generate(routes: np.ndarray, prompt_tokens: int, completion_tokens: int, **meta: Any) -> dict[str, Any]:
    return {
        "text": "x",
        "meta_info": {
            "id": "req-1",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "routed_experts": sglang_b64(routes, meta.pop("dtype", "int32")),
            **meta,
        },
    }
