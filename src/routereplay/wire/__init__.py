"""Wire decoders: turn each inference engine's routed-experts payload into `RouteTrace`s.

One module per engine wire form (`vllm`, `sglang`, `megatron`) over shared pieces: `payload`
(containers: base64, pickle-free `.npy`, raw bytes, lists, tensors), `limits` (bounds checked
before allocating), `diagnosis` (which flat splits a payload fits) and `assembler` (shape rules
every decoder ends in). Nothing here runs a model or imports `routereplay.engines`; the engines
that do (`routereplay.engines`) import these decoders.
"""

from routereplay.wire.megatron import decode_megatron
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

__all__ = ["decode_megatron", "decode_sglang", "decode_vllm"]
