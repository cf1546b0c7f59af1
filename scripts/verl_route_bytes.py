"""Bytes per sample of a verl batch's routes: routereplay's compact blobs vs verl 0.9.1's dense int16.

verl's agent loop pads every sample's routes into int16 `[1, prompt_length + response_length, L, K]`
(`agent_loop.py` l.783-809) and `left_right_2_no_padding` later makes them jagged (`[n, L, K]` per
sample, int16). routereplay puts one codec blob per sample in the non-tensor batch
(`routereplay.integrations.verl.compact_blob`: set mode by default, ceil(log2 C(E, K)) bits per
(token, layer) row; ordered mode keeps the router's order too), built here from the same traces
(`padded_routes` builds verl's padded tensor, so its bytes are measured, not computed).

The batch is Qwen3-30B-A3B-shaped by default: 48 MoE layers, top-8 of 128 experts, 64 samples of
1k-8k tokens, verl's prompt_length 2048 and response_length 6144. Each sample's last token has no
route (-1), and `--tool-fraction` of each response is a tool span no engine routed (-1). Route sets are
drawn uniformly (a table of 65,536 random top-8 sets, indexed at random): the set codec is fixed-rate,
so skew would not shrink it (only `compress=True` would).

Run: .venv/bin/python scripts/verl_route_bytes.py [--samples 64] > out.json   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from routereplay.codec import bits_per_row, decode
from routereplay.integrations.verl import compact_blob, padded_routes
from routereplay.trace import RouteTrace


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # model shape (Qwen3-30B-A3B)
    parser.add_argument("--layers", type=int, default=48, help="MoE layers")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    # batch shape (verl's rollout config)
    parser.add_argument("--samples", type=int, default=64, help="samples in the batch")
    parser.add_argument("--min-tokens", type=int, default=1024, help="shortest sample (prompt + response)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="longest sample (prompt + response)")
    parser.add_argument("--prompt-length", type=int, default=2048, help="verl rollout.prompt_length (P)")
    parser.add_argument("--response-length", type=int, default=6144, help="verl rollout.response_length (R)")
    parser.add_argument("--tool-fraction", type=float, default=0.0, help="share of each response no engine routed")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def sample_trace(rng: np.random.Generator, sets_QK: np.ndarray, tokens: int, response: int, args: argparse.Namespace):
    """A merged rollout trace of `tokens` tokens: rows [0, tokens - 1), -1 on the tool span."""
    rows = tokens - 1
    experts_TLK = sets_QK[rng.integers(0, len(sets_QK), size=(rows, args.layers))]
    tool = int(response * args.tool_fraction)
    if tool:
        begin = tokens - response + int(rng.integers(0, response - tool + 1))
        experts_TLK[begin : min(begin + tool, rows)] = -1
    return RouteTrace(experts_TLK, args.experts, layers=range(args.layers))


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    keys = rng.random((1 << 16, args.experts), dtype=np.float32)
    sets_QK = np.argpartition(keys, args.top_k, axis=1)[:, : args.top_k].astype(np.int16)
    dense = jagged = engine = compact = ordered = 0
    encode_s = decode_s = 0.0
    total_tokens = 0
    for _ in range(args.samples):
        tokens = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        low = max(1, tokens - args.response_length)
        prompt = int(rng.integers(low, min(args.prompt_length, tokens - 1) + 1))
        response = tokens - prompt
        trace = sample_trace(rng, sets_QK, tokens, response, args)
        padded = padded_routes(
            trace,
            prompt_len=prompt,
            response_len=response,
            prompt_length=args.prompt_length,
            response_length=args.response_length,
        )
        dense += padded.numel() * padded.element_size()
        jagged += tokens * args.layers * args.top_k * 2  # int16 [n, L, K] after left_right_2_no_padding
        engine += (tokens - 1) * args.layers * args.top_k * 1  # vLLM's uint8 ndarray (E <= 256), MoE layers only
        start = time.perf_counter()
        blob = compact_blob(trace)
        encode_s += time.perf_counter() - start
        start = time.perf_counter()
        decode(blob)
        decode_s += time.perf_counter() - start
        compact += len(blob)
        ordered += len(compact_blob(trace, mode="ordered"))
        total_tokens += tokens
    n = args.samples
    report = {
        "shape": {"layers": args.layers, "top_k": args.top_k, "experts": args.experts},
        "batch": {
            "samples": n,
            "tokens": [args.min_tokens, args.max_tokens],
            "mean_tokens": total_tokens / n,
            "prompt_length": args.prompt_length,
            "response_length": args.response_length,
            "tool_fraction": args.tool_fraction,
        },
        "bytes_per_sample": {
            "verl_dense_int16_padded": dense / n,
            "verl_jagged_int16": jagged / n,
            "vllm_uint8_ndarray": engine / n,
            "routereplay_compact_set": compact / n,
            "routereplay_compact_ordered": ordered / n,
        },
        "batch_bytes": {"verl_dense_int16_padded": dense, "routereplay_compact_set": compact},
        "ratio_dense_over_compact": dense / compact,
        "ratio_jagged_over_compact": jagged / compact,
        "set_bits_per_row": bits_per_row(args.experts, args.top_k, "set"),
        "encode_ms_per_sample": 1e3 * encode_s / n,
        "decode_ms_per_sample": 1e3 * decode_s / n,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
