"""`ResponsePipeline`: vLLM HTTP response bodies to every rank's replay-ready tensor, stage by stage.

The bodies are what a vLLM >= 0.22 OpenAI-compatible server returns for non-streaming completions
with `--enable-return-routed-experts`: JSON whose `choices[0]` holds `prompt_token_ids`, `token_ids`
and `routed_experts`, base64 of the `.npy` bytes of a uint8 (N - 1, L, K) array. They are built in
memory; one pass runs, in order:

1. `decode`: `json.loads` of each body and `decode_vllm(..., validate=False)` and its token ids;
2. `store`: `RouteStore.add_turn` of each sample (validated while encoded, set codec); the two run
   response by response, as a driver receives them, and each is timed on its own;
3. `plan`: every rank's layout plan over the batch: `pack` the samples into one row, `ulysses_shard`
   it over `sp` ranks (run on token numbers, `layout.plan`);
4. `bundles`: `bundles_for` cuts each rank's spans from the store without decoding;
5. `ranks`: each rank parses and decodes its bundle into a torch tensor (`RankBundle(...).to_torch()`),
   all ranks in turn in this process; with `buffers`, into the host buffer each rank keeps from step
   to step (`to_torch(out=...)`: no fresh pages to fault in and zero every step).

Legend: B = samples, S = padded positions (the longest sample), N = tokens of a sample, L = layers,
K = top-k, P = rows of one rank's layout.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from routereplay.layout import pack, ulysses_shard, unpad
from routereplay.layout.plan import token_index
from routereplay.store.route_store import RouteStore
from routereplay.transport.bundle import RankBundle
from routereplay.transport.spans import bundles_for
from routereplay.wire.payload import npy_bytes
from routereplay.wire.vllm import decode_vllm

STAGES = ("decode", "store", "plan", "bundles", "ranks")
PROMPT_TOKENS = 512  # prompt tokens of each sample (at most half of it); the rest were generated


def response_body(index: int, tokens_N: np.ndarray, routes_TLK: np.ndarray, num_experts: int) -> bytes:
    """The HTTP body of one non-streaming completion with its routes (vLLM >= 0.22)."""
    prompt = min(PROMPT_TOKENS, len(tokens_N) // 2)
    wire = np.uint8 if num_experts <= 256 else np.uint16
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": "stop",
        "prompt_token_ids": tokens_N[:prompt].tolist(),
        "token_ids": tokens_N[prompt:].tolist(),
        "routed_experts": base64.b64encode(npy_bytes(routes_TLK.astype(wire))).decode("ascii"),
    }
    usage = {"prompt_tokens": prompt, "completion_tokens": len(tokens_N) - prompt, "total_tokens": len(tokens_N)}
    document = {"id": f"cmpl-{index}", "object": "text_completion", "model": "Qwen/Qwen3-30B-A3B"}
    return json.dumps({**document, "choices": [choice], "usage": usage}).encode()


def rank_plans(lengths: Sequence[int], positions: int, sp: int) -> list[torch.Tensor]:
    """Each SP rank's rows of the packed batch (flat b * positions + s, -1 = padding)."""
    index_BS = token_index(len(lengths), positions)
    packed = pack(unpad(index_BS, torch.tensor(list(lengths))))
    return [ulysses_shard(packed.values, sp, rank) for rank in range(sp)]


@dataclass(frozen=True, slots=True)
class ResponsePipeline:
    """The bodies of one batch and the store's geometry; `run()` is one pass, timed by stage."""

    bodies: list[bytes]
    num_experts: int
    layers: tuple[int, ...]
    top_k: int
    sp: int

    def run(self, buffers: Sequence[torch.Tensor] | None = None) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Seconds of every stage and each rank's (P, L, K) tensor; `buffers` (one per rank, at least its
        rows) are decoded into, as a trainer decodes into the host buffer it keeps from step to step."""
        seconds: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[stage], clock = now - clock, now

        # one response at a time, as a driver receives them: decoded, then stored (validated while
        # encoded), so each sample's decoded ids are dropped before the next response is read
        store = RouteStore(num_experts=self.num_experts, layers=self.layers, top_k=self.top_k)
        lengths: list[int] = []
        decode_s = store_s = 0.0
        for i, body in enumerate(self.bodies):
            t0 = time.perf_counter()
            choice = json.loads(body)["choices"][0]
            tokens_N = np.array(choice["prompt_token_ids"] + choice["token_ids"], np.int64)
            # validate=False: add_turn validates each row while it encodes it (one pass over the rows)
            routes = decode_vllm(choice["routed_experts"], num_experts=self.num_experts, validate=False)
            t1 = time.perf_counter()
            store.add_turn(i, tokens_N, routes)
            lengths.append(len(tokens_N))
            del choice, routes
            t2 = time.perf_counter()
            decode_s, store_s = decode_s + t1 - t0, store_s + t2 - t1
        seconds["decode"], seconds["store"] = decode_s, store_s
        clock = time.perf_counter()
        positions = max(lengths)
        plans = rank_plans(lengths, positions, self.sp)
        lap("plan")
        bundles = bundles_for(store, list(range(len(lengths))), plans, positions)
        lap("bundles")
        tensors = [
            RankBundle(data, expected_rows=int(plan.numel())).to_torch(
                out=None if buffers is None else buffers[rank][: int(plan.numel())]
            )
            for rank, (data, plan) in enumerate(zip(bundles, plans, strict=True))
        ]
        lap("ranks")
        return seconds, tensors  # type: ignore[return-value]


def expected_rank_rows(routes: Sequence[np.ndarray], sp: int) -> list[torch.Tensor]:
    """Each rank's rows built without the store or bundles: every sample's route sets (sorted, as a
    set store reads them back) and a -1 row for its last token, packed, then sharded."""
    layers, top_k = routes[0].shape[1:]
    blank_1LK = np.full((1, layers, top_k), -1, routes[0].dtype)
    packed_NLK = torch.from_numpy(np.concatenate([part for r in routes for part in (np.sort(r, axis=2), blank_1LK)]))
    return [ulysses_shard(packed_NLK, sp, rank) for rank in range(sp)]


__all__ = ["STAGES", "ResponsePipeline", "expected_rank_rows", "rank_plans", "response_body"]
