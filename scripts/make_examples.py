"""Write the bundled example payloads in src/routereplay/examples/ (seeded, reproducible).

Each file is byte-for-byte the wire form its engine sends, built the way that engine builds it:
- qwen3_30b_a3b_sglang.json: an SGLang `/generate` response for a Qwen3-30B-A3B-shaped model
  (48 MoE layers, top-8 of 128 experts): `meta_info.routed_experts` = base64 of raw int32 bytes.
- moonlight_vllm.json: a vLLM >= 0.22 `/v1/completions` response for a Moonlight-16B-A3B-shaped
  model (27 layers, layer 0 dense and zero-filled, top-6 of 64 experts): base64 of `.npy` uint8.
Routes are synthetic (a skewed, Zipf-like expert load like real routers), not from a real model.
Run: .venv/bin/python scripts/make_examples.py
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from routereplay.testing.synthetic import distinct_experts
from routereplay.wire.payload import npy_bytes

OUT = Path(__file__).resolve().parent.parent / "src" / "routereplay" / "examples"


def layered_routes(
    rng: np.random.Generator, num_rows: int, num_layers: int, top_k: int, num_experts: int
) -> np.ndarray:
    per_layer = [distinct_experts(rng, num_rows, top_k, num_experts, skew=0.6) for _ in range(num_layers)]
    return np.stack(per_layer, axis=1)  # (T, L, K)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261120)

    prompt_tokens, completion_tokens = 120, 181  # 301 tokens -> 300 rows
    routes = layered_routes(rng, prompt_tokens + completion_tokens - 1, 48, 8, 128).astype(np.int32)
    sglang = {
        "text": " 42",
        "meta_info": {
            "id": "3f1c0c4a9d2e4b7f",
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": 0,
            "routed_experts": base64.b64encode(routes.tobytes()).decode("ascii"),
        },
    }
    (OUT / "qwen3_30b_a3b_sglang.json").write_text(json.dumps(sglang) + "\n")

    num_tokens = 97
    moe = layered_routes(rng, num_tokens - 1, 26, 6, 64)
    all_layers = np.concatenate([np.zeros((num_tokens - 1, 1, 6), dtype=moe.dtype), moe], axis=1).astype(np.uint8)
    vllm = {
        "id": "cmpl-8b1e2f0c5a3d4e6f",
        "object": "text_completion",
        "created": 1795000000,
        "model": "moonshotai/Moonlight-16B-A3B-Instruct",
        "choices": [
            {
                "index": 0,
                "text": " The answer is 42.",
                "logprobs": None,
                "finish_reason": "stop",
                "routed_experts": base64.b64encode(npy_bytes(all_layers)).decode("ascii"),
            }
        ],
        "usage": {"prompt_tokens": 80, "completion_tokens": num_tokens - 80, "total_tokens": num_tokens},
    }
    (OUT / "moonlight_vllm.json").write_text(json.dumps(vllm) + "\n")
    for path in sorted(OUT.glob("*.json")):
        print(f"wrote {path.relative_to(OUT.parent.parent.parent)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
