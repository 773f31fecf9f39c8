"""OLMo 2: a Llama-style decoder that norms the outputs of attention and of the MLP before
each joins the residual stream (and norms no input), with q and k each normed across all its
heads at once, every norm's weight applied in float32. Parameter names mirror the Hugging Face
`Olmo2ForCausalLM` checkpoints. Since the q/k norms span every head, one rank cannot norm its
share of the heads alone: a model of several ranks is refused."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.errors import ConfigError
from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, Float32RMSNorm
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.parallel import TensorParallel


class Olmo2Attention(LlamaAttention):
    """Llama attention whose q and k are normed over all their heads, before the split."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        if tp.size > 1:
            raise ConfigError(f"OLMo 2 norms q and k across all heads, which {tp.size} "
                              f"tensor-parallel ranks would each hold a share of: run it on "
                              f"one rank")
        super().__init__(config, dtype, layer_idx, config.layer_window(layer_idx), tp)
        eps = config.rms_norm_eps
        self.q_norm = Float32RMSNorm(self.num_heads * self.head_dim, eps, dtype)
        self.k_norm = Float32RMSNorm(self.num_kv_heads * self.head_dim, eps, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(tokens, self.num_kv_heads, self.head_dim)
        return q, k, self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)


class Olmo2DecoderLayer(nn.Module):
    """`x + norm(attn(x))`, then `x + norm(mlp(x))`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, dtype, layer_idx, tp)
        self.post_attention_layernorm = Float32RMSNorm(size, eps, dtype)
        self.mlp = MLP(size, config.intermediate_size, config.mlp_bias, dtype,
                       config.hidden_act, tp)
        self.post_feedforward_layernorm = Float32RMSNorm(size, eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, context))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LayerStack):
    """Embedding, OLMo 2's decoder layers and its float32 final norm."""

    layer = Olmo2DecoderLayer
    norm_class = Float32RMSNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2's decoder and head; one rank only."""

    decoder = Olmo2Model
