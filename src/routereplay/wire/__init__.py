"""Wire decoders: each inference engine's routed-experts payload as a validated `RouteTrace`.

Files:
- `vllm.py`            `decode_vllm`: offline arrays, `RequestOutput`, base64 `.npy` per choice (0.22+),
                       nested lists with -1 prefix rows (0.21), `prompt_start`
- `sglang.py`          `decode_sglang`: `/generate` `meta_info`, OpenAI `sglext` / `sgl_ext`, raw
                       bytes of any routed-experts dtype, tensors
- `megatron.py`        `decode_megatron`: `moe_topk_indices`, and Megatron-LM 0.20's `["ndarray", {...}]`
- `indexer_topk.py`    `decode_sglang_indexer`: SGLang's DSA indexer top-k, `meta_info.indexer_topk`
- `payload.py`         the containers: strict base64, pickle-free `.npy`, raw bytes, lists, tensors
- `base64_kernel.c`    strict base64 in C (built at install, optional): `payload.py`'s fast path
- `assembler.py`       the shape rules every decoder ends in: row count, layer selection, top-k
- `limits.py`          `WireLimits`: rows, layers and top-k accepted, checked before allocating
- `diagnosis.py`       which (num_layers, top_k) splits a flat payload fits, for the error message

Nothing here runs a model or imports `routereplay.engines`; the engines import these decoders.
"""

from routereplay.wire.indexer_topk import decode_sglang_indexer
from routereplay.wire.limits import WireLimits
from routereplay.wire.megatron import decode_megatron
from routereplay.wire.sglang import decode_sglang
from routereplay.wire.vllm import decode_vllm

__all__ = ["WireLimits", "decode_megatron", "decode_sglang", "decode_sglang_indexer", "decode_vllm"]
