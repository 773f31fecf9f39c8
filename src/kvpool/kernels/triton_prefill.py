"""Paged prefill/extend attention in Triton: packed variable-length queries over their pages.

Sequence b's query rows `cu_seqlens_q[b]:cu_seqlens_q[b + 1]` are its last tokens: query i sits
at position `seq_len - q_len + i` and attends causally to the cached prefix and to the new
tokens before it, all read from the pages (their K/V is written first), so one kernel serves
prefill, prefill over a prefix hit, chunked prefill and decode rows mixed in. Flash-attention
tiles: a program takes BLOCK_M query rows of one head and streams the keys they may see BLOCK_N
at a time with an online softmax in base 2, accumulated in float32. Keys outside a row's causal
window are masked and slots past seq_len are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels.triton_decode import (
    LOG2E,
    _compute_dtype,
    dot,
    load_tokens,
    softcapped,
    with_sinks,
)
from kvpool.kernels.triton_support import (
    MIN_TILE,
    Launch,
    dot_precision,
    fitting_tile,
    scale_args,
    shared_memory,
)
from kvpool.memory.fp8 import is_fp8

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # keys per step
SMALL_BLOCK_N = 32  # keys per step for queries of LONG_QUERY tokens or more, or wide heads
LONG_QUERY = 512


@triton.jit
def _attend_keys(
    acc, m, denom, q_tile, t0, last, pos, window, table, page_size, kv_head, d, d_ok,
    k_cache, v_cache, k_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    scale_log2, softcap, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
):
    """One step of the online softmax over keys t0 .. t0 + BLOCK_N: the updated (acc, m,
    denom). Without MASKED, every key is below `last` and visible to every row (the keys
    before a block's first query position, causal and no window): no mask is computed."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = t < last
    page = tl.load(table + t // page_size, mask=t_ok, other=0).to(tl.int64)
    slot = t % page_size
    kv_ok = t_ok[:, None] & d_ok[None, :]
    k = load_tokens(k_cache, page, slot, kv_head, d, kv_ok, stride_kp, stride_ks,
                    stride_kh, q_tile.dtype, FP8)
    scores = softcapped(dot(q_tile, tl.trans(k), PRECISION) * scale_log2, softcap, SOFTCAP)
    if MASKED:
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None])
        if window > 0:
            visible = visible & (t[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # A row may see none of this block's keys yet (m_new still -inf): subtract 0 instead.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v = load_tokens(v_cache, page, slot, kv_head, d, kv_ok, stride_vp, stride_vs,
                    stride_vh, q_tile.dtype, FP8)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
    return acc, m_new, denom


# The page tables' row stride (their width, the step's longest sequence in pages) changes
# from step to step: a plain argument, or Triton would compile again for a width of 1 and for
# a width divisible by 16 during serving.
@triton.jit(do_not_specialize=["stride_table"])
def _prefill(
    q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, out,
    k_scale, v_scale, sinks, scale_log2, softcap, window, group, page_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    # The last query blocks see the most keys: the grid runs them first, so that the short
    # ones fill the end of the launch.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid covers the longest query of the batch
        return
    seq_len = tl.load(seq_lens + b)
    kv_head = head // group

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = i < q_len
    pos = seq_len - q_len + i  # each query row's own position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    q_tile = tl.load(
        q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=i_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q_tile, scale_log2 = _compute_dtype(q_tile, k_cache, k_scale, scale_log2, FP8)

    # Keys any row of this block may see: from the first row's window to the last row itself.
    first_pos = seq_len - q_len + m_block * BLOCK_M
    last = tl.minimum(first_pos + BLOCK_M, seq_len)
    lo = 0
    # Whole steps of keys before the block's first row are visible to all of its rows.
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    if window > 0:
        lo = tl.maximum(first_pos - window + 1, 0)
        unmasked_end = lo  # a window masks per row: every step masked
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = page_tables + b.to(tl.int64) * stride_table
    for t0 in range(lo, unmasked_end, BLOCK_N):
        acc, m, denom = _attend_keys(
            acc, m, denom, q_tile, t0, last, pos, window, table, page_size, kv_head, d, d_ok,
            k_cache, v_cache, k_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, scale_log2, softcap, BLOCK_N, PRECISION, FP8, SOFTCAP, False)
    for t0 in range(unmasked_end, last, BLOCK_N):
        acc, m, denom = _attend_keys(
            acc, m, denom, q_tile, t0, last, pos, window, table, page_size, kv_head, d, d_ok,
            k_cache, v_cache, k_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, scale_log2, softcap, BLOCK_N, PRECISION, FP8, SOFTCAP, True)
    acc, m, denom = with_sinks(acc, m, denom, sinks, head + tl.zeros([BLOCK_M], tl.int32), i_ok,
                               SINKS)

    result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if FP8:
        result = result * tl.load(v_scale)
    tl.store(
        out + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        result.to(out.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :],
    )


def paged_prefill(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, *, scale: float,
                  window: int | None, max_query_len: int, k_scale=None,
                  v_scale=None, softcap: float | None = None, sinks=None) -> torch.Tensor:
    """Causal attention of packed queries `q [tokens, heads, head_dim]` over their sequences'
    pages; `max_query_len` (tokens, a host int) bounds every sequence's query length and sizes
    the grid and the tile. fp8 pages read through `k_scale`/`v_scale`; scores softcapped
    unless `softcap` is None; each head's sink logit (float32 `sinks [heads]`, or None) in
    its softmax denominator. Reads nothing back from the device."""
    k_scale, v_scale = scale_args(k_cache, k_scale, v_scale)
    batch = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    launch = prefill_launch(q.dtype, k_cache.dtype, head_dim, max_query_len,
                            shared_memory(q.device), softcap is not None, sinks is not None)
    grid = (triton.cdiv(max_query_len, launch.constexprs["BLOCK_M"]), num_heads, batch)
    sink_arg = q if sinks is None else sinks  # q stands in: not read
    _prefill[grid](
        q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, out, k_scale, v_scale,
        sink_arg, scale * LOG2E, softcap or 1.0, window or 0,
        num_heads // k_cache.shape[2], k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], page_tables.stride(0),
        **launch.kwargs(),
    )
    return out


def prefill_launch(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                   max_query_len: int, shared: int, softcap: bool = False,
                   sinks: bool = False) -> Launch:
    """How `paged_prefill` compiles `_prefill` for queries of `dtype` (at most `max_query_len`
    tokens a sequence) over pages of `cache_dtype`, its scores softcapped or not, with
    attention sinks or not, on a GPU
    giving a program `shared` bytes of shared memory. Long queries step SMALL_BLOCK_N keys (on
    an H200, 21% faster than 128 rows, 64 keys and 8 warps on 16 prompts of 512 tokens, as
    fast on 4 of 2,048: benchmarks/tiles.py); so do heads over 128 wide (Gemma 3's 256), with
    8 warps, which spill with 64. Where that tile does not fit (float32 on sm_86 and sm_89), a
    smaller one (`triton_support.fitting_tile`)."""
    fp8 = is_fp8(cache_dtype)
    compute = dtype if fp8 else cache_dtype
    block_d = triton.next_power_of_2(head_dim)
    small = max_query_len >= LONG_QUERY or block_d > 128
    block_m, block_n, stages = fitting_tile(BLOCK_M, SMALL_BLOCK_N if small else BLOCK_N,
                                            block_d, compute, shared, min_rows=MIN_TILE)
    return Launch(dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=dot_precision(compute), FP8=fp8, SOFTCAP=softcap, SINKS=sinks,
    ), num_warps=8 if block_d > 128 else 4, num_stages=stages)
