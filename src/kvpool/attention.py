"""Paged attention: write new tokens' K/V into the pool by slot, and attend through page tables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvpool.kernels import cpu as cpu_kernel

# Decode gathers the pages of a group of sequences into one scratch tensor of about this many
# bytes (K and V), reused for every group: small enough to stay in cache, large enough that a
# decode batch costs a handful of torch calls (benchmarks/attention.py).
_DECODE_GROUP_BYTES = 8 << 20


@dataclass(slots=True)
class AttentionMetadata:
    """The per-step inputs of attention for a packed batch of sequences (one forward pass)."""

    slot_mapping: torch.Tensor  # [total_query_tokens] int64: where each new token's K/V goes
    page_tables: torch.Tensor  # [batch, max_pages] int32, padded with any valid page id
    seq_lens: torch.Tensor  # [batch] int32: KV length of each sequence, new tokens included
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32: query token offsets, starting at 0


class _Layer(NamedTuple):
    """One layer's paged K/V and the attention parameters shared by every sequence of a call."""

    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    scale: float
    window: int | None


def write_kv(k_cache, v_cache, slots, k, v) -> None:
    """Store K and V `[n, num_kv_heads, head_dim]` of n tokens at `slots` `[n]` (int64).

    `k_cache`/`v_cache` are one layer's `[num_pages, page_size, num_kv_heads, head_dim]` pool views.
    """
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slots.shape != k.shape[:1]:
        raise ValueError(
            f"write_kv expects k, v [n, {k_cache.shape[2]}, {k_cache.shape[3]}] and slots [n]; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    # view, never reshape: a silent copy would drop the write.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(
    q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, *, scale=None, sliding_window=None
) -> torch.Tensor:
    """Causal attention of packed queries `[total_query_tokens, num_heads, head_dim]` over pages.

    Sequence b owns query rows `cu_seqlens_q[b]:cu_seqlens_q[b + 1]`, its last tokens out of
    `seq_lens[b]`. Returns `[total_query_tokens, num_heads, head_dim]` in q's dtype.
    """
    lens, starts = seq_lens.tolist(), cu_seqlens_q.tolist()
    _check_inputs(q, k_cache, v_cache, page_tables, lens, starts, sliding_window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    layer = _Layer(k_cache, v_cache, scale, sliding_window)
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    decode = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if len(decode) == len(q_lens):
        return _decode_rows(layer, q, page_tables, lens)
    out = torch.empty_like(q)
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        tables = page_tables.index_select(0, torch.tensor(decode, device=q.device))
        decoded = _decode_rows(layer, q.index_select(0, rows), tables, [lens[b] for b in decode])
        out.index_copy_(0, rows, decoded)
    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[b], starts[b] + q_len)
            out[rows] = _attend_sequence(layer, q[rows], page_tables[b], lens[b])
    return out


def _check_inputs(q, k_cache, v_cache, page_tables, lens, starts, sliding_window) -> None:
    """Raise ValueError naming the shapes if the inputs do not describe one consistent batch."""
    problem = None
    q_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        problem = (
            "expected q [tokens, heads, head_dim], caches [pages, page_size, kv_heads, head_dim]"
        )
    elif q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        problem = "head_dim must match and num_heads must be a multiple of num_kv_heads"
    elif (
        page_tables.dim() != 2 or page_tables.shape[0] != len(lens) or len(starts) != len(lens) + 1
    ):
        problem = (
            "expected page_tables [batch, max_pages], seq_lens [batch], cu_seqlens_q [batch+1]"
        )
    elif starts[0] != 0 or starts[-1] != q.shape[0]:
        problem = f"cu_seqlens_q must run from 0 to {q.shape[0]}, not {starts[0]}..{starts[-1]}"
    elif any(not 0 < q_len <= n for q_len, n in zip(q_lens, lens, strict=True)):
        problem = f"each sequence needs 1 <= q_len <= seq_len; q_lens {q_lens}, seq_lens {lens}"
    elif max(lens) > page_tables.shape[1] * k_cache.shape[1]:
        problem = f"seq_len {max(lens)} exceeds {page_tables.shape[1]} pages of {k_cache.shape[1]}"
    elif sliding_window is not None and sliding_window < 1:
        problem = f"sliding_window must be at least 1 token, got {sliding_window}"
    if problem:
        raise ValueError(
            f"paged_attention: {problem}; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}, page_tables {tuple(page_tables.shape)}"
        )


def _first_visible(seq_len: int, q_len: int, window: int | None) -> int:
    """Position of the oldest key that any of a sequence's last q_len query tokens may see."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def _attend_sequence(layer: _Layer, q, pages, seq_len: int) -> torch.Tensor:
    """Attention of one sequence's `q [q_len, heads, head_dim]` (prefill or chunk) over its K/V."""
    q_len, page_size = q.shape[0], layer.k_cache.shape[1]
    first = _first_visible(seq_len, q_len, layer.window)
    first_page = first // page_size
    ids = pages[first_page : -(-seq_len // page_size)]
    # Gather only visible tokens, so unused slots (any bits, NaN included) never enter the math.
    lo, hi = first - first_page * page_size, seq_len - first_page * page_size
    k = layer.k_cache.index_select(0, ids).flatten(0, 1)[lo:hi].transpose(0, 1)
    v = layer.v_cache.index_select(0, ids).flatten(0, 1)[lo:hi].transpose(0, 1)
    mask = None
    if layer.window is not None or q_len != seq_len:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(first, seq_len, device=q.device)
        mask = key_pos <= query_pos
        if layer.window is not None:
            mask &= key_pos > query_pos - layer.window
    # 4-D inputs: CPU SDPA sends 3-D ones to its slow math path, which repeats K/V for GQA.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _decode_rows(layer: _Layer, q, page_tables, lens: list[int]) -> torch.Tensor:
    """Attention of one query token per sequence, `q [batch, heads, head_dim]`: the fused CPU
    kernel when it takes these inputs (kvpool/kernels), else the torch path."""
    if cpu_kernel.supports(q, layer.k_cache, layer.v_cache):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        return cpu_kernel.paged_decode(
            q, layer.k_cache, layer.v_cache, page_tables, seq_lens, layer.scale, layer.window
        )
    return _decode(layer, q, page_tables, lens)


def _decode(layer: _Layer, q, page_tables, lens: list[int]) -> torch.Tensor:
    """Attention of one query token per sequence, `q [batch, heads, head_dim]`, group by group."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = layer.k_cache.shape[1:3]
    firsts = [_first_visible(n, 1, layer.window) for n in lens]
    widest = max(-(-n // page_size) - f // page_size for n, f in zip(lens, firsts, strict=True))
    page_bytes = 2 * layer.k_cache[0].numel() * layer.k_cache.element_size()
    group = min(batch, max(1, _DECODE_GROUP_BYTES // (widest * page_bytes)))
    k_buf = layer.k_cache.new_empty(group * widest, *layer.k_cache.shape[1:])
    v_buf = torch.empty_like(k_buf)
    # GQA without copying K/V: the query heads sharing a KV head become its query rows.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped)
    for i in range(0, batch, group):
        rows = slice(i, i + group)
        ids, visible = _visible_pages(page_tables[rows], lens[rows], firsts[rows], page_size)
        k = _gather(layer.k_cache, ids, k_buf, visible)
        v = _gather(layer.v_cache, ids, v_buf, visible)
        mask = None if visible is None else visible[:, None, None, :]
        out[rows] = F.scaled_dot_product_attention(
            grouped[rows], k, v, attn_mask=mask, scale=layer.scale
        )
    return out.view(batch, num_heads, head_dim)


def _visible_pages(page_tables, lens: list[int], firsts: list[int], page_size: int):
    """Page ids `[batch, pages]` covering each sequence's visible tokens, padded to the widest,
    and a `[batch, pages * page_size]` bool mask of the visible tokens (None if all are)."""
    device = page_tables.device
    first_pages = [f // page_size for f in firsts]
    num_pages = max(-(-n // page_size) - p for n, p in zip(lens, first_pages, strict=True))
    first_page = torch.tensor(first_pages, device=device).unsqueeze(1)
    # Columns past a sequence's own pages read a padding entry (a valid page id), masked below.
    cols = first_page + torch.arange(num_pages, device=device)
    ids = page_tables.gather(1, cols.clamp_(max=page_tables.shape[1] - 1))
    span = num_pages * page_size
    if all(
        f == p * page_size and n - f == span
        for n, f, p in zip(lens, firsts, first_pages, strict=True)
    ):
        return ids, None
    key_pos = first_page * page_size + torch.arange(span, device=device)
    visible = key_pos < torch.tensor(lens, device=device).unsqueeze(1)
    visible &= key_pos >= torch.tensor(firsts, device=device).unsqueeze(1)
    return ids, visible


def _gather(cache, ids, buf, visible) -> torch.Tensor:
    """Copy pages `ids [batch, pages]` into `buf`; return `[batch, kv_heads, tokens, head_dim]`."""
    batch, num_pages = ids.shape
    pages = torch.index_select(cache, 0, ids.flatten(), out=buf[: batch * num_pages])
    tokens = pages.view(batch, num_pages * cache.shape[1], *cache.shape[2:])
    if visible is not None:
        # A masked score gets zero weight, but 0 * NaN is NaN: zero the hidden slots themselves.
        # Indexing by the hidden positions is ~15x faster than a boolean-mask assignment here.
        tokens[(~visible).nonzero(as_tuple=True)] = 0
    return tokens.transpose(1, 2)
