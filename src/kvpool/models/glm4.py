"""GLM-4 (0414): a Llama-style decoder that also norms the outputs of attention and of the MLP
before each joins the residual stream (four norms a layer, each as Llama's), with q/k/v
biases, an o projection without one, and RoPE over the first half of each head in adjacent
pairs, which the loader reorders as Ernie 4.5's (`ModelConfig.rope_interleave`). Parameter
names mirror the Hugging Face `Glm4ForCausalLM` checkpoints; their fused `gate_up_proj` is
split at load, as Phi-3's."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, RMSNorm
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.parallel import TensorParallel


class Glm4DecoderLayer(nn.Module):
    """`x + norm(attn(norm(x)))`, then `x + norm(mlp(norm(x)))`; attention's and the MLP's
    outputs all-reduced across the tensor-parallel ranks before their norms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(size, eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, layer_idx, None, tp)
        self.post_self_attn_layernorm = RMSNorm(size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)  # before the MLP
        self.mlp = MLP(size, config.intermediate_size, False, dtype, config.hidden_act, tp)
        self.post_mlp_layernorm = RMSNorm(size, eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        attention = self.tp.all_reduce(self.self_attn(self.input_layernorm(x), rope, context))
        x = x + self.post_self_attn_layernorm(attention)
        mlp = self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))
        return x + self.post_mlp_layernorm(mlp)


class Glm4Model(LayerStack):
    """Embedding, GLM-4's decoder layers and the final norm."""

    layer = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4's decoder and head."""

    decoder = Glm4Model
