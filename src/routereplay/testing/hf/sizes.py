"""The shrink tables of the tiny HF models: target sizes, config keys and per-family overrides.

`routereplay.testing.hf.surgery` applies the sizes and key lists to every config (the generic shrink);
the overrides below are applied after it, for the families whose defaults break or stay dense.

Per-family overrides (`TEXT_OVERRIDES` by text-config model_type, `OVERRIDES` by model_type):
- dbrx: attn_config.rope_theta / clip_qkv (needed by the attention), ffn_config experts 8 / top-k 2.
- deepseek_ocr2_text: mlp_layer_types [dense, sparse, sparse] (default None breaks the model).
- doge: is_moe=True, 16 experts (product-key routing needs a square count).
- dots1: one shared expert (default None breaks the model).
- dots3_note_text: per_layer_config of the sliding-window MLA layer (own head layout).
- gemma4_text: enable_moe_block=True (the default Gemma 4 config is dense).
- glm5_next_text: index_kpool 2 (index_topk must be a multiple).
- glm4v_moe_text / ernie4_5_vl_moe_text: explicit mrope_section for head_dim 16.
- granitemoehybrid: [mamba, attention, mamba] (the default is all-mamba).
- hunyuan_v1_moe: per-layer moe_topk list [2, 2].
- inkling2_loop_text (also inside inkling2_loop): 4 layers, an attention-residual block per layer, layers 1-2
  looped twice (the default loops layers 6-17, past the tiny model's layers: no loop would run).
- jamba: 4 layers, attention at 2, experts at 1 and 3.
- jetmoe: 2 kv heads (it has no num_attention_heads).
- lfm2_moe: layer_types [conv, full_attention, conv] (the default None breaks the model).
- nemotron_h (also inside nemotron_h_omni, nemo_speechlm): [mamba, moe, attention, moe].
- nemotron_h_omni: vision video_temporal_patch_size 2 (validated against the top level).
- qwen3_omni_moe_thinker: vision_start_token_id (read by the 3-D position ids, missing otherwise).
- qwen4_exp_text: indexer sizes (None by default), hyper-connection / PLE widths.
- step3p5 (step3p7 text): sliding_window 8 (None by default, needed).
- zaya: top-1 (the only top-k it supports).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_top_k")
SPARSE_KINDS = frozenset(("sparse", "moe", "hash_moe"))
DENSE_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
INDEX_LIST_KEYS = ("moe_layers", "mlp_only_layers", "kv_source_layers")
# PretrainedConfig arguments that are not part of a model's architecture
BASE_ARGS = frozenset(
    (
        "transformers_version",
        "architectures",
        "output_hidden_states",
        "return_dict",
        "dtype",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
    )
)

NUM_EXPERTS = 8
TOP_K = 2
HEADS = 4
HEAD_DIM = 16
TEXT_SIZES: Mapping[str, int] = {
    "vocab_size": 128,
    "unpadded_vocab_size": 128,  # inkling2 (5.24+): the LM head's width; the rows past it are dropped
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "dense_intermediate_size": 64,
    "prefix_dense_intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "share_expert_dim": 32,
    "moe_hidden_size": 32,
    "num_attention_heads": HEADS,
    "n_heads": HEADS,
    "max_position_embeddings": 128,
    "max_seq_len": 128,
    "model_max_length": 128,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "o_groups": 2,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "sliding_window_size": 8,
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": HEAD_DIM,
    "rel_extent": 16,
    "kv_channels": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_n_heads": 8,  # granitemoehybrid: n_heads * d_head == expand (2) * hidden
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_dt_rank": 8,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "chunk_size": 16,
    "mamba_chunk_size": 16,
    "router_hidden_size": 16,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "zero_expert_num": 4,
    "num_nextn_predict_layers": 0,
    "num_mtp_layers": 0,
}
ENCODER_SIZES: Mapping[str, int] = {
    "hidden_size": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "encoder_ffn_dim": 64,
    "mlp_dim": 64,
    "num_hidden_layers": 1,
    "depth": 1,
    "encoder_layers": 1,
    "num_attention_heads": 2,
    "num_heads": 2,
    "encoder_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "projection_intermediate_size": 32,
    "projection_hidden_dim": 64,
    "output_channels": 32,
    "downsample_hidden_size": 16,
    "max_img_size": 64,
}
ENCODER_TO_TEXT_KEYS = (
    "out_hidden_size",
    "adapter_out_dim",
    "text_hidden_size",
    "output_dim",
    "vision_output_dim",
    "projector_input_dim",
    "projector_output_dim",
)
ENCODER_SELF_KEYS = ("adapter_in_dim", "adapter_input_size", "audio_hidden_size")
TOP_TO_TEXT_KEYS = ("projector_hidden_size", "projection_hidden_size", "merged_hidden_size", "out_hidden_size")

# applied to a text config (top level or `text_config`) of that text model_type, after the generic shrink
TEXT_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "deepseek_ocr2_text": {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
    "doge": {"is_moe": True, "num_experts": 16},
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {
        "per_layer_config": {
            "2": {  # the sliding-window MLA layer
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "q_lora_rank": 32,
                "kv_lora_rank": 32,
                "head_dim": 16,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
            }
        }
    },
    "ernie4_5_vl_moe_text": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}
    },
    "gemma4_text": {"enable_moe_block": True, "moe_intermediate_size": 32},
    "glm4v_moe_text": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 2, 1],
        }
    },
    "glm5_next_text": {"index_kpool": 2},
    "granitemoehybrid": {
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    },
    "hunyuan_v1_moe": {"moe_topk": [TOP_K, TOP_K]},
    "inkling2_loop_text": {
        "num_hidden_layers": 4,
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        "n_layers_per_attn_res_block": 1,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 3,
        "loop_num_passes": 2,
    },
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "jetmoe": {"num_key_value_heads": 2},
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 16,
        "ple_embed_dim": 16,
    },
    "step3p5": {"sliding_window": 8},
    "zaya": {"num_experts_per_tok": 1},
}
# applied to the whole (composite) config of that model_type, dotted paths reach into sub-configs
OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "dbrx": {
        "attn_config.rope_theta": 10000.0,
        "attn_config.clip_qkv": 8.0,
        "ffn_config.moe_num_experts": NUM_EXPERTS,
        "ffn_config.moe_top_k": TOP_K,
        "ffn_config.ffn_hidden_size": 32,
    },
    "nemotron_h_omni": {"vision_config.video_temporal_patch_size": 2},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
}
