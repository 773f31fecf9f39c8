"""Gemma 2 and Gemma 3 (text): a Llama-style decoder with (1 + weight) RMSNorms before and
after both attention and MLP, a scaled embedding, tanh-GELU MLP, and sliding-window layers
between full-attention ones. Gemma 3 norms q and k and rotates its sliding layers with their
own rope base; Gemma 2 rotates every layer alike and softcaps the attention scores and the
logits. Parameter names mirror the Hugging Face `Gemma2ForCausalLM` and `Gemma3ForCausalLM`
checkpoints."""

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


class GemmaAttention(LlamaAttention):
    """Llama attention with Gemma's query scale `query_pre_attn_scalar ** -0.5` (not
    head_dim's), Gemma 3's (1 + weight) q/k norms and Gemma 2's attention logit softcap."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 sliding_window: int | None, tp: TensorParallel):
        super().__init__(config, dtype, layer_idx, sliding_window, tp)
        self.scale = config.gemma.query_pre_attn_scalar**-0.5
        self.softcap = config.gemma.attn_logit_softcapping
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class GemmaDecoderLayer(nn.Module):
    """`x + norm(attn(norm(x)))`, then `x + norm(mlp(norm(x)))`; attention's and the mlp's
    outputs all-reduced across the tensor-parallel ranks before their norms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.sliding = config.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(config, dtype, layer_idx,
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


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        # transformers rounds sqrt(hidden_size) to the weights' dtype before multiplying
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype,
                                              device="cpu"))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, dtype, i, tp) for i in range(config.num_layers)
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


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma's decoder and head (tied to the embedding unless the config unties it), the
    logits softcapped by the config's `final_logit_softcapping` unless it is null."""

    decoder = GemmaModel

    @torch.inference_mode()
    def forward(self, context: ForwardContext) -> torch.Tensor:
        """One packed step -> float32 logits `[n, vocab_size]`, each l capped at
        `cap * tanh(l / cap)` by the config's `final_logit_softcapping` (unless null)."""
        logits = super().forward(context)
        cap = self.config.gemma.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: one rope for every layer."""

    def rope(self, positions: torch.Tensor) -> tuple[Rope, Rope]:
        """(cos, sin) at `positions` `[T]`, for the full layers and the sliding ones alike."""
        rope = self.rotary_emb(positions, self.dtype)
        return rope, rope


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3: the sliding layers rotate by the config's local rope base."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device, tp: TensorParallel = ONE_RANK):
        super().__init__(config, dtype=dtype, device=device, tp=tp)
        local = replace(config, rope_theta=config.gemma.local_rope_theta,
                        rope_scaling=config.gemma.local_rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(local, device=self.rotary_emb.inv_freq.device)

    def rope(self, positions: torch.Tensor) -> tuple[Rope, Rope]:
        """(cos, sin) at `positions` `[T]` for the full layers, then for the sliding ones."""
        return self.rotary_emb(positions, self.dtype), self.local_rotary_emb(positions, self.dtype)
