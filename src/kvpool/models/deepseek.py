"""DeepSeek-V2 and DeepSeek-V3 decoders on latent pages: multi-head latent attention
(kvpool.models.mla), a dense MLP in the first `first_k_dense_replace` layers and a mixture of
experts after them (kvpool.models.moe). Module and parameter names mirror the checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, RMSNorm
from kvpool.models.llama import LayerStack, LlamaForCausalLM
from kvpool.models.mla import MLAttention, Rope
from kvpool.models.moe import MoE
from kvpool.models.parallel import ONE_RANK, TensorParallel


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` with a dense or MoE mlp;
    each sum all-reduced across the tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int,
                 tp: TensorParallel = ONE_RANK):
        super().__init__()
        eps = config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = MLAttention(config, dtype, index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.moe = config.is_moe_layer(index)
        if self.moe:
            self.mlp = MoE(config, dtype, tp)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype,
                           tp=tp)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        attention = self.tp.all_reduce(self.self_attn(self.input_layernorm(x), rope, context))
        h, x = self.post_attention_layernorm(attention, x)
        mlp = self.mlp(h, context.host.decode_only) if self.moe else self.mlp(h)
        return x + self.tp.all_reduce(mlp)


class DeepseekModel(LayerStack):
    """Embedding, DeepSeek's decoder layers and final norm."""

    layer = DeepseekDecoderLayer


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: the decoder plus its output head, run
    on a pool of layout kind "mla" (`ModelConfig.kv_layout`)."""

    decoder = DeepseekModel
