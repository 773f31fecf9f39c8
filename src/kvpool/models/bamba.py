"""Bamba: a hybrid decoder whose layers are Mamba2 mixers except a few attention layers,
each followed by the SwiGLU MLP. Attention layers write K/V into the paged pool (pool layer
i is the model's i-th attention layer); Mamba layers keep one state slot per sequence in a
MambaPool. Parameter names mirror the Hugging Face checkpoints. Under tensor parallelism the
attention and MLP split as Llama's do and the mixers by heads (kvpool.models.mamba2); each
mixer's or attention's partial sum is all-reduced, then the MLP's."""

from __future__ import annotations

import torch
from torch import nn

from kvpool.devices import check_device
from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, RMSNorm
from kvpool.models.llama import LlamaAttention, Rope, check_dtypes, logits
from kvpool.models.mamba2 import Mamba2Mixer
from kvpool.models.parallel import ONE_RANK, ColumnLinear, TensorParallel, VocabEmbedding
from kvpool.models.rotary import RotaryEmbedding


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


class BambaForCausalLM(nn.Module):
    """The hybrid decoder plus its output head (tied to the embedding when the config says so).

    Parameters are allocated on `device` but not initialised (load a checkpoint into them).
    The model never allocates pages or state slots: it writes K/V at the slots it is given,
    reads through the page tables, and updates the state slots of the context's states.
    With `tp` of several ranks it holds this rank's part of every weight and its share of
    every state slot, and every rank returns the whole logits."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device, tp: TensorParallel = ONE_RANK):
        super().__init__()
        device = check_device(device)
        self.config = config
        self.dtype = dtype
        self.tp = tp
        with torch.device("meta"):  # skip the default init: weights are loaded next
            self.model = BambaModel(config, dtype, tp)
            self.lm_head = None if config.tie_word_embeddings else ColumnLinear(
                config.hidden_size, tp.part(config.vocab_size, "vocab_size"), 1, False, dtype)
        self.to_empty(device=device)
        self.rotary_emb = RotaryEmbedding(config, device=device)

    @torch.inference_mode()
    def forward(self, context: ForwardContext) -> torch.Tensor:
        """One packed step -> float32 logits `[n, vocab_size]` of the tokens at
        `context.logits_indices`; `context.states.slots[b]` is sequence b's state slot."""
        check_dtypes(self, context)
        rope = self.rotary_emb(context.positions, self.dtype)
        hidden = self.model(context.input_ids, rope, context)
        return logits(self, self.model.final_layernorm, hidden, context)
