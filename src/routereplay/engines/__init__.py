"""Engine adapters: decode each inference engine's routed-experts payload into `RouteTrace`s."""

from routereplay.engines.megatron import decode_megatron
from routereplay.engines.sglang import decode_sglang
from routereplay.engines.vllm import decode_vllm

__all__ = ["decode_megatron", "decode_sglang", "decode_vllm"]
