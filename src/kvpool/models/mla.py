"""Multi-head latent attention (DeepSeek-V2/V3) on latent pages.

Per token and layer the cache holds one latent vector: the compressed KV after its norm
(`kv_lora_rank` values) and the rotated key part shared by every head (`qk_rope_head_dim`).
Keys and values of each head are linear in that latent (`kv_b_proj`), so attention can run
two ways, numerically equal up to rounding:

- absorbed: fold the key projection W_UK into the query and the value projection W_UV after
  the attention, so attention is multi-query over the latent itself (key = the whole latent,
  value = its first kv_lora_rank values): `paged_attention` with one KV head reads the pages;
- expanded: project the context's latents to per-head keys and values, then attend as usual.

`benchmarks/mla.py` times both on the CPU: absorbed decode is 26-79x faster (it never projects
the context), expanded prefill takes 0.73-0.99x absorbed's time (its heads are 192/128 values
wide, not 576/576), so decode rows run absorbed and prefill rows (chunks, prefix hits) run
expanded.

fp8 latent pages (float8_e4m3fn) hold each layer's latents under one scale for the whole
vector: the pool calibrates it from the layer's first latents (or is given it), the write
quantizes, and both paths read dequantized (absorbed: `paged_attention` with the scale as its K
and V scale; expanded: the gathered latents, before kv_b_proj). One scale for both parts: on the
random DeepSeek configs of the tests the compressed part and the rope part are within a factor
of two in magnitude, and a scale of its own for the rope part changed neither part's rounding
error (2.6-2.8% RMS either way, `benchmarks/fp8.py`). e4m3 keeps its 3 mantissa bits for every
value above 2^-6 of the scale (about 2^-14 of the layer's largest |value|), so a shared scale
costs a part precision only if it is that much smaller than the other.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.attention import AttentionMetadata, paged_attention, write_latent
from kvpool.forward_context import ForwardContext, HostLengths
from kvpool.memory.fp8 import dequantize
from kvpool.models.config import ModelConfig
from kvpool.models.layers import RMSNorm
from kvpool.models.parallel import ONE_RANK, ColumnLinear, RowLinear, TensorParallel
from kvpool.models.rotary import yarn_mscale
from kvpool.rope import apply_rotary, apply_rotary_interleaved

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, qk_rope_head_dim // 2]
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default


class MLAttention(nn.Module):
    """DeepSeek's attention: queries from the hidden state (directly, or through the q_lora
    bottleneck), one latent per token written into the latent pages of pool layer
    `layer_idx`, attention over the pages, and the output projection. With fp8 pages, the
    layer's first latents written set its scale unless it was given. Parameter names follow
    the checkpoints. Under tensor parallelism (`tp`) it holds this rank's heads (q_proj or
    q_b_proj, kv_b_proj, o_proj) and the whole latent projection, and returns its partial
    sum."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.layer_idx = layer_idx
        mla, hidden = config.mla, config.hidden_size
        heads = tp.part(config.num_heads, "num_attention_heads")
        self.num_heads, self.mla = len(heads), mla
        if mla.q_lora_rank is None:
            self.q_proj = ColumnLinear(hidden, heads, mla.qk_head_dim, False, dtype)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.qkv_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnLinear(mla.q_lora_rank, heads, mla.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=config.qkv_bias,
                                            dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnLinear(mla.kv_lora_rank, heads,
                                      mla.qk_nope_head_dim + mla.v_head_dim, False, dtype)
        self.o_proj = RowLinear(heads, mla.v_head_dim, hidden, config.o_bias, dtype, tp)
        self.scale = softmax_scale(config)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary

    def forward(self, x: torch.Tensor, rope: Rope, context: ForwardContext) -> torch.Tensor:
        """x `[T, hidden]` -> `[T, hidden]`; writes the T tokens' latents at the context's
        slot mapping into the layer's latent pages."""
        tokens, mla = x.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(compressed)[:, None],
                            self.rotate(k_pe[:, None], *rope)), dim=-1)
        pool, layer, meta = context.locate(self.layer_idx)
        cache = pool.k_cache(layer)
        pool.calibrate(layer, latent)
        latent_scale, _ = pool.kv_scales(layer)
        write_latent(cache, meta.slot_mapping, latent, scale=latent_scale)
        out = self.attend(q_nope, self.rotate(q_pe, *rope), meta, context.host, cache,
                          latent_scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))

    def attend(self, q_nope, q_pe, meta: AttentionMetadata, host: HostLengths, cache,
               latent_scale=None) -> torch.Tensor:
        """Attention of the packed queries (`[T, heads, nope]` and rotated `[T, heads, rope]`)
        over the latent pages `cache` (fp8 ones read under `latent_scale`) ->
        `[T, heads, v_head_dim]`: decode rows absorbed, the rest expanded (see the module's
        docstring). Which rows are which comes from the host copies of the lengths."""
        q_lens = host.query_lens
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        prefill = [b for b, n in enumerate(q_lens) if n != 1]
        if host.decode_only or not prefill:
            return self.attend_absorbed(q_nope, q_pe, meta, cache, latent_scale)
        if not decode:
            return self.attend_expanded(q_nope, q_pe, meta, host, cache, latent_scale)
        out = q_nope.new_empty(*q_nope.shape[:2], self.mla.v_head_dim)
        starts = host.query_starts
        for seqs in (decode, prefill):
            rows = torch.tensor([r for b in seqs for r in range(starts[b], starts[b + 1])],
                                device=q_nope.device)
            sub_meta, sub_host = _select(meta, host, seqs)
            if seqs is decode:
                out[rows] = self.attend_absorbed(q_nope[rows], q_pe[rows], sub_meta, cache,
                                                 latent_scale)
            else:
                out[rows] = self.attend_expanded(q_nope[rows], q_pe[rows], sub_meta, sub_host,
                                                 cache, latent_scale)
        return out

    def attend_absorbed(self, q_nope, q_pe, meta: AttentionMetadata, cache,
                        latent_scale=None) -> torch.Tensor:
        """Multi-query attention over the latent: q_nope @ W_UK per head becomes the query's
        latent part, and the output's first kv_lora_rank values @ W_UV^T per head the value
        (fp8 pages: the latent scale is the K and the V scale)."""
        w_uk, w_uv = self._kv_b_weights()
        q_latent = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe),
                             dim=-1)
        out = paged_attention(q_latent, cache, cache, meta.page_tables, meta.seq_lens,
                              meta.cu_seqlens_q, scale=self.scale,
                              max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len,
                              workspace=meta.workspace, k_scale=latent_scale,
                              v_scale=latent_scale)
        rank = self.mla.kv_lora_rank
        return torch.bmm(out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def attend_expanded(self, q_nope, q_pe, meta: AttentionMetadata, host: HostLengths, cache,
                        latent_scale=None) -> torch.Tensor:
        """Per sequence: project the latents of its whole context (fp8 pages: dequantized
        under `latent_scale`) to per-head keys and values (kv_b_proj) and attend causally.
        A prefill: the lengths come from the host copies."""
        mla, heads = self.mla, self.num_heads
        q = torch.cat((q_nope, q_pe), dim=-1)
        out = q.new_empty(*q.shape[:2], mla.v_head_dim)
        lens, starts = host.seq_lens, host.query_starts
        page_size = cache.shape[1]
        for b, seq_len in enumerate(lens):
            rows = slice(starts[b], starts[b + 1])
            q_len = rows.stop - rows.start
            pages = meta.page_tables[b, : -(-seq_len // page_size)].long()
            latent = cache.index_select(0, pages).flatten(0, 1)[:seq_len, 0]
            if latent_scale is not None:
                latent = dequantize(latent, latent_scale, q.dtype)
            kv = self.kv_b_proj(latent[:, : mla.kv_lora_rank]).view(seq_len, heads, -1)
            k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            k_pe = latent[:, None, mla.kv_lora_rank:].expand(seq_len, heads, mla.qk_rope_head_dim)
            k = torch.cat((k_nope, k_pe), dim=-1)
            mask = None
            if q_len != seq_len:  # new tokens over a cached prefix or earlier chunks
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device) <= query_pos
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=self.scale).transpose(0, 1)
        return out

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: W_UK `[heads, nope, rank]`, W_UV `[heads, v, rank]`."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                       mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim) squared where the config's
    rope scaling sets mscale_all_dim (DeepSeek's long-context correction)."""
    scale = config.mla.qk_head_dim ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale  # in transformers' order, for the same bits
    return scale


def _select(meta: AttentionMetadata, host: HostLengths,
            seqs: list[int]) -> tuple[AttentionMetadata, HostLengths]:
    """The metadata and host lengths of the sequences `seqs` of a batch (their slots are
    written already)."""
    q_lens, device = host.query_lens, meta.seq_lens.device
    starts = [0, *itertools.accumulate(q_lens[b] for b in seqs)]
    seq_lens = [host.seq_lens[b] for b in seqs]
    index = torch.tensor(seqs, device=device)
    sub_host = HostLengths(starts, seq_lens, max(seq_lens), max(q_lens[b] for b in seqs))
    sub_meta = replace(
        meta, slot_mapping=meta.slot_mapping[:0],
        page_tables=meta.page_tables.index_select(0, index),
        seq_lens=meta.seq_lens.index_select(0, index),
        cu_seqlens_q=torch.tensor(starts, dtype=torch.int32, device=device),
        max_seq_len=sub_host.max_seq_len, max_query_len=sub_host.max_query_len)
    return sub_meta, sub_host
