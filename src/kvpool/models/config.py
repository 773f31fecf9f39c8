"""Model configs: read a Hugging Face config.json (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral,
Gemma 2, Gemma 3 text, Granite and Granite MoE, GPT-OSS, DeepSeek-V2/V3, and the hybrids Bamba,
Granite MoE Hybrid and Qwen3-Next) into one validated dataclass, the KV layout a config
implies, and the built-in presets used by `kvpool plan` and the `tiny` model."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ConfigError
from kvpool.formats import DTYPES
from kvpool.memory import fp8
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout
from kvpool.models.hybrid_config import (
    HYBRID_ARCHITECTURES,
    MAMBA_PARSERS,
    GatedDeltaNetConfig,
    MambaConfig,
)
from kvpool.models.layers import ACTIVATIONS, UNGATED_ACTIVATIONS
from kvpool.models.parallel import TensorParallel
from kvpool.numeric import INT64_MAX, check_float32, check_int64

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "SeedOssForCausalLM",
    "ArceeForCausalLM",
    "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "ApertusForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "Glm4MoeForCausalLM",
    "Exaone4ForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    *HYBRID_ARCHITECTURES,
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "arcee": "ArceeForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "apertus": "ApertusForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Image-and-text checkpoints whose text decoder kvpool runs (the vision encoder is not loaded)
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
              "Mistral3ForConditionalGeneration": "MistralForCausalLM"}
# ... the text_config model_type that transformers builds that decoder from, where it builds
# whatever the model_type names ("mistral" where left out; Ministral 3's "ministral3" scales
# its queries by position, which kvpool does not); Gemma 3's text_config is a Gemma 3 one
# whatever it names
MULTIMODAL_TEXT_TYPES = {"Mistral3ForConditionalGeneration": "mistral"}
# ... and the text_config keys transformers' multimodal class leaves unapplied: Gemma 3's
# final logit softcap (only its Gemma3ForCausalLM caps)
MULTIMODAL_UNAPPLIED = {"Gemma3ForConditionalGeneration": {"final_logit_softcapping": None}}
QWEN3_MOE = "Qwen3MoeForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
GRANITE = "GraniteForCausalLM"
GRANITE_MOE = "GraniteMoeForCausalLM"
GRANITE_MOE_SHARED = "GraniteMoeSharedForCausalLM"
GRANITE_MOE_HYBRID = "GraniteMoeHybridForCausalLM"
# with Granite's multipliers
GRANITES = (GRANITE, GRANITE_MOE, GRANITE_MOE_SHARED, GRANITE_MOE_HYBRID)
OLMO2, OLMO3 = "Olmo2ForCausalLM", "Olmo3ForCausalLM"
MIXTRAL = "MixtralForCausalLM"
SEED_OSS = "SeedOssForCausalLM"
ARCEE = "ArceeForCausalLM"
ERNIE, ERNIE_MOE = "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"
ERNIES = (ERNIE, ERNIE_MOE)  # use_bias biases q, k, v, o and the MLP; q/k rotate in pairs
APERTUS = "ApertusForCausalLM"
GLM, GLM4 = "GlmForCausalLM", "Glm4ForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"
EXAONE4 = "Exaone4ForCausalLM"
SMOLLM3 = "SmolLM3ForCausalLM"
GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# GPT-OSS's experts' clamped SwiGLU: its gain and clamp as gpt-oss-20b and 120b have them,
# the only ones the activation (models/layers.py, "gpt_oss_swiglu") computes
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
FULL, SLIDING = "full_attention", "sliding_attention"  # the layer_types of config.json
# transformers' other names of a family's keys (its config's attribute_map), which a config may
# use instead: the other name -> the one read here
KEY_ALIASES: dict[str, dict[str, str]] = {
    ERNIE_MOE: {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k"},
    GLM4_MOE: {"num_local_experts": "n_routed_experts",
               "num_mtp_layers": "num_nextn_predict_layers"},
    "DeepseekV2ForCausalLM": {"num_experts": "n_routed_experts"},
    "DeepseekV3ForCausalLM": {"num_local_experts": "n_routed_experts",
                              "num_mtp_layers": "num_nextn_predict_layers"},
}
# transformers' defaults for the keys a config may leave out, where an architecture's differ
# from rope_theta 1e4, rms_norm_eps 1e-6, no sliding window, 4,096 positions, head_dim
# hidden_size / num_attention_heads, as many KV heads as heads and an untied lm_head
# (DeepSeek's: _deepseek; the experts': the MoE parsers). Qwen2's and Qwen3's 32 KV heads are
# left out: they divide only configs of 32 heads or more, and every published one states its own.
# Gemma 2's and Gemma 3's sizes when left out: transformers' (those of Gemma 2 2B)
GEMMA_SIZES = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}
ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "intermediate_size": 11008},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096,
                         "intermediate_size": 22016},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096,
                         "intermediate_size": 22016, "head_dim": 128},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4,
                            "intermediate_size": 6144},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 16,
                            "intermediate_size": 5632},
    QWEN3_NEXT: {"max_position_embeddings": 32768, "head_dim": 256,
                 "partial_rotary_factor": 0.25, "num_key_value_heads": 2,
                 "intermediate_size": 5632},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096,
                           "num_key_value_heads": 8, "intermediate_size": 14336},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "rope_theta": 1e6,
                           "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                           "intermediate_size": 14336},
    # Phi-3's trained context: its config's top-level key, which wins over the rope's
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    "GraniteForCausalLM": {"max_position_embeddings": 2048},
    "GraniteMoeForCausalLM": {"max_position_embeddings": 2048},
    "GraniteMoeSharedForCausalLM": {"max_position_embeddings": 2048},
    "GraniteMoeHybridForCausalLM": {"max_position_embeddings": 2048},
    "Olmo2ForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    OLMO3: {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
            "sliding_window": 4096},
    "SmolLM3ForCausalLM": {"max_position_embeddings": 32768, "rope_theta": 2e6,
                           "tie_word_embeddings": True},
    # Seed-OSS: q/k/v biased unless attention_bias is false, o only with attention_out_bias
    SEED_OSS: {"max_position_embeddings": 524288, "head_dim": 128, "attention_bias": True},
    ARCEE: {"rms_norm_eps": 1e-5, "hidden_act": "relu2"},  # an ungated MLP
    ERNIE: {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
            "head_dim": 128, "tie_word_embeddings": True},
    # (its head_dim, left out, is hidden_size / num_attention_heads)
    ERNIE_MOE: {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
                "tie_word_embeddings": True},
    # Apertus: an ungated xIELU MLP, Llama 3.1's rope scaling unless the config gives a rope
    APERTUS: {"max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "hidden_act": "xielu",
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0,
                                  "original_max_position_embeddings": 8192,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    # GLM-4 (and the first GLM-4, GLM): q/k/v biased unless attention_bias is false (o never),
    # half of each head rotated
    **dict.fromkeys((GLM, GLM4), {"max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-7,
                                  "head_dim": 128, "attention_bias": True,
                                  "partial_rotary_factor": 0.5}),
    # GLM-4.5: half of each head rotated (rotate-half, not in pairs); no biases unless
    # attention_bias (q/k/v only)
    GLM4_MOE: {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
               "partial_rotary_factor": 0.5},
    EXAONE4: {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "sliding_window": 4096,
              "sliding_window_pattern": 4},
    # Gemma 2 caps attention scores and logits unless its config sets the caps to null
    GEMMA2: {**GEMMA_SIZES, "vocab_size": 256000, "max_position_embeddings": 8192,
             "sliding_window": 4096, "attn_logit_softcapping": 50.0,
             "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
    # the published Gemma 3 4B-27B configs leave out vocab_size, and the 4B's its heads too
    GEMMA3: {**GEMMA_SIZES, "vocab_size": 262208, "max_position_embeddings": 131072,
             "sliding_window": 4096, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
             "tie_word_embeddings": True},
    "BambaForCausalLM": {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5},
    # sliding layers and full ones alternating from a sliding first; yarn 32x over a trained
    # context of 4,096 tokens, every frequency ramped (truncate false)
    GPT_OSS: {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": 128,
              "head_dim": 64, "attention_bias": True, "rope_theta": 150000.0,
              "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 4096},
              **GPT_OSS_SWIGLU},
}
DEFAULT_DTYPE = torch.float32  # for configs that state no dtype
ROPE_TYPES = ("linear", "llama3", "yarn", "frequency_factors")  # scaled ropes kvpool runs
# ... except for these architectures: Phi-3's scaled rope is longrope, as in transformers
ARCHITECTURE_ROPE_TYPES: dict[str, tuple[str, ...]] = {"Phi3ForCausalLM": ("longrope",)}
# ... and the older names transformers reads as it (early Phi-3 128k configs say "su")
ARCHITECTURE_ROPE_NAMES = {"Phi3ForCausalLM": {"su": "longrope", "yarn": "longrope"}}
# Rope types reading the trained context, which a top-level config key sets first (Phi-3's)
ORIGINAL_CONTEXT_ROPE_TYPES = ("llama3", "yarn", "longrope")
# Architectures whose attention_bias (Ernie 4.5's use_bias, which biases its MLP too) adds a
# bias to q, k, v and o (Qwen2's q, k, v always have one; Seed-OSS's attention_bias gives q,
# k, v theirs and attention_out_bias o its own; Mistral, Mixtral and Phi-3 have none)
ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", ARCEE,
                  "SmolLM3ForCausalLM", GEMMA2, "Gemma3ForCausalLM", "BambaForCausalLM",
                  *GRANITES, OLMO2, OLMO3, *ERNIES, APERTUS, GPT_OSS, QWEN3_NEXT)
# Architectures whose attention_bias biases q, k and v: those, and Seed-OSS and GLM's (whose o
# has a switch of its own, or no bias)
QKV_BIAS = (*ATTENTION_BIAS, SEED_OSS, GLM, GLM4, GLM4_MOE)
# Architectures whose mlp_bias adds biases to the MLP (Ernie 4.5's use_bias does)
MLP_BIAS = ("LlamaForCausalLM", SMOLLM3, "BambaForCausalLM", GRANITE, SEED_OSS, ARCEE)
MAX_WEIGHT_BLOCK = 2**22  # rows or columns one fp8 weight scale covers (intermediate_size's cap)
# Sane architectural limits of config sizes, far above any published model: a size past one
# is a broken config, refused before anything is planned or allocated by it. Every other
# integer is bounded by int64.
SIZE_LIMITS = {
    "num_hidden_layers": 2**12,
    "hidden_size": 2**20,
    "intermediate_size": 2**22,
    "moe_intermediate_size": 2**22,
    "shared_intermediate_size": 2**22,
    "num_attention_heads": 2**14,
    "num_key_value_heads": 2**14,
    "head_dim": 2**14,
    "vocab_size": 2**27,
    "max_position_embeddings": 2**31 - 1,  # positions and lengths travel as int32
    "q_lora_rank": 2**16,
    "kv_lora_rank": 2**16,
    "qk_nope_head_dim": 2**14,
    "qk_rope_head_dim": 2**14,
    "v_head_dim": 2**14,
    "n_routed_experts": 2**16,
    "num_experts_per_tok": 2**16,
    "n_shared_experts": 2**10,
    "n_group": 2**16,
    "topk_group": 2**16,
    "num_experts": 2**16,
    "num_local_experts": 2**16,
    "decoder_sparse_step": 2**12,
    "moe_num_experts": 2**16,  # Ernie 4.5's
    "moe_k": 2**16,
    "moe_num_shared_experts": 2**10,
    "moe_layer_interval": 2**12,
}

# Geometries of published models (their config.json, trimmed to what kvpool reads).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 258,
        "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 257, "dtype": "float32",
    },
    "Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-30B-A3B": {  # 8 of 128 experts per token on every layer
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-235B-A22B": {  # 8 of 128 experts per token on every layer
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Mixtral-8x7B": {  # 2 of 8 experts per token on every layer
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # gpt-oss-20b and -120b in bfloat16, as kvpool holds them (their published experts are
    # MXFP4, dequantized at load): a 128-token window on every other layer, attention sinks
    **{name: {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": experts, "num_experts_per_tok": 4, "sliding_window": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        "attention_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    } for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    "Phi-4": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100352,
        "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 10, "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5, "rope_theta": 250000.0, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 100257, "eos_token_id": 100265,
        "torch_dtype": "bfloat16",
    },
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "Gemma-3-4B": {  # the text decoder of the multimodal checkpoint
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "Bamba-9B": {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention; sizes in values per token (per head where
    named so). The KV cache holds, per token and layer, the normed compressed KV
    (`kv_lora_rank`) and the rotated key part shared by all heads (`qk_rope_head_dim`)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int  # per head: the key part without position
    qk_rope_head_dim: int  # the rotated key part, one for all heads
    v_head_dim: int
    rope_interleave: bool  # rope rotates adjacent pairs (x0, x1), (x2, x3), ... as DeepSeek does

    @property
    def qk_head_dim(self) -> int:
        """Values per head of a query or key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values of one token's latent in one layer: what the cache stores."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture of experts (DeepSeek's, GLM-4.5's, Ernie 4.5's, Qwen2-MoE's, Qwen3-MoE's,
    Mixtral's, Granite MoE's): the model layers `layers` replace the dense MLP by `top_k` of
    `num_experts` routed experts plus a shared MLP always applied (DeepSeek's, GLM-4.5's and
    Ernie 4.5's shared experts fused, GraniteMoeShared's shared MLP, Qwen2-MoE's shared expert
    scaled by a sigmoid gate; Qwen3-MoE, Mixtral and GraniteMoe have none)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    shared_intermediate_size: int  # of the shared MLP; 0: none
    layers: tuple[int, ...]  # the model layers with experts; the others have a dense MLP
    scoring: str  # "softmax" (V2, Ernie 4.5) or "sigmoid" (V3, GLM-4.5)
    topk_method: str  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3)
    num_groups: int  # experts split into groups; the best `topk_groups` groups are eligible
    topk_groups: int
    norm_topk_prob: bool  # V3: the top-k weights are normalised to sum to 1
    routed_scaling_factor: float  # multiplies the routed experts' weights
    # DeepSeek, GLM-4.5 and Ernie 4.5 score experts in float32; Qwen3-MoE scores them in the
    # model's dtype and takes the softmax in float32
    router_in_float32: bool
    # DeepSeek, GLM-4.5 and Mixtral weigh the experts' outputs in float32; the others in the
    # model's dtype
    weights_in_float32: bool = False
    # the shape of `e_score_correction_bias`, added to the scores to choose the experts but
    # not to weigh them: V3's and GLM-4.5's `[experts]`, Ernie 4.5's `[1, experts]` (its
    # `moe_statics`); (): none
    choice_bias_shape: tuple[int, ...] = ()
    # the chosen weights renormalised (norm_topk_prob) by their sum or this, whichever is
    # larger (Ernie 4.5's moe_norm_min)
    norm_min: float = 0.0
    shared_gate: bool = False  # Qwen2-MoE: the shared MLP's output times sigmoid(gate(x))
    router_bias: bool = False  # GPT-OSS: the router's logits have a bias
    expert_bias: bool = False  # GPT-OSS: each routed expert's projections have biases


@dataclass(frozen=True, slots=True)
class Multipliers:
    """Granite's scalars: the embedding times `embedding`, each block's output times
    `residual` before it joins the residual stream, attention scores times `attention`
    (None: 1 / sqrt(head_dim)), the logits divided by `logits_scaling`."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits_scaling: float = 1.0


NO_MULTIPLIERS = Multipliers()


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """What Gemma 2 and 3 do differently from a Llama decoder: norms scale by (1 + weight),
    the embedding is multiplied by sqrt(hidden_size), queries are scaled by
    `query_pre_attn_scalar ** -0.5`, the MLP gates with tanh-approximated GELU; Gemma 3's
    sliding-window layers rotate with their own rope base (the full layers use the config's
    `rope_theta` and `rope_scaling`; Gemma 2's all do), and Gemma 2 softcaps: attention
    scores s become `cap * tanh(s / cap)` with `attn_logit_softcapping`, the logits likewise
    with `final_logit_softcapping` (None: no cap)."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    local_rope_scaling: dict | None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What kvpool needs of a decoder's config.json, normalised across architectures and
    transformers versions (rope settings live in `rope_theta` + `rope_scaling`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None: plain RoPE; else has "rope_type" (see models/rotary.py)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 when attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None  # tokens a windowed layer attends to (its own included)
    dtype: torch.dtype | None  # the checkpoint's, None when unstated
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    mla: MLAConfig | None = None  # DeepSeek: num_kv_heads is 1 and head_dim the latent's
    moe: MoEConfig | None = None  # DeepSeek's and Qwen3-MoE's; None: every MLP is dense
    partial_rotary_factor: float = 1.0  # Bamba rotates the first half of each head
    # hybrids: the layers with a state slot and their mixer (Mamba2 or Gated DeltaNet)
    mamba: MambaConfig | GatedDeltaNetConfig | None = None
    # FULL or SLIDING per model layer; () means every layer is windowed iff sliding_window is
    layer_types: tuple[str, ...] = ()
    # the checkpoint's q/k rows rotate in adjacent pairs (Ernie 4.5's, GLM's), which the
    # attention reads in its order: each head's even rotary rows, then its odd ones
    rope_interleave: bool = False
    # (rope_theta, rope_scaling) of the sliding layers where they rotate otherwise than the
    # full ones (OLMo 3's; Gemma 3's is in `gemma`)
    sliding_rope: tuple[float, dict | None] | None = None
    gemma: GemmaConfig | None = None
    # the MLP's activation (models/layers.py ACTIVATIONS, or UNGATED_ACTIVATIONS: no gate)
    hidden_act: str = "silu"
    # layers whose q/k go unrotated (SmolLM3's NoPE; every layer of a GraniteMoeHybrid
    # without RoPE)
    no_rope_layers: tuple[int, ...] = ()
    # float8 weights with a scale per block of (rows, columns), dequantized at load: None for
    # a checkpoint without quantization (see `_fp8_weight_block`)
    fp8_weight_block: tuple[int, int] | None = None
    # GPT-OSS's experts stored as MXFP4 blocks and scales (quantization_config `mxfp4`, as
    # gpt-oss-20b and -120b are published), dequantized at load to the model's dtype
    # (bfloat16 where the config states none)
    mxfp4_experts: bool = False
    multipliers: Multipliers = NO_MULTIPLIERS  # Granite's
    # GPT-OSS: a learned logit per query head joins its softmax (`self_attn.sinks`)
    attention_sinks: bool = False
    # DeepSeek-V3's and GLM-4.5's multi-token-prediction layers, which their checkpoints hold
    # after the model's last layer and kvpool does not run
    mtp_layers: int = 0

    @classmethod
    def from_hf(cls, source: dict | str | Path) -> ModelConfig:
        """Parse a config dict, a config.json path, a checkpoint folder or a preset name."""
        cfg = _text_decoder(read_hf_config(source))
        arch = _architecture(cfg)
        cfg = _unaliased(cfg, arch)
        if arch in DEEPSEEK_ARCHITECTURES:
            return _deepseek(cfg, arch)
        cfg = {**ARCHITECTURE_DEFAULTS.get(arch, {}), **cfg}
        is_gemma = arch in (GEMMA2, GEMMA3)
        if is_gemma:
            _check_gemma(cfg, arch)
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim") or None
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads} and no head_dim is given")
            head_dim = hidden // heads
        num_layers = _int(cfg, "num_hidden_layers")
        gemma = None
        if arch in (GEMMA3, OLMO3):
            (rope_theta, rope_scaling), local_rope = _layer_type_ropes(
                cfg, "rope_local_base_freq" if arch == GEMMA3 else "rope_theta")
        else:
            rope_theta, rope_scaling = _rope(cfg, ARCHITECTURE_ROPE_TYPES.get(arch, ROPE_TYPES),
                                             ARCHITECTURE_ROPE_NAMES.get(arch, {}))
            local_rope = rope_theta, rope_scaling  # one rope for every layer
        if is_gemma:
            gemma = _gemma(cfg, local_rope)
        is_bamba = arch == "BambaForCausalLM"
        # Phi-4-mini rotates 3/4, GLM-4 and GLM-4.5 1/2
        partial_rotary = is_bamba or arch in ("Phi3ForCausalLM", GLM, GLM4, GLM4_MOE,
                                              QWEN3_NEXT)
        if not partial_rotary:
            _check_no_partial_rotary(cfg)
        partial_rotary_factor = _partial_rotary_factor(cfg, is_bamba, head_dim) \
            if partial_rotary else 1.0
        _check_rope_factors(rope_scaling, int(head_dim * partial_rotary_factor))
        attention_bias = _bool(cfg, "use_bias" if arch in ERNIES else "attention_bias")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        if arch == GPT_OSS:
            _check_gpt_oss_swiglu(cfg)
        sliding_window, layer_types = _windows(cfg, arch, num_layers)
        mxfp4_experts = arch == GPT_OSS and _mxfp4_experts(cfg)
        moe = MOE_ARCHITECTURES[arch](cfg, num_layers) if arch in MOE_ARCHITECTURES else None
        config = cls(
            architecture=arch,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            # a GraniteMoeHybrid without experts runs its shared MLP alone, as its dense MLP
            intermediate_size=_int(cfg, "shared_intermediate_size", 1024)
            if arch == GRANITE_MOE_HYBRID and moe is None else _int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_positive(head_dim, "head_dim"),
            rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
            # Qwen2's q/k/v have biases; Qwen2-MoE's unless its qkv_bias says otherwise
            qkv_bias=is_qwen2 or (attention_bias and arch in QKV_BIAS) or (
                arch == QWEN2_MOE and _bool({"qkv_bias": True, **cfg}, "qkv_bias")),
            o_bias=_bool(cfg, "attention_out_bias") if arch == SEED_OSS
            else attention_bias and arch in ATTENTION_BIAS,
            mlp_bias=attention_bias if arch in ERNIES else (_bool(cfg, "mlp_bias")
                                                            and arch in MLP_BIAS),
            qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_MOE, "Gemma3ForCausalLM", APERTUS,
                             EXAONE4, QWEN3_NEXT)
            or (arch == GLM4_MOE and _bool(cfg, "use_qk_norm")),
            sliding_window=sliding_window,
            # gpt-oss releases state no dtype: their unquantized weights are bfloat16
            dtype=_dtype(cfg) or (torch.bfloat16 if mxfp4_experts else None),
            bos_token_id=_optional_int(cfg, "bos_token_id", minimum=0),
            eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
            partial_rotary_factor=partial_rotary_factor,
            mamba=MAMBA_PARSERS[arch](cfg, hidden, num_layers) if arch in MAMBA_PARSERS
            else None,
            layer_types=layer_types,
            rope_interleave=arch in (*ERNIES, GLM, GLM4),
            sliding_rope=local_rope if arch == OLMO3 else None,
            gemma=gemma,
            hidden_act="gelu_pytorch_tanh" if is_gemma else "gpt_oss_swiglu"
            if arch == GPT_OSS else _hidden_act(cfg, arch),
            moe=moe,
            fp8_weight_block=_fp8_weight_block(cfg, arch),
            mxfp4_experts=mxfp4_experts,
            no_rope_layers=_no_rope_layers(cfg, num_layers) if arch == SMOLLM3 else
            _granite_hybrid_no_rope_layers(cfg, num_layers) if arch == GRANITE_MOE_HYBRID
            # EXAONE 4 rotates only its sliding layers, or every layer of a model with no window
            else tuple(i for i, t in enumerate(layer_types) if t == FULL)
            if arch == EXAONE4 and sliding_window else (),
            multipliers=_granite_multipliers(cfg) if arch in GRANITES else NO_MULTIPLIERS,
            attention_sinks=arch == GPT_OSS,
            mtp_layers=_mtp_layers(cfg) if arch == GLM4_MOE else 0,
        )
        rotated = config.rotary_dim
        if (rotated < 2 or rotated % 2) and set(config.attention_layers) - set(
                config.no_rope_layers):  # a layer that rotates (partial factors are checked)
            raise ConfigError(f"head_dim {head_dim} is odd: RoPE rotates channels in pairs, "
                              f"and kvpool rotates an even number of each head's channels")
        return config

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config for sequences of at most `max_model_len` tokens: LongRoPE's long
        factors where they may pass the trained context, else its short ones, for every
        position alike (so that cached K/V never changes with a sequence's length, as in
        vLLM). Other configs are returned as they are."""
        check_int64("max_model_len", max_model_len, 1)
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return self
        long = max_model_len > scaling["original_max_position_embeddings"]
        return replace(self, rope_scaling={**scaling, "long": long})

    @property
    def rotary_dim(self) -> int:
        """Channels of a query or key head that RoPE rotates (the rest pass through): MLA's
        rope part, or head_dim times the partial rotary factor."""
        if self.mla:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` has experts instead of a dense MLP."""
        return self.moe is not None and layer in self.moe.layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of model layer `layer` in tokens, None for full attention."""
        if self.layer_types and self.layer_types[layer] == FULL:
            return None
        return self.sliding_window

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The model layers with attention, whose K/V the pool holds, in pool-layer order."""
        mamba = set(self.mamba.layers) if self.mamba else set()
        return tuple(i for i in range(self.num_layers) if i not in mamba)

    def mamba_layout(self, *, dtype: torch.dtype | None = None,
                     tensor_parallel_size: int = 1) -> MambaLayout | None:
        """The state-slot layout of a hybrid's Mamba layers (None for attention-only models),
        in the dtype its weights load in; with `tensor_parallel_size` N, one rank's share of
        each state (its heads' SSM states, its channels' conv states)."""
        if self.mamba is None:
            return None
        return self.mamba.per_rank(tensor_parallel_size).layout(self.weights_dtype(dtype))


    def weights_dtype(self, dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype the weights load in: `dtype` if given, else the config's, else float32."""
        return dtype or self.dtype or DEFAULT_DTYPE

    def kv_layout(self, *, dtype: torch.dtype | None = None, page_size: int = 16,
                  kv_cache_dtype: str = "auto", max_model_len: int | None = None) -> KVLayout:
        """The KV layout of this model: its attention layers, KV heads and head_dim (for MLA one
        latent per token and layer), in the dtype its weights load in (see `weights_dtype`) or,
        with `kv_cache_dtype` "fp8_e4m3", float8_e4m3fn; with pages of `page_size` tokens; and
        each attention layer's sliding window when any layer has one, less the windows that
        sequences of `max_model_len` tokens never pass (Phi-3.5's 262,144: full attention)."""
        if max_model_len is not None:
            check_int64("max_model_len", max_model_len, 1)
        windows = tuple(None if window is not None and max_model_len is not None
                        and window >= max_model_len else window
                        for window in map(self.layer_window, self.attention_layers))
        return KVLayout(len(self.attention_layers), self.num_kv_heads, self.head_dim,
                        fp8.kv_cache_dtype(kv_cache_dtype, self.weights_dtype(dtype)), page_size,
                        kind="mla" if self.mla else "mha",
                        layer_windows=windows if any(windows) else ())

    def count_parameters(self, tensor_parallel_size: int = 1) -> int:
        """Exact parameter count: embeddings; per layer its mixer (attention, Llama-family: q,
        k, v, o and their biases, Qwen3's q/k norms; DeepSeek: MLA's projections and norms; or
        a hybrid's Mamba2 mixer), the MLP (gated; MoE layers: routed and shared experts and
        the router) and two RMSNorms (Gemma, GLM-4: four); the final norm; the lm_head unless
        tied to the embeddings. With `tensor_parallel_size` N, one rank's of N: its part of
        each split tensor and the whole of each it replicates (kvpool.models.parallel)."""
        tp = TensorParallel(0, tensor_parallel_size)
        hidden = self.hidden_size
        attention = self._mla_parameters(tp) if self.mla else self._attention_parameters(tp)
        mixers = len(self.attention_layers) * attention
        if self.mamba:
            mixers += len(self.mamba.layers) * self.mamba.per_rank(tp.size).count_parameters(
                hidden)
        embeddings = len(tp.part(self.vocab_size, "vocab_size")) * hidden
        lm_head = 0 if self.tie_word_embeddings else embeddings
        # Gemma and GLM-4 also norm the attention's and the MLP's outputs
        norms = 4 if self.gemma or self.architecture == GLM4 else 2
        return (embeddings + mixers + self.num_layers * norms * hidden
                + self._mlp_parameters(tp) + hidden + lm_head)

    def count_float32_parameters(self, tensor_parallel_size: int = 1) -> int:
        """Of `count_parameters`, those the model (or one rank of `tensor_parallel_size`)
        holds in float32 whatever its dtype: GPT-OSS's sinks (split by heads), and the
        routers that score in float32 (DeepSeek's, GLM-4.5's, Ernie 4.5's) with their
        choice bias (whole on every rank)."""
        heads = len(TensorParallel(0, tensor_parallel_size).part(self.num_heads,
                                                                 "num_attention_heads"))
        sinks = len(self.attention_layers) * heads if self.attention_sinks else 0
        moe = self.moe
        if moe is None:
            return sinks
        router = moe.num_experts * (self.hidden_size + moe.router_bias) \
            if moe.router_in_float32 else 0
        choice_bias = moe.num_experts if moe.choice_bias_shape else 0
        return sinks + len(moe.layers) * (router + choice_bias)

    def estimate_activation_bytes(self, dtype: torch.dtype, *, max_num_batched_tokens: int,
                                  max_num_seqs: int) -> int:
        """Rough peak activation bytes of one forward over `max_num_batched_tokens` tokens.
        Layers run one at a time, so per token: the residual stream and its normed copy (2 x
        hidden) plus the largest of attention (q, k, v and its output), the MLP (gate, up and
        their product, 3 x intermediate) and a Mamba mixer, in `dtype`; plus float32 logits of
        the last token of up to `max_num_seqs` sequences. Not covered: attention scores of
        unfused kernels, CUDA graphs, fragmentation."""
        check_int64("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int64("max_num_seqs", max_num_seqs, 1)
        attention = 2 * (self.num_heads + self.num_kv_heads) * self.head_dim
        mlp = 3 * self.intermediate_size
        mamba = self.mamba.activation_size if self.mamba else 0
        per_token = (2 * self.hidden_size + max(attention, mlp, mamba)) * dtype.itemsize
        num_logits = min(max_num_seqs, max_num_batched_tokens)
        return max_num_batched_tokens * per_token + num_logits * self.vocab_size * 4

    def _attention_parameters(self, tp: TensorParallel) -> int:
        """One layer's q, k, v and o projections, their biases, Qwen3's and Gemma 3's
        per-head q/k norms or OLMo 2's across all heads, and GPT-OSS's sink per head: those
        of `tp`'s rank, whose query heads and KV heads (or one KV head, replicated, when
        there are fewer than ranks) are its own and whose o bias and per-head norms are
        whole."""
        hidden, head_dim = self.hidden_size, self.head_dim
        heads = len(tp.part(self.num_heads, "num_attention_heads"))
        q, kv = heads * head_dim, len(tp.kv_part(self.num_kv_heads)) * head_dim
        attention = hidden * (q + 2 * kv) + q * hidden
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.o_bias:
            attention += hidden
        if self.qk_norm:
            attention += 2 * head_dim
        if self.architecture in (OLMO2, OLMO3):
            attention += q + kv
        if self.attention_sinks:
            attention += heads
        if self.architecture == QWEN3_NEXT:  # q_proj also emits a gate per query channel
            attention += (hidden + self.qkv_bias) * q
        return attention

    def _mla_parameters(self, tp: TensorParallel) -> int:
        """One layer of DeepSeek's MLA: the query (directly, or down to q_lora_rank, normed,
        and up), the latent's projection and norm, kv_b_proj up to per-head keys and values,
        o_proj: those of `tp`'s rank, whose heads are its own and whose projections down to
        q_lora_rank and the latent, their norms and o's bias are whole."""
        mla, hidden = self.mla, self.hidden_size
        heads = len(tp.part(self.num_heads, "num_attention_heads"))
        q_size = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            query = hidden * q_size
        else:
            query = (hidden + 1 + q_size) * mla.q_lora_rank + self.qkv_bias * mla.q_lora_rank
        latent = hidden * mla.latent_dim + self.qkv_bias * mla.latent_dim + mla.kv_lora_rank
        kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        out = heads * mla.v_head_dim * hidden + self.o_bias * hidden
        return query + latent + kv_b + out

    def _mlp_parameters(self, tp: TensorParallel) -> int:
        """The MLPs of every layer: dense, except the MoE layers (DeepSeek's, Qwen3-MoE's):
        their routed experts, shared experts (if any) and router, with V3's router bias (a
        buffer in transformers, but a tensor of the checkpoint like any weight). `tp`'s rank
        holds its part of each MLP's intermediate features, and the down projections' biases,
        xIELU's scalars, the routers and Qwen2-MoE's shared gate whole."""
        hidden, moe = self.hidden_size, self.moe
        dense_layers = self.num_layers - (len(moe.layers) if moe else 0)
        dense = 0
        if dense_layers:
            width = len(tp.part(self.intermediate_size, "intermediate_size"))
            dense = _gated_mlp_parameters(hidden, width, self.mlp_bias)
            if self.hidden_act in UNGATED_ACTIVATIONS:  # no gate_proj; xIELU's alpha_p, alpha_n
                dense -= hidden * width + self.mlp_bias * width
                dense += 2 * (self.hidden_act == "xielu")
        if moe is None:
            return dense_layers * dense
        width = len(tp.part(moe.intermediate_size, "the experts' intermediate size"))
        experts = moe.num_experts * _gated_mlp_parameters(hidden, width, moe.expert_bias)
        shared = 0
        if moe.shared_intermediate_size:
            width = len(tp.part(moe.shared_intermediate_size,
                                "the shared experts' intermediate size"))
            shared = _gated_mlp_parameters(hidden, width, self.mlp_bias)
        shared += hidden if moe.shared_gate else 0
        router = moe.num_experts * (hidden + bool(moe.choice_bias_shape) + moe.router_bias)
        return dense_layers * dense + len(moe.layers) * (experts + shared + router)


def _gated_mlp_parameters(hidden: int, intermediate: int, bias: bool) -> int:
    """A gated MLP of `intermediate` features (a rank's part of them): gate, up and down
    projections (and their biases, down's whole)."""
    return 3 * hidden * intermediate + bias * (2 * intermediate + hidden)


def read_hf_config(source: dict | str | Path) -> dict:
    """The raw config dict of a dict, a config.json path, a checkpoint folder or a preset."""
    if isinstance(source, dict):
        return source
    if isinstance(source, str) and source in PRESETS:
        return dict(PRESETS[source])
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(PRESETS)
        raise ConfigError(f"no config at {str(source)!r}: expected a config.json, a checkpoint "
                          f"folder holding one, or a preset name ({names})")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a model config") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a {type(cfg).__name__}, expected a JSON object")
    return cfg


def token_ids(value: Any, key: str) -> tuple[int, ...]:
    """An id or a list of ids (a config's `eos_token_id`) as a tuple; None is ()."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(f"config {key!r} must be a token id or a list of them (ints >= 0), "
                          f"got {value!r}")
    return tuple(ids)


def _text_decoder(cfg: dict) -> dict:
    """The config of the text decoder of a MULTIMODAL checkpoint: its `text_config`, taking
    the dtype and token ids the top level gives and it does not, and the top level's
    `tie_word_embeddings`, which transformers ties the head by (true where the top level
    leaves it out, both multimodal configs' default), less what the multimodal class leaves
    unapplied (MULTIMODAL_UNAPPLIED); any other config as it is. A text_config of another
    model_type than MULTIMODAL_TEXT_TYPES names is a ConfigError."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in MULTIMODAL:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config of {arch} has no 'text_config' object")
    model_type = MULTIMODAL_TEXT_TYPES.get(arch)
    if model_type is not None and text.get("model_type", model_type) != model_type:
        raise ConfigError(f"{arch} with a text_config of model_type {text['model_type']!r} is "
                          f"not supported; kvpool runs it with a {model_type!r} text_config "
                          f"only")
    inherited = {key: cfg[key] for key in ("dtype", "torch_dtype", "bos_token_id",
                                           "eos_token_id") if key in cfg}
    tied = cfg.get("tie_word_embeddings", True)
    return {**inherited, **text, "tie_word_embeddings": tied,
            **MULTIMODAL_UNAPPLIED.get(arch, {}), "architectures": [MULTIMODAL[arch]]}


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if archs is None:
        model_type = cfg.get("model_type")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise ConfigError(f"config has no 'architectures' and an unsupported "
                              f"model_type={model_type!r}; kvpool supports "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        return arch
    if isinstance(archs, list) and archs:
        archs = archs[0]
    if archs not in SUPPORTED_ARCHITECTURES:
        found = archs if isinstance(archs, str) else repr(archs)
        raise ConfigError(f"unsupported architecture {found}; kvpool supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs


def _rope(cfg: dict, rope_types: tuple[str, ...] = ROPE_TYPES,
          names: dict[str, str] | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers reads them: transformers 5 writes
    rope_parameters (theta inside), older configs rope_theta and rope_scaling, which wins
    where both are given; `names` renames an architecture's older rope types."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config {key!r} must be an object, got {params!r}")
    params = dict(params)
    theta = params.pop("rope_theta", None)
    theta = _float(cfg, "rope_theta", 10000.0) if theta is None else _number(theta, "rope_theta")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = (names or {}).get(rope_type, rope_type)
    if rope_type == "default":
        return theta, None
    if rope_type not in rope_types:
        raise ConfigError(f"unsupported rope_type {rope_type!r}; kvpool supports "
                          f"{', '.join(('default', *rope_types))} here")
    if rope_type in ORIGINAL_CONTEXT_ROPE_TYPES and \
            cfg.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if rope_type == "longrope":
        return theta, _longrope(params, key, _int(cfg, "max_position_embeddings", 4096))
    if rope_type == "frequency_factors":  # GGUF's rope_freqs: a divisor per inverse frequency
        factors = params.get("factors")
        if not isinstance(factors, list) or not factors:
            raise ConfigError(f"rope_type 'frequency_factors' needs a list 'factors', "
                              f"got {factors!r}")
        return theta, {"rope_type": rope_type, "factors": [
            _number(f, f"{key}.factors[{i}]") for i, f in enumerate(factors)]}
    if "factor" not in params:
        raise ConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor", "original_max_position_embeddings"):
        if params.get(name) is not None:
            _number(params[name], f"{key}.{name}")
    for name in ("mscale", "mscale_all_dim"):  # 0 means unset, as in transformers
        if params.get(name):
            _number(params[name], f"{key}.{name}")
    return theta, {"rope_type": rope_type, **params}


def _longrope(params: dict, key: str, max_position_embeddings: int) -> dict:
    """LongRoPE's parameters: a divisor per inverse frequency for sequences within the
    trained context (`short_factor`) and for longer ones (`long_factor`), the trained context,
    optionally `factor` and `attention_factor`, and `long`: whether the long factors apply,
    as they do where sequences reach `max_position_embeddings` (see `for_max_model_len`)."""
    scaling: dict = {"rope_type": "longrope"}
    for name in ("short_factor", "long_factor"):
        factors = params.get(name)
        if not isinstance(factors, list) or not factors:
            raise ConfigError(f"rope_type 'longrope' needs a list {name!r}, got {factors!r}")
        scaling[name] = [_number(f, f"{key}.{name}[{i}]") for i, f in enumerate(factors)]
    context = params.get("original_max_position_embeddings")
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ConfigError(f"rope_type 'longrope' needs original_max_position_embeddings, an "
                          f"int of at least 2 (its log divides the attention factor), got "
                          f"{context!r}")
    scaling["original_max_position_embeddings"] = context
    for name in ("factor", "attention_factor"):
        if params.get(name) is not None:
            scaling[name] = _number(params[name], f"{key}.{name}")
    scaling["long"] = max_position_embeddings > context
    return scaling


# The rope types that divide each inverse frequency by a factor of a list -> its lists, each
# with the name its errors give it
FACTOR_LISTS = {"longrope": {"short_factor": "short_factor", "long_factor": "long_factor"},
                "frequency_factors": {"factors": "rope frequency"}}


def _check_rope_factors(rope_scaling: dict | None, rotary_dim: int) -> None:
    """ConfigError unless each factor list of the rope (FACTOR_LISTS: LongRoPE's two,
    whichever set `max_model_len` later picks; GGUF's rope_freqs) holds one factor per
    frequency of `rotary_dim` channels."""
    lists = FACTOR_LISTS.get(rope_scaling["rope_type"], {}) if rope_scaling else {}
    for key, name in lists.items():
        if len(rope_scaling[key]) != rotary_dim // 2:
            raise ConfigError(f"{name} factors: {len(rope_scaling[key])} given, but a rotary "
                              f"dimension of {rotary_dim} has {rotary_dim // 2} frequencies")


def _windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types) as transformers reads them: Mistral, Mixtral and Phi-3
    window every layer when `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`,
    then the layers `layer_types` names (by default those from `max_window_layers` on);
    Gemma, GPT-OSS, OLMo 3 and EXAONE 4 the layers `layer_types` names (by default
    `_default_layer_types`). Other architectures have no windows."""
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", MIXTRAL):
        window = _optional_int(cfg, "sliding_window")
        return window, (SLIDING if window else FULL,) * num_layers
    is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if not (is_qwen or arch in (GEMMA2, GEMMA3, GPT_OSS, OLMO3, EXAONE4)):
        return None, ()
    window = _optional_int(cfg, "sliding_window")
    if is_qwen:
        window = window if _bool(cfg, "use_sliding_window") else None
    layer_types = cfg.get("layer_types")
    named = "names" if layer_types is not None else "left out gives (transformers' default)"
    if layer_types is None:
        layer_types = _default_layer_types(cfg, arch, window, num_layers)
    elif not (isinstance(layer_types, list) and len(layer_types) == num_layers
              and all(t in (FULL, SLIDING) for t in layer_types)):
        raise ConfigError(f"config 'layer_types' must list {FULL!r} or {SLIDING!r} for each of "
                          f"the {num_layers} layers, got {layer_types!r}")
    if SLIDING in layer_types and window is None:
        why = "use_sliding_window is false" if is_qwen else "sliding_window is null"
        raise ConfigError(f"config 'layer_types' {named} {layer_types.count(SLIDING)} "
                          f"{SLIDING} layer(s) but {why}: they have no window")
    return window, tuple(layer_types)


def _default_layer_types(cfg: dict, arch: str, window: int | None,
                         num_layers: int) -> tuple[str, ...]:
    """The layer types transformers gives a config that lists none: Qwen's windowed from
    `max_window_layers` on (28 by default); Gemma 3's and EXAONE 4's all but every
    `sliding_window_pattern`-th (6, 4 by default), Gemma 2's and GPT-OSS's every other one
    from the first, OLMo 3's all but every fourth. EXAONE 4 without a window, or with a
    pattern other than an integer, is refused (transformers derives no layer types for it)."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = _optional_int(cfg, "max_window_layers", minimum=0)
        first = 28 if first is None else first
        return tuple(SLIDING if window and i >= first else FULL for i in range(num_layers))
    if arch == EXAONE4 and window is None:
        raise ConfigError(f"{arch} with sliding_window null needs 'layer_types'")
    # Gemma 2, GPT-OSS: every second layer full, whatever sliding_window_pattern says
    pattern = {GEMMA2: 2, GPT_OSS: 2, OLMO3: 4}.get(arch) or \
        _int(cfg, "sliding_window_pattern", 6)
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _granite_multipliers(cfg: dict) -> Multipliers:
    """Granite's scalars as transformers reads them, each 1 when left out (the attention's
    too: scores are then not scaled by 1 / sqrt(head_dim))."""
    return Multipliers(*(_float(cfg, key, 1.0) for key in (
        "embedding_multiplier", "residual_multiplier", "attention_multiplier",
        "logits_scaling")))


def _hidden_act(cfg: dict, arch: str) -> str:
    """The MLP activation `hidden_act` names (default silu): a gated MLP's, or for Arcee
    (relu2) and Apertus an ungated one's; the hybrids' Mamba mixers gate with it too, and run
    silu only."""
    act = cfg.get("hidden_act", "silu")
    supported = ("silu",) if arch in HYBRID_ARCHITECTURES else ("relu2",) if arch == ARCEE \
        else tuple(UNGATED_ACTIVATIONS) if arch == APERTUS else tuple(ACTIVATIONS)
    if act not in supported:
        raise ConfigError(f"unsupported hidden_act {act!r} for {arch}; kvpool supports "
                          f"{', '.join(supported)}")
    return act


def _check_gpt_oss_swiglu(cfg: dict) -> None:
    """ConfigError unless GPT-OSS's SwiGLU gain and clamp are GPT_OSS_SWIGLU's."""
    for key, value in GPT_OSS_SWIGLU.items():
        given = _float(cfg, key, value)
        if given != value:
            raise ConfigError(f"{GPT_OSS} with {key} {given} is not supported (kvpool's "
                              f"clamped SwiGLU takes {key} {value}, as gpt-oss models have it)")


def _check_no_partial_rotary(cfg: dict) -> None:
    """transformers rotates int(head_dim * partial_rotary_factor) channels of a Llama-family
    head; kvpool rotates them all there, so refuse any other factor than 1."""
    params = cfg.get("rope_parameters")
    for value in (cfg.get("partial_rotary_factor"),
                  params.get("partial_rotary_factor") if isinstance(params, dict) else None):
        if value is not None and value != 1:
            raise ConfigError(f"unsupported partial_rotary_factor {value!r}; kvpool rotates "
                              f"whole heads (1.0) for this architecture")


def _check_gemma(cfg: dict, arch: str) -> None:
    """Raise ConfigError for the Gemma options kvpool does not run: Gemma 3 with an attention
    softcap (Gemma 2's, which transformers' Gemma 3 leaves unapplied; no published Gemma 3
    sets one), bidirectional attention, an activation other than tanh-approximated GELU."""
    if arch == GEMMA3 and cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"{arch} with attn_logit_softcapping="
                          f"{cfg['attn_logit_softcapping']!r} is not supported (only null)")
    if _bool(cfg, "use_bidirectional_attention"):
        raise ConfigError(f"{arch} with use_bidirectional_attention=true is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"unsupported hidden_activation {cfg['hidden_activation']!r}; "
                          f"kvpool supports gelu_pytorch_tanh for {arch}")


def _layer_type_ropes(cfg: dict, sliding_theta_key: str) -> tuple[tuple[float, dict | None],
                                                                   tuple[float, dict | None]]:
    """(rope_theta, rope_scaling) of Gemma 3's or OLMo 3's full and sliding layers as
    transformers reads them: transformers 5 writes rope_parameters per layer type (default
    rope for a type left out); rope_scaling updates the full layers'; a theta left out is
    rope_theta (full) or `sliding_theta_key`'s (sliding: Gemma 3's rope_local_base_freq,
    OLMo 3's rope_theta)."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not params.keys() & {FULL, SLIDING}:
        params = {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"config 'rope_scaling' must be an object, got {scaling!r}")
    ropes = []
    for layer_type, theta_key in ((FULL, "rope_theta"), (SLIDING, sliding_theta_key)):
        rope = params.get(layer_type) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config 'rope_parameters.{layer_type}' must be an object, "
                              f"got {rope!r}")
        rope = {**rope, **scaling} if layer_type == FULL else rope
        ropes.append(_rope({"rope_parameters": {"rope_theta": cfg[theta_key], **rope}}))
    return ropes[0], ropes[1]


def _gemma(cfg: dict, local_rope: tuple[float, dict | None]) -> GemmaConfig:
    """Gemma's own settings, its sliding layers' rope given; each softcap a positive number
    or None (Gemma 3's attention softcap is None: `_check_gemma`)."""
    caps = [None if cfg.get(key) is None else _float(cfg, key, 0.0)
            for key in ("attn_logit_softcapping", "final_logit_softcapping")]
    return GemmaConfig(
        query_pre_attn_scalar=_float(cfg, "query_pre_attn_scalar", 256.0),
        local_rope_theta=local_rope[0],
        local_rope_scaling=local_rope[1],
        attn_logit_softcapping=caps[0],
        final_logit_softcapping=caps[1],
    )


def _deepseek(cfg: dict, arch: str) -> ModelConfig:
    """A DeepSeek-V2/V3 config: MLA attention (the cache holds one latent per token and layer,
    so num_kv_heads is 1 and head_dim the latent's size), dense first layers and MoE layers.
    Keys a config leaves out take transformers' defaults for the architecture."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; kvpool supports silu")
    q_lora_rank = _optional_int(cfg, "q_lora_rank") if "q_lora_rank" in cfg else 1536
    mla = MLAConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_int(cfg, "kv_lora_rank", 512),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", 64),
        v_head_dim=_int(cfg, "v_head_dim", 128),
        rope_interleave=not v3 or cfg.get("rope_interleave") is not False,
    )
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), "
                          f"got {mla.qk_rope_head_dim}")
    rope_theta, rope_scaling = _rope(cfg, rope_types=("yarn",))
    attention_bias = _bool(cfg, "attention_bias")
    num_layers = _int(cfg, "num_hidden_layers")
    return ModelConfig(
        architecture=arch,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=_int(cfg, "hidden_size"),
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=_int(cfg, "num_attention_heads"),
        num_kv_heads=1,
        head_dim=mla.latent_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096 if v3 else 2048),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
        qkv_bias=attention_bias,  # q_a_proj and kv_a_proj_with_mqa
        o_bias=attention_bias,
        mlp_bias=not v3 and _bool(cfg, "mlp_bias"),
        qk_norm=False,
        sliding_window=None,
        dtype=_dtype(cfg),
        bos_token_id=_optional_int(cfg, "bos_token_id", minimum=0),
        eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id"),
        mla=mla,
        moe=_deepseek_moe(cfg, v3, num_layers),
        fp8_weight_block=_fp8_weight_block(cfg, arch),
        mtp_layers=_mtp_layers(cfg) if v3 else 0,
    )


def _mtp_layers(cfg: dict) -> int:
    """The multi-token-prediction layers of a DeepSeek-V3 or GLM-4.5 config (transformers'
    default: one)."""
    value = _optional_int(cfg, "num_nextn_predict_layers", minimum=0)
    return 1 if value is None else value


def _fp8_weight_block(cfg: dict, arch: str) -> tuple[int, int] | None:
    """The (rows, columns) each weight scale covers in a checkpoint of float8 e4m3 weights
    with per-block scales (quantization_config `fp8` with `weight_block_size`, as DeepSeek-V3
    and Qwen3's FP8 releases are published); None without quantization, or with GPT-OSS's
    MXFP4 experts (`_mxfp4_experts`). Other quantization methods are refused."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"config 'quantization_config' must be an object, got {quant!r}")
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method == "mxfp4":
        if arch == GPT_OSS:
            return None
        raise ConfigError(f"quantization_config quant_method 'mxfp4' is supported on {GPT_OSS} "
                          f"only (its experts), not on {arch}")
    if method != "fp8" or block is None:
        raise ConfigError(f"quantization_config quant_method {method!r}"
                          f"{'' if method != 'fp8' else ' without weight_block_size'} is not "
                          f"supported (supported: fp8 with weight_block_size, and mxfp4 on "
                          f"{GPT_OSS}, loaded dequantized)")
    if not (isinstance(block, list) and len(block) == 2
            and all(type(b) is int and 0 < b <= MAX_WEIGHT_BLOCK for b in block)):
        raise ConfigError(f"quantization_config weight_block_size must be two ints in "
                          f"[1, {MAX_WEIGHT_BLOCK}], got {block!r}")
    for key, supported in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quant.get(key, supported) != supported:
            raise ConfigError(f"quantization_config {key} {quant[key]!r} is not supported "
                              f"(supported: {supported})")
    return block[0], block[1]


def _mxfp4_experts(cfg: dict) -> bool:
    """Whether a GPT-OSS checkpoint stores its experts as MXFP4 (quantization_config
    `mxfp4`). Its `modules_to_not_convert` (patterns of the modules stored unquantized) must
    be a list of strings: the loader takes each expert stack as the checkpoint stores it,
    MXFP4 or not, so every module it names is honoured."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        return False
    kept = quant.get("modules_to_not_convert")
    if kept is not None and not (isinstance(kept, list)
                                 and all(isinstance(name, str) for name in kept)):
        raise ConfigError(f"quantization_config modules_to_not_convert must be a list of "
                          f"module names, got {kept!r}")
    return True


def _deepseek_moe(cfg: dict, v3: bool, num_layers: int) -> MoEConfig | None:
    """The MoE settings of a DeepSeek config; None when it routes to no experts."""
    if "n_routed_experts" in cfg and cfg["n_routed_experts"] is None:
        return None
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"unsupported moe_layer_freq {cfg['moe_layer_freq']!r}; kvpool "
                          f"supports 1 (every layer after the dense ones is MoE)")
    scoring = "sigmoid" if v3 else "softmax"
    if cfg.get("scoring_func", scoring) != scoring:
        raise ConfigError(f"unsupported scoring_func {cfg['scoring_func']!r}; "
                          f"{'V3' if v3 else 'V2'} scores experts by {scoring}")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    method = cfg.get("topk_method") or methods[0]
    if method not in methods:
        raise ConfigError(f"unsupported topk_method {method!r}; expected one of {methods}")
    grouped = method != "greedy"
    first_k_dense = _optional_int(cfg, "first_k_dense_replace", minimum=0)
    first_k_dense = (3 if v3 else 0) if first_k_dense is None else first_k_dense
    num_experts = _int(cfg, "n_routed_experts", 256 if v3 else 64)
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=_int(cfg, "num_experts_per_tok", 8 if v3 else None),
        intermediate_size=_int(cfg, "moe_intermediate_size", 2048 if v3 else 1407),
        shared_intermediate_size=_int(cfg, "n_shared_experts", 1 if v3 else 2) * _int(
            cfg, "moe_intermediate_size", 2048 if v3 else 1407),
        layers=tuple(range(first_k_dense, num_layers)),
        scoring=scoring,
        topk_method=method,
        num_groups=_int(cfg, "n_group", 8 if v3 else None) if grouped else 1,
        topk_groups=_int(cfg, "topk_group", 4 if v3 else None) if grouped else 1,
        norm_topk_prob=_bool(cfg, "norm_topk_prob") if "norm_topk_prob" in cfg else v3,
        routed_scaling_factor=_float(cfg, "routed_scaling_factor", 2.5 if v3 else 1.0),
        router_in_float32=True,
        weights_in_float32=True,
        choice_bias_shape=(num_experts,) if v3 else (),
    )
    _check_routing(moe, v3)
    return moe


def _unaliased(cfg: dict, arch: str) -> dict:
    """`cfg` with each key of `arch`'s KEY_ALIASES under the name read here; ConfigError for a
    config that gives one setting two different values under its two names."""
    cfg = dict(cfg)
    for alias, name in KEY_ALIASES.get(arch, {}).items():
        if alias in cfg:
            value = cfg.pop(alias)
            if name in cfg and cfg[name] != value:
                raise ConfigError(f"config {alias}={value!r} and {name}={cfg[name]!r} disagree "
                                  f"(transformers reads both as {name})")
            cfg[name] = value
    return cfg


def _glm4_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """GLM-4.5's experts: DeepSeek-V3's routing (sigmoid scores, the choice biased by
    `e_score_correction_bias` and limited to the best `topk_group` of `n_group` groups, the
    weights normalised and scaled) and its shared experts, with transformers' defaults for
    GLM-4.5: 8 of 128 experts 1,408 wide, one shared, one group, unscaled, after one dense
    layer."""
    defaults = {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    return _deepseek_moe({**defaults, **cfg}, True, num_layers)


def _ernie_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """Ernie 4.5's experts, as transformers reads them: softmax scores in float32, the choice
    biased by its `moe_statics` correction bias (the weights are not), the `moe_k` chosen of
    `moe_num_experts` (6 of 64 by default) renormalised by their sum or `moe_norm_min`
    (1e-12), whichever is larger, and `moe_num_shared_experts` (2) fused shared experts,
    on every `moe_layer_interval`-th layer from `moe_layer_start_index` (1) to
    `moe_layer_end_index` (-1: the last). None when no layer has experts. Ernie 4.5 VL's
    lists of a value per modality are refused, and `use_bias` (transformers then biases the
    output head too; no published Ernie 4.5 MoE sets it)."""
    if _bool(cfg, "use_bias"):
        raise ConfigError(f"use_bias=true is not supported for {ERNIE_MOE}: its output head "
                          f"would have a bias, which kvpool's head has not")
    for key in ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
                "moe_layer_start_index", "moe_layer_end_index"):
        if isinstance(cfg.get(key), list):
            raise ConfigError(f"config {key!r} is {cfg[key]!r}, a value per modality (Ernie "
                              f"4.5 VL's); kvpool runs the text-only {ERNIE_MOE}, of one value")
    num_experts = _int(cfg, "moe_num_experts", 64)
    top_k = _int(cfg, "moe_k", 6)
    if top_k > num_experts:
        raise ConfigError(f"moe_k={top_k} exceeds moe_num_experts={num_experts}")
    start = _optional_int(cfg, "moe_layer_start_index", minimum=0)
    end = _optional_int(cfg, "moe_layer_end_index", minimum=-1)
    end = num_layers - 1 if end in (None, -1) else end
    interval = _int(cfg, "moe_layer_interval", 1)
    layers = tuple(i for i in range(1 if start is None else start, min(end + 1, num_layers))
                   if (i + 1) % interval == 0)
    if not layers:
        return None
    shared = _optional_int(cfg, "moe_num_shared_experts", minimum=0)
    intermediate = _int(cfg, "moe_intermediate_size", 1536)
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=intermediate,
        shared_intermediate_size=(2 if shared is None else shared) * intermediate,
        layers=layers,
        scoring="softmax",
        topk_method="greedy",
        num_groups=1,
        topk_groups=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        router_in_float32=True,
        choice_bias_shape=(1, num_experts),
        norm_min=_float(cfg, "moe_norm_min", 1e-12),
    )


def _check_routing(moe: MoEConfig, v3: bool) -> None:
    """Raise ConfigError unless the experts, groups and top-k agree."""
    per_group = moe.num_experts // moe.num_groups
    problem = None
    if moe.num_experts % moe.num_groups:
        problem = (f"n_routed_experts={moe.num_experts} is not a multiple of "
                   f"n_group={moe.num_groups}")
    elif moe.topk_groups > moe.num_groups:
        problem = f"topk_group={moe.topk_groups} exceeds n_group={moe.num_groups}"
    elif moe.top_k > moe.topk_groups * per_group:
        problem = (f"num_experts_per_tok={moe.top_k} exceeds the {moe.topk_groups * per_group} "
                   f"experts of the topk_group={moe.topk_groups} eligible groups")
    elif v3 and per_group < 2:
        problem = f"V3 scores a group by its best two experts; a group holds {per_group}"
    elif not v3 and moe.norm_topk_prob:
        # transformers ignores the flag for V2 and DeepSeek's own code normalises: refuse
        # rather than pick one (no published V2 config sets it).
        problem = "norm_topk_prob=true is not supported for DeepseekV2ForCausalLM"
    if problem:
        raise ConfigError(problem)


def _qwen3_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """The experts of a Qwen3-MoE config, as transformers reads it: softmax routing to the
    `num_experts_per_tok` best of `num_experts` (renormalised when `norm_topk_prob`), no
    shared experts, on every `decoder_sparse_step`-th layer not in `mlp_only_layers`. None
    when no layer has experts. Keys a config leaves out take transformers' defaults."""
    return _qwen_moe(cfg, num_layers, QWEN3_MOE, (128, 8, 768), shared=0)


def _qwen2_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """Qwen2-MoE's experts: Qwen3-MoE's routing (to 4 of 60 experts by default) plus a shared
    expert `shared_expert_intermediate_size` wide, its output times sigmoid of a gate."""
    return _qwen_moe(cfg, num_layers, QWEN2_MOE, (60, 4, 1408),
                     shared=_int(cfg, "shared_expert_intermediate_size", 5632))


def _qwen3_next_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """Qwen3-Next's experts: Qwen2-MoE's, 10 of 512 experts 512 wide and a shared expert 512
    wide by default, the chosen ones' weights renormalised unless `norm_topk_prob` is false
    (transformers' default for Qwen3-Next, not Qwen2-MoE's)."""
    return _qwen_moe({"norm_topk_prob": True, **cfg}, num_layers, QWEN3_NEXT, (512, 10, 512),
                     shared=_int(cfg, "shared_expert_intermediate_size", 512))


def _qwen_moe(cfg: dict, num_layers: int, arch: str, defaults: tuple[int, int, int], *,
              shared: int) -> MoEConfig | None:
    """A Qwen-style MoE config: `defaults` are (num_experts, num_experts_per_tok,
    moe_intermediate_size) where the config leaves them out; `shared`, the shared expert's
    width (0: none), gated when there is one."""
    if arch != QWEN3_NEXT and _bool(cfg, "use_sliding_window"):  # Qwen3-Next never reads it
        raise ConfigError(f"{arch} with use_sliding_window=true is not supported (only false, "
                          f"as every published config of it has it)")
    # transformers 5 writes num_experts under the name num_local_experts
    given = {key: _optional_int(cfg, key, minimum=0) for key in ("num_experts",
                                                                  "num_local_experts")
             if cfg.get(key) is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"config num_experts={given['num_experts']} and num_local_experts="
                          f"{given['num_local_experts']} disagree")
    num_experts = next(iter(given.values()), defaults[0])
    if num_experts == 0 and arch not in (QWEN2_MOE, QWEN3_MOE, QWEN3_NEXT):  # theirs: dense
        raise ConfigError(f"config {next(iter(given))!r} must be a positive integer, got 0")
    step = _int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(_is_int(i) and 0 <= i < num_layers for i in dense)):
        raise ConfigError(f"config 'mlp_only_layers' must list layer indices in "
                          f"[0, {num_layers}), got {dense!r}")
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not layers or num_experts == 0:  # every layer dense, as transformers builds it
        return None
    top_k = _int(cfg, "num_experts_per_tok", defaults[1])
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_int(cfg, "moe_intermediate_size", defaults[2]),
        shared_intermediate_size=shared,
        layers=layers,
        scoring="softmax",
        topk_method="greedy",
        num_groups=1,
        topk_groups=1,
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
        routed_scaling_factor=1.0,
        router_in_float32=False,
        shared_gate=shared > 0,
    )


def _no_rope_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: those `no_rope_layers` marks 0, by default every
    `no_rope_layer_interval`-th. Its sliding window is refused (no published SmolLM3 uses
    it)."""
    if _bool(cfg, "use_sliding_window"):
        raise ConfigError("SmolLM3ForCausalLM with use_sliding_window=true is not supported")
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = _int(cfg, "no_rope_layer_interval", 4)
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if not (isinstance(flags, list) and len(flags) == num_layers
            and all(flag in (0, 1) and not isinstance(flag, bool) for flag in flags)):
        raise ConfigError(f"config 'no_rope_layers' must be 0 or 1 for each of the "
                          f"{num_layers} layers, got {flags!r}")
    return tuple(i for i, flag in enumerate(flags) if flag == 0)


def _mixtral_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """Mixtral's experts: Qwen3-MoE's routing with the chosen weights renormalised, 2 of 8 by
    default, on every layer, each expert `intermediate_size` wide; the weights stay float32,
    as transformers' router returns them."""
    intermediate = _int(cfg, "intermediate_size")
    moe = _qwen_moe({**cfg, "moe_intermediate_size": intermediate, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []},
                    num_layers, MIXTRAL, (8, 2, intermediate), shared=0)
    return moe and replace(moe, weights_in_float32=True)


def _granite_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """Granite MoE's experts, as transformers reads them: Mixtral's (transformers takes the
    softmax of the chosen experts' logits, which is their softmax scores renormalised), 2 of
    8 by default, each `intermediate_size` wide, on every layer; and GraniteMoeShared's
    shared MLP `shared_intermediate_size` wide (0, the default: none) or GraniteMoeHybrid's
    (1,024 by default), added ungated. None for a GraniteMoeHybrid of `num_local_experts` 0
    (Granite 4.0 H Micro), whose shared MLP is then its only MLP (`intermediate_size`)."""
    arch = _architecture(cfg)
    if arch == GRANITE_MOE_HYBRID and _optional_int(cfg, "num_local_experts", minimum=0) == 0:
        return None
    intermediate = _int(cfg, "intermediate_size")
    moe = _qwen_moe({**cfg, "moe_intermediate_size": intermediate, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []},
                    num_layers, arch, (8, 2, intermediate), shared=0)
    if arch == GRANITE_MOE:
        return moe
    shared = _int(cfg, "shared_intermediate_size", 1024) if arch == GRANITE_MOE_HYBRID \
        else _optional_int(cfg, "shared_intermediate_size", minimum=0) or 0
    return replace(moe, shared_intermediate_size=shared)


def _gpt_oss_moe(cfg: dict, num_layers: int) -> MoEConfig | None:
    """GPT-OSS's experts: `num_experts_per_tok` of `num_local_experts` (4 of 128 by default)
    on every layer, each `intermediate_size` wide, weighted by the softmax of the chosen
    experts' logits (their softmax scores renormalised), the router's logits and each
    expert's projections with biases."""
    intermediate = _int(cfg, "intermediate_size")
    moe = _qwen_moe({**cfg, "moe_intermediate_size": intermediate, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []},
                    num_layers, GPT_OSS, (128, 4, intermediate), shared=0)
    return replace(moe, router_bias=True, expert_bias=True)


def _granite_hybrid_no_rope_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """GraniteMoeHybrid's layers without RoPE: all of them unless `position_embedding_type`
    is "rope" (null and "nope" leave it out, as in Granite 4.0's hybrids)."""
    kind = cfg.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ConfigError(f"unsupported position_embedding_type {kind!r} for "
                          f"{GRANITE_MOE_HYBRID}; kvpool takes null, 'nope' or 'rope'")
    return () if kind == "rope" else tuple(range(num_layers))


# The Llama-family architectures whose layers hold experts -> their MoE config's parser.
MOE_ARCHITECTURES = {QWEN3_MOE: _qwen3_moe, QWEN2_MOE: _qwen2_moe, QWEN3_NEXT: _qwen3_next_moe,
                     MIXTRAL: _mixtral_moe,
                     GRANITE_MOE: _granite_moe, GRANITE_MOE_SHARED: _granite_moe,
                     GRANITE_MOE_HYBRID: _granite_moe, GPT_OSS: _gpt_oss_moe,
                     GLM4_MOE: _glm4_moe, ERNIE_MOE: _ernie_moe}


def _partial_rotary_factor(cfg: dict, is_bamba: bool, head_dim: int) -> float:
    """The fraction of each head RoPE rotates, as transformers reads it: the rope parameters'
    partial_rotary_factor, else Bamba's 0.5, else the config's own (Phi-3's), else 1. It
    must rotate whole pairs of channels: int(head_dim * factor) even and at least 2."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = 0.5 if is_bamba else cfg.get("partial_rotary_factor", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {value!r}")
    channels = int(head_dim * value)
    if channels < 2 or channels % 2:
        raise ConfigError(f"partial_rotary_factor {value!r} rotates int({head_dim} * "
                          f"{value!r}) = {channels} channels of each head: kvpool rotates an "
                          f"even number, at least 2")
    return float(value)


def _dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name is None:
        return None
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigError(f"config has no {key!r}")
    return _positive(value, key)


def _optional_int(cfg: dict, key: str, *, minimum: int = 1) -> int | None:
    value = cfg.get(key)
    if value is not None and not (_is_int(value) and value >= minimum):
        raise ConfigError(f"config {key!r} must be an integer >= {minimum} or null, "
                          f"got {value!r}")
    limit = SIZE_LIMITS.get(key)
    if value is not None and value > (limit or INT64_MAX):
        bound = f"at most {limit} (a sane architectural limit)" if limit else "in int64"
        raise ConfigError(f"config {key!r} must be {bound}, got {value!r}")
    return value


def _positive(value: Any, key: str) -> int:
    limit = SIZE_LIMITS.get(key)
    if not _is_int(value) or not 0 < value <= (limit or INT64_MAX):
        bound = f" at most {limit} (a sane architectural limit)" if limit else " in int64"
        raise ConfigError(f"config {key!r} must be a positive integer{bound}, got {value!r}")
    return value


def _float(cfg: dict, key: str, default: float) -> float:
    """A positive finite number; absent or null gives `default`."""
    value = cfg.get(key)
    return default if value is None else _number(value, key)


def _number(value: Any, key: str) -> float:
    """A positive number that float32, where the model computes with it, holds as a normal
    finite value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config {key!r} must be a positive finite number, got {value!r}")
    try:
        return check_float32(f"config {key!r}", value, normal=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _bool(cfg: dict, key: str) -> bool:
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"config {key!r} must be true or false, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
