"""Engines that run models and return routes with their rollouts.

Files:
- `hf.py`                 `HFEngine`: the built-in engine (KV cache, bf16 by default), route capture like
                          vLLM's, `prefix_routes` to force a resumed prefix; `SamplingParams`, `Rollout`
- `hf_process.py`         `HFProcessEngine`: the built-in engine in a child process, weights synced
                          through shared memory (fully-async RL)
- `hf_child.py`           the child process's side of `HFProcessEngine`
- `vllm/`                 a real vLLM: `VLLMEngine` in-process, `VLLMServer`, the checkpoint vLLM loads,
                          and the route-forcing plugin (`vllm/__init__.py` lists its files)
- `http.py`               the bounded HTTP transport: silence timeout, deadline, size cap, retries
- `remote.py`             `VLLMClient` / `SGLangClient`: remote servers' responses decoded and checked
- `remote_engine.py`      a remote server as a GRPO engine

The wire decoders are `routereplay.wire`; engines import them, never the other way round.
"""
