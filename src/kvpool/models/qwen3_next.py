"""Qwen3-Next: a hybrid decoder whose layers are Gated DeltaNet layers
(kvpool.models.gated_deltanet) except every few a gated full attention layer, each followed by
Qwen2-MoE's experts with a gated shared expert (or, on the layers the config leaves dense, a
SwiGLU MLP). Every norm is zero-centred: its scale is 1 + weight, applied in float32.
Attention layers write K/V into the paged pool in model order; the DeltaNet layers keep one
state slot per sequence in a MambaPool. Parameter names mirror the Hugging Face checkpoints.
Under tensor parallelism the attention and the experts split as Llama's and every MoE's do; the
DeltaNet layers run on one rank only (refused for more when the config is read)."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.gated_deltanet import GatedDeltaNet
from kvpool.models.gemma import GemmaRMSNorm
from kvpool.models.layers import MLP
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.moe import MoE
from kvpool.models.parallel import ColumnLinear, TensorParallel


class Qwen3NextAttention(LlamaAttention):
    """Llama's attention whose q_proj emits, per head, its query and then a gate of as many
    channels: q and k normed per head (zero-centred), rotated over the config's share of
    each head, and each head's output times sigmoid(gate) before o_proj."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__(config, dtype, layer_idx, tp=tp)
        d = config.head_dim
        self.q_proj = ColumnLinear(config.hidden_size, self.heads, 2 * d, config.qkv_bias, dtype)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`; writes the T tokens' K/V."""
        tokens = x.shape[0]
        q, gate = self.q_proj(x).view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attend(self.q_norm(q), self.k_norm(k), v, rope, context)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block: `x + mixer(norm(x))` (gated attention or Gated DeltaNet), then
    `x + mlp(norm(x))`, the MoE or a dense MLP."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        if layer_idx in config.mamba.layers:
            self.state_layer = config.mamba.layers.index(layer_idx)
            self.linear_attn = GatedDeltaNet(config.mamba.per_rank(tp.size), size, eps, dtype)
        else:
            self.state_layer = None
            self.self_attn = Qwen3NextAttention(
                config, dtype, config.attention_layers.index(layer_idx), tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.moe = config.is_moe_layer(layer_idx)
        self.mlp = MoE(config, dtype, tp) if self.moe else MLP(
            size, config.intermediate_size, config.mlp_bias, dtype, config.hidden_act, tp)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        h = self.input_layernorm(x)
        if self.state_layer is None:
            h = self.tp.all_reduce(self.self_attn(h, rope, context))
        else:
            h = self.linear_attn(h, context, self.state_layer)
        x = x + h
        h = self.post_attention_layernorm(x)
        h = self.mlp(h, context.host.decode_only) if self.moe else self.mlp(h)
        return x + self.tp.all_reduce(h)


class Qwen3NextModel(LayerStack):
    """Embedding, the hybrid decoder layers and the final (zero-centred) norm."""

    layer = Qwen3NextDecoderLayer
    norm_class = GemmaRMSNorm


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Llama's output head over the hybrid decoder; like Bamba's, the model reads and writes
    the state slots of the context's states."""

    decoder = Qwen3NextModel
