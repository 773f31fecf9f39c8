"""EXAONE 4: OLMo 2's layers (attention's and the MLP's outputs normed before each joins the
residual stream, no norm before them) with Llama's norms, q and k normed per head as Qwen3's,
and sliding-window layers between full ones, of which only the sliding layers rotate q and k
(`ModelConfig.no_rope_layers` lists the full ones; a model without a window rotates every
layer). Parameter names mirror the Hugging Face `Exaone4ForCausalLM` checkpoints."""

from __future__ import annotations

import torch

from kvpool.models.config import ModelConfig
from kvpool.models.layers import RMSNorm
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM
from kvpool.models.olmo2 import Olmo2DecoderLayer
from kvpool.models.parallel import TensorParallel


class Exaone4Attention(LlamaAttention):
    """Llama attention over the layer's window, q and k normed per head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__(config, dtype, layer_idx, config.layer_window(layer_idx), tp)


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """`x + norm(attn(x))`, then `x + norm(mlp(x))`, each norm Llama's."""

    attention = Exaone4Attention
    norm = RMSNorm


class Exaone4Model(LayerStack):
    """Embedding, EXAONE 4's decoder layers and the final norm."""

    layer = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4's decoder and head."""

    decoder = Exaone4Model
