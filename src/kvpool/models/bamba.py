"""Bamba: a hybrid decoder whose layers are Mamba2 mixers except a few attention layers,
each followed by the SwiGLU MLP. Attention layers write K/V into the paged pool (pool layer
i is the model's i-th attention layer); Mamba layers keep one state slot per sequence in a
MambaPool. Parameter names mirror the Hugging Face checkpoints. Under tensor parallelism the
attention and MLP split as Llama's do and the mixers by heads (kvpool.models.mamba2); each
mixer's or attention's partial sum is all-reduced, then the MLP's."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, RMSNorm
from kvpool.models.llama import LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.mamba2 import Mamba2Mixer
from kvpool.models.parallel import TensorParallel, VocabEmbedding


class BambaDecoderLayer(nn.Module):
    """Pre-norm block: `x + mixer(norm(x))` (attention or Mamba2), then `x + mlp(norm(x))`.
    `pool_layer`: where an attention layer's K/V lie in the pool; None for a Mamba layer."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, pool_layer: int | None,
                 tp: TensorParallel):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        if pool_layer is None:
            self.mamba = Mamba2Mixer(config.mamba, config.hidden_size, eps, dtype, tp)
        else:
            self.self_attn = LlamaAttention(config, dtype, pool_layer, tp=tp)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.feed_forward = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                                dtype, tp=tp)


class BambaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        # The pool holds the attention layers only: model layer -> pool layer; the state pool
        # the Mamba layers: model layer -> state layer (None for an attention layer).
        pool_layer = {layer: i for i, layer in enumerate(config.attention_layers)}
        mamba = [i for i in range(config.num_layers) if i not in pool_layer]
        self.state_layers = tuple(mamba.index(i) if i in mamba else None
                                  for i in range(config.num_layers))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(BambaDecoderLayer(config, dtype, pool_layer.get(i), tp)
                                    for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    @property
    def norm(self) -> RMSNorm:
        """The final norm, which the head applies (Bamba's checkpoints name it
        `final_layernorm`)."""
        return self.final_layernorm

    def forward(self, input_ids: torch.Tensor, rope: Rope,
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` -> hidden states `[T, hidden]` after the last layer (not normed)."""
        x = self.embed_tokens(input_ids)
        for layer, state_layer in zip(self.layers, self.state_layers, strict=True):
            h = layer.input_layernorm(x)
            if state_layer is None:
                h = layer.self_attn(h, rope, context)
            else:
                h = layer.mamba(h, context, state_layer)
            h, x = layer.pre_ff_layernorm(self.tp.all_reduce(h), x)
            x = x + self.tp.all_reduce(layer.feed_forward(h))
        return x


class BambaForCausalLM(LlamaForCausalLM):
    """Llama's output head over the hybrid decoder. The model never allocates pages or state
    slots: it writes K/V at the slots it is given, reads through the page tables, and updates
    the state slots of the context's states (`context.states.slots[b]` is sequence b's). With
    `tp` of several ranks it holds this rank's part of every weight and its share of every
    state slot, and every rank returns the whole logits."""

    decoder = BambaModel
