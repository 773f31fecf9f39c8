"""A Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Mixtral, Phi-3, SmolLM3,
Granite, Seed-OSS, Arcee, Ernie 4.5 and its MoE, Apertus, GLM, GLM-4.5) on the paged KV cache;
Qwen3-MoE's, Mixtral's, GLM-4.5's and Ernie 4.5 MoE's layers hold a mixture of experts
(kvpool.models.moe) where their configs say, and Granite scales its embedding, residual
branches, attention scores and logits by the config's multipliers.

Module and parameter names mirror the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj`,
...), so safetensors load by name. One forward pass takes a packed batch in a ForwardContext:
the new tokens of every sequence back to back, their positions, and per layer group the
`AttentionMetadata` that says where their K/V go (slots) and which pages each sequence reads
(page tables)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.attention import paged_attention, write_kv
from kvpool.devices import check_device
from kvpool.forward_context import ForwardContext
from kvpool.models.config import ModelConfig
from kvpool.models.layers import MLP, UNGATED_ACTIVATIONS, RMSNorm, UngatedMLP
from kvpool.models.moe import MoE
from kvpool.models.parallel import (
    ONE_RANK,
    ColumnLinear,
    Index,
    RowLinear,
    Sharded,
    TensorParallel,
    VocabEmbedding,
    rotary_halves,
    row_parts,
)
from kvpool.models.rotary import RotaryEmbedding
from kvpool.rope import Rotation

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim // 2]


class LlamaAttention(nn.Module, Sharded):
    """Grouped-query self-attention: project, (Qwen3) norm q/k per head, write K/V into the
    pages of pool layer `layer_idx` rotating q and K as they are written (unless the config
    lists the layer among its NoPE layers), attend through the
    page tables (to the last `sliding_window` tokens only, when given), project back. With fp8
    pages, the layer's first K/V written (before rotation: fp8.HEADROOM covers it) set its
    scales unless they were given. `layer_idx` is the attention layer: the
    context locates its group's pool, page tables and slot mapping. Under tensor parallelism
    (`tp`) it holds this rank's query and KV heads and returns its partial sum
    (kvpool.models.parallel). GPT-OSS's `sinks`, a float32 logit per query head (this rank's
    heads), join each head's softmax as a score of no value."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 sliding_window: int | None = None, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.layer_idx = layer_idx
        hidden, d = config.hidden_size, config.head_dim
        heads = tp.part(config.num_heads, "num_attention_heads")
        kv_heads = tp.kv_part(config.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = len(heads), len(kv_heads), d
        attention = config.multipliers.attention
        self.scale = d**-0.5 if attention is None else attention
        self.softcap = None  # no cap on the scores (Gemma 2 sets one)
        self.sliding_window = sliding_window
        bias = config.qkv_bias
        self.q_proj = ColumnLinear(hidden, heads, d, bias, dtype)
        self.k_proj = ColumnLinear(hidden, kv_heads, d, bias, dtype)
        self.v_proj = ColumnLinear(hidden, kv_heads, d, bias, dtype)
        self.o_proj = RowLinear(heads, d, hidden, config.o_bias, dtype, tp)
        if config.rope_interleave:
            self.q_proj.rows = rotary_halves(heads, d, config.rotary_dim)
            self.k_proj.rows = rotary_halves(kv_heads, d, config.rotary_dim)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.qk_norm = config.qk_norm
        self.rotates = layer_idx not in config.no_rope_layers
        self.heads = heads
        # float32 whatever the model's dtype: what paged_attention takes
        self.sinks = nn.Parameter(torch.empty(len(heads), dtype=torch.float32)) \
            if config.attention_sinks else None

    def checkpoint_index(self, name: str) -> Index:
        """This rank's heads of the sinks (the only tensor held here, not in a submodule)."""
        return row_parts(self.heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[T, hidden]` -> q `[T, heads, head_dim]`, k and v `[T, kv_heads, head_dim]`,
        q and k normed per head where the config says."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`; writes the T tokens' K/V at `meta.slot_mapping`."""
        return self.o_proj(self.attend(*self.project(x), rope, context))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
               context: ForwardContext) -> torch.Tensor:
        """Projected q `[T, heads, head_dim]`, k and v -> the heads' outputs
        `[T, heads * head_dim]` (before o_proj); writes the T tokens' K/V."""
        tokens = q.shape[0]
        pool, layer, meta = context.locate(self.layer_idx)
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)
        pool.calibrate(layer, k, v)
        k_scale, v_scale = pool.kv_scales(layer)
        # Stores K rotated and rotates q in place: RoPE in the write, one launch on CUDA.
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v, k_scale=k_scale, v_scale=v_scale,
                 rotation=Rotation(q, *rope) if self.rotates else None)
        out = paged_attention(q, k_cache, v_cache, meta.page_tables, meta.seq_lens,
                              meta.cu_seqlens_q, scale=self.scale,
                              sliding_window=self.sliding_window, softcap=self.softcap,
                              sinks=self.sinks,
                              max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len,
                              workspace=meta.workspace, k_scale=k_scale, v_scale=v_scale)
        return out.reshape(tokens, self.num_heads * self.head_dim)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))` with a dense (gated, or
    ungated for an ungated activation: Arcee's, Apertus's) or (on a Qwen3-MoE's expert
    layers) MoE mlp. Each residual add is fused into the norm after it: the layer takes and
    returns its output apart from the residual stream. Under tensor parallelism the
    attention's and the MLP's partial sums are all-reduced across the ranks."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel = ONE_RANK):
        super().__init__()
        eps = config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, layer_idx, config.layer_window(layer_idx),
                                        tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.residual_multiplier = config.multipliers.residual
        self.moe = config.is_moe_layer(layer_idx)
        if self.moe:
            self.mlp = MoE(config, dtype, tp)
        else:
            mlp = UngatedMLP if config.hidden_act in UNGATED_ACTIVATIONS else MLP
            self.mlp = mlp(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype,
                           config.hidden_act, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                context: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output x `[T, hidden]` and the residual stream it adds to
        (None for the first layer, whose x is the embedding) -> this layer's (output,
        residual stream), both `[T, hidden]`."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attention = self._scaled(self.tp.all_reduce(self.self_attn(h, rope, context)))
        h, residual = self.post_attention_layernorm(attention, residual)
        mlp = self.mlp(h, context.host.decode_only) if self.moe else self.mlp(h)
        return self._scaled(self.tp.all_reduce(mlp)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (Granite's: times a multiplier)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, i, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.embedding_multiplier = config.multipliers.embedding

    def forward(self, input_ids: torch.Tensor, rope: Rope,
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` -> hidden states `[T, hidden]` after the last layer (not normed)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        for layer in self.layers:
            x, residual = layer(x, residual, rope, context)
        return x + residual


class LayerStack(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix) of a
    decoder whose layers each take and return the hidden states, residual adds included:
    a subclass names its `layer` class (built as `layer(config, dtype, index, tp)`) and its
    final `norm` class."""

    layer: type[nn.Module]
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            self.layer(config, dtype, i, tp) for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, rope: Rope,
                context: ForwardContext) -> torch.Tensor:
        """input_ids `[T]` -> hidden states `[T, hidden]` after the last layer (not normed)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, rope, context)
        return x


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head (tied to the embedding when the config says so).

    Parameters are allocated on `device` but not initialised: load a checkpoint into them
    (`kvpool.models.loader`) or initialise them. The model never allocates pages; it writes
    K/V only at the slots it is given and reads only through the page tables. Subclasses
    for other decoders set `decoder` (a module taking `(config, dtype, tp)`). With `tp` of
    several ranks it holds this rank's part of every weight (kvpool.models.parallel) and
    every rank returns the whole logits."""

    decoder = LlamaModel

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device, tp: TensorParallel = ONE_RANK):
        super().__init__()
        device = check_device(device)
        self.config = config
        self.dtype = dtype
        self.tp = tp
        with torch.device("meta"):  # skip the default init: weights are loaded next
            self.model = self.decoder(config, dtype, tp)
            self.lm_head = None if config.tie_word_embeddings else ColumnLinear(
                config.hidden_size, tp.part(config.vocab_size, "vocab_size"), 1, False, dtype)
        # Module.to_empty's torch.empty_like on a meta tensor imports sympy, a quarter of a
        # second of every fresh process's start; torch.empty by shape imports nothing.
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        self.rotary_emb = RotaryEmbedding(config, device=device)

    def rope(self, positions: torch.Tensor):
        """What the decoder rotates q/k by at `positions` `[T]`: one (cos, sin) pair."""
        return self.rotary_emb(positions, self.dtype)

    @torch.inference_mode()
    def forward(self, context: ForwardContext) -> torch.Tensor:
        """One packed step -> float32 logits `[n, vocab_size]` of the tokens at
        `context.logits_indices` `[n]`."""
        check_dtypes(self, context)
        hidden = self.model(context.input_ids, self.rope(context.positions), context)
        out = logits(self, self.model.norm, hidden, context)
        scaling = self.config.multipliers.logits_scaling
        return out if scaling == 1.0 else out / scaling


def check_dtypes(model: nn.Module, context: ForwardContext) -> None:
    """ValueError unless the pools hold the model's dtype (or fp8 pages, which any model
    reads)."""
    held = [("pool", context.kv.layout.dtype)] if not context.kv.quantized else []
    if context.states is not None:
        held.append(("state pool", context.states.pool.layout.dtype))
    for name, dtype in held:
        if dtype != model.dtype:
            raise ValueError(f"the {name} holds {dtype} but the model computes in "
                             f"{model.dtype}; build its layout with dtype={model.dtype} "
                             f"(or float8_e4m3fn for fp8 pages)")


def logits(model: nn.Module, norm: nn.Module, hidden: torch.Tensor,
           context: ForwardContext) -> torch.Tensor:
    """float32 logits of the rows `context.logits_indices` of the last layer's `hidden`,
    normed and projected by the head (tied to the embedding when there is no lm_head), each
    rank's vocabulary rows gathered."""
    hidden = norm(hidden.index_select(0, context.logits_indices))
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    return model.tp.all_gather(F.linear(hidden, head.weight)).float()
