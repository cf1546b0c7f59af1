"""Engines that run models: the built-in HF engine, the colocated vLLM engine, remote clients.

The wire decoders moved to `routereplay.wire`; `decode_megatron`, `decode_sglang` and `decode_vllm`
are re-exported here so existing `from routereplay.engines import decode_vllm` keeps working.
"""

from routereplay.wire import decode_megatron, decode_sglang, decode_vllm

__all__ = ["decode_megatron", "decode_sglang", "decode_vllm"]
