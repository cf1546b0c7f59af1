"""Engines that run models and return routes with their rollouts.

Files (each folder's `__init__.py` lists its own):
- `hf/`      the built-in engine: `HFEngine` (KV cache, bf16 by default, route capture like vLLM's,
            `prefix_routes` to force a resumed prefix) and `HFProcessEngine` (the same in a child process)
- `vllm/`    a real vLLM: `VLLMEngine` in-process, `VLLMServer`, the checkpoint vLLM loads, and the
            route-forcing plugin
- `remote/`  `VLLMClient` / `SGLangClient`: remote servers over bounded HTTP, responses decoded and checked

The wire decoders are `routereplay.wire`; engines import them, never the other way round.
"""
