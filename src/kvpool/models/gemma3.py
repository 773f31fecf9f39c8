"""Gemma 3 (text): a Llama-style decoder with (1 + weight) RMSNorms before and after both
attention and MLP, a scaled embedding, q/k norms, tanh-GELU MLP, and sliding-window layers
(rotating with their own rope base) between full-attention ones. Parameter names mirror the
Hugging Face `Gemma3ForCausalLM` checkpoints."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import Float32RMSNorm
from kvpool.models.llama import LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.parallel import ONE_RANK, ColumnLinear, RowLinear, TensorParallel, VocabEmbedding
from kvpool.models.rotary import RotaryEmbedding

# Gemma's RMSNorm scales by 1 + weight, in float32
GemmaRMSNorm = functools.partial(Float32RMSNorm, offset=1.0)


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: `down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`; this rank's
    share of the intermediate features and its partial sum under tensor parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 tp: TensorParallel):
        super().__init__()
        part = tp.part(intermediate_size, "intermediate_size")
        self.gate_proj = ColumnLinear(hidden_size, part, 1, False, dtype)
        self.up_proj = ColumnLinear(hidden_size, part, 1, False, dtype)
        self.down_proj = RowLinear(part, 1, hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]` -> `[T, hidden_size]`."""
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Attention(LlamaAttention):
    """Llama attention with Gemma's q/k norms and its query scale
    `query_pre_attn_scalar ** -0.5` (not head_dim's)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 sliding_window: int | None, tp: TensorParallel):
        super().__init__(config, dtype, layer_idx, sliding_window, tp)
        self.scale = config.gemma.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class Gemma3DecoderLayer(nn.Module):
    """`x + norm(attn(norm(x)))`, then `x + norm(mlp(norm(x)))`; attention's and the mlp's
    outputs all-reduced across the tensor-parallel ranks before their norms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.sliding = config.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = Gemma3Attention(config, dtype, layer_idx,
                                         config.layer_window(layer_idx), tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.mlp = GemmaMLP(size, config.intermediate_size, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        attn = self.tp.all_reduce(self.self_attn(self.input_layernorm(x), rope, context))
        x = x + self.post_attention_layernorm(attn)
        mlp = self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        # transformers rounds sqrt(hidden_size) to the weights' dtype before multiplying
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype,
                                              device="cpu"))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, dtype, i, tp) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, ropes: tuple[Rope, Rope],
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` and the (full, sliding) layers' ropes -> hidden states
        `[T, hidden]` after the last layer (not normed)."""
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale
        full, sliding = ropes
        for layer in self.layers:
            x = layer(x, sliding if layer.sliding else full, context)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder and head (tied to the embedding unless the config unties it); the
    sliding layers rotate by the config's local rope base."""

    decoder = Gemma3Model

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device, tp: TensorParallel = ONE_RANK):
        super().__init__(config, dtype=dtype, device=device, tp=tp)
        local = replace(config, rope_theta=config.gemma.local_rope_theta,
                        rope_scaling=config.gemma.local_rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(local, device=self.rotary_emb.inv_freq.device)

    def rope(self, positions: torch.Tensor) -> tuple[Rope, Rope]:
        """(cos, sin) at `positions` `[T]` for the full layers, then for the sliding ones."""
        return self.rotary_emb(positions, self.dtype), self.local_rotary_emb(positions, self.dtype)
