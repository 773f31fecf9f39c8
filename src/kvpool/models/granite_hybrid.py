"""GraniteMoeHybrid (Granite 4.0's hybrids): Bamba's layers, Mamba2 mixers except a few
attention layers, each followed by Granite MoE's experts and shared MLP (or, in a model
without experts, the shared MLP alone, as a dense MLP), with Granite's multipliers (the
embedding, each block's output as it joins the residual stream, attention scores, logits).
Its attention layers rotate q and k only where the config says so. Parameter names mirror
the Hugging Face checkpoints (the loader splits their stacked experts and fused MLP rows).
Under tensor parallelism the mixers split as Bamba's do and the experts as every MoE's; each
mixer's or attention's partial sum is all-reduced, then the MLP's."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, RMSNorm
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.mamba2 import Mamba2Mixer
from kvpool.models.moe import MoE
from kvpool.models.parallel import TensorParallel


class GraniteHybridDecoderLayer(nn.Module):
    """Pre-norm block: `x + r * mixer(norm(x))` (attention or Mamba2), then
    `x + r * mlp(norm(x))`, r the residual multiplier, the mlp the MoE or (without experts)
    the dense shared MLP. The attention layers' K/V lie in the pool in model order, the Mamba
    layers' states in the state pool likewise."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(size, eps, dtype)
        if layer_idx in config.mamba.layers:
            self.state_layer = config.mamba.layers.index(layer_idx)
            self.mamba = Mamba2Mixer(config.mamba, size, eps, dtype, tp)
        else:
            self.state_layer = None
            self.self_attn = LlamaAttention(config, dtype, config.attention_layers.index(
                layer_idx), tp=tp)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)
        self.moe = config.is_moe_layer(layer_idx)
        self.mlp = MoE(config, dtype, tp) if self.moe else MLP(
            size, config.intermediate_size, config.mlp_bias, dtype, config.hidden_act, tp,
            what="shared_intermediate_size")  # the config's name for this MLP's width
        self.residual_multiplier = config.multipliers.residual

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        h = self.input_layernorm(x)
        if self.state_layer is None:
            h = self.self_attn(h, rope, context)
        else:
            h = self.mamba(h, context, self.state_layer)
        x = x + self.tp.all_reduce(h) * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        h = self.mlp(h, context.host.decode_only) if self.moe else self.mlp(h)
        return x + self.tp.all_reduce(h) * self.residual_multiplier


class GraniteHybridModel(LayerStack):
    """Embedding (times the embedding multiplier), the hybrid decoder layers and the final
    norm."""

    layer = GraniteHybridDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__(config, dtype, tp)
        self.embedding_multiplier = config.multipliers.embedding

    def forward(self, input_ids: torch.Tensor, rope: Rope,
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` -> hidden states `[T, hidden]` after the last layer (not normed)."""
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            x = layer(x, rope, context)
        return x


class GraniteHybridForCausalLM(LlamaForCausalLM):
    """Llama's output head (its logits divided by `logits_scaling`) over the hybrid decoder;
    like Bamba's, the model reads and writes the state slots of the context's states."""

    decoder = GraniteHybridModel
