"""OLMo 2 and OLMo 3: a Llama-style decoder that norms the outputs of attention and of the MLP
before each joins the residual stream (and norms no input), with q and k each normed across all
its heads at once, every norm's weight applied in float32; OLMo 3 windows some layers, which
rotate by their own rope. Parameter names mirror the Hugging Face `Olmo2ForCausalLM` and
`Olmo3ForCausalLM` checkpoints. Under tensor parallelism the q/k norms span every rank's
heads: each rank sums the squares of its own features, one all-reduce per layer adds the
ranks' sums, and each rank scales its features by its part of the norm's weight."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, Float32RMSNorm
from kvpool.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, Rope
from kvpool.models.parallel import ONE_RANK, ColumnLinear, Index, Sharded, TensorParallel
from kvpool.models.rotary import RotaryEmbedding


class HeadsNorm(nn.Module, Sharded):
    """The weight of an RMSNorm over every head of q or k, of which this rank holds the
    features its projection `linear` outputs; the attention gives it the mean square, which
    spans the ranks."""

    def __init__(self, linear: ColumnLinear, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(linear.out_features, dtype=dtype))
        self.rows = linear.rows

    def forward(self, x: torch.Tensor, mean_square: torch.Tensor, eps: float) -> torch.Tensor:
        """x `[T, features]`, its rows' mean square over all ranks `[T, 1]` (float32) ->
        x normed and scaled in float32, in x's dtype."""
        return (x.float() * torch.rsqrt(mean_square + eps) * self.weight.float()).to(x.dtype)

    def checkpoint_index(self, name: str) -> Index:
        return self.rows


class Olmo2Attention(LlamaAttention):
    """Llama attention whose q and k are normed over all their heads, before the split."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__(config, dtype, layer_idx, config.layer_window(layer_idx), tp)
        self.tp = tp
        self.eps = config.rms_norm_eps
        self.q_norm = HeadsNorm(self.q_proj, dtype)
        self.k_norm = HeadsNorm(self.k_proj, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        # Every rank holds as many q (and k) features, each KV head replicated on as many
        # ranks where there are fewer than ranks: the ranks' summed squares over their
        # summed widths are the mean square over all heads.
        squares = torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1)
        q_squares, k_squares = self.tp.all_reduce(squares)[:, :, None].unbind(1)
        q = self.q_norm(q, q_squares / (q.shape[-1] * self.tp.size), self.eps)
        k = self.k_norm(k, k_squares / (k.shape[-1] * self.tp.size), self.eps)
        return (q.view(tokens, self.num_heads, self.head_dim),
                k.view(tokens, self.num_kv_heads, self.head_dim),
                self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    """`x + norm(attn(x))`, then `x + norm(mlp(x))`; under tensor parallelism the partial
    sums of attention and of the MLP are all-reduced before their norms. A subclass names
    its `attention` class (built as `attention(config, dtype, layer_idx, tp)`) and its
    `norm` class."""

    attention: type[nn.Module] = Olmo2Attention
    norm: type[nn.Module] = Float32RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.self_attn = self.attention(config, dtype, layer_idx, tp)
        self.post_attention_layernorm = self.norm(size, eps, dtype)
        self.mlp = MLP(size, config.intermediate_size, config.mlp_bias, dtype,
                       config.hidden_act, tp)
        self.post_feedforward_layernorm = self.norm(size, eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`."""
        attention = self.tp.all_reduce(self.self_attn(x, rope, context))
        x = x + self.post_attention_layernorm(attention)
        return x + self.post_feedforward_layernorm(self.tp.all_reduce(self.mlp(x)))


class Olmo2Model(LayerStack):
    """Embedding, OLMo 2's decoder layers and its float32 final norm."""

    layer = Olmo2DecoderLayer
    norm_class = Float32RMSNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2's decoder and head."""

    decoder = Olmo2Model


class Olmo3Model(Olmo2Model):
    """OLMo 2's decoder whose sliding layers rotate by their own rope."""

    def forward(self, input_ids: torch.Tensor, ropes: tuple[Rope, Rope],
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` and the (full, sliding) layers' ropes -> hidden states
        `[T, hidden]` after the last layer (not normed)."""
        x = self.embed_tokens(input_ids)
        full, sliding = ropes
        for layer in self.layers:
            x = layer(x, full if layer.self_attn.sliding_window is None else sliding, context)
        return x


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3's decoder and head: the full layers rotate by the config's rope (a scaled one
    where it says), the sliding layers by `config.sliding_rope`."""

    decoder = Olmo3Model

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device, tp: TensorParallel = ONE_RANK):
        super().__init__(config, dtype=dtype, device=device, tp=tp)
        theta, scaling = config.sliding_rope
        local = replace(config, rope_theta=theta, rope_scaling=scaling)
        self.local_rotary_emb = RotaryEmbedding(local, device=self.rotary_emb.inv_freq.device)

    def rope(self, positions: torch.Tensor) -> tuple[Rope, Rope]:
        """(cos, sin) at `positions` `[T]` for the full layers, then for the sliding ones."""
        return self.rotary_emb(positions, self.dtype), self.local_rotary_emb(positions, self.dtype)
