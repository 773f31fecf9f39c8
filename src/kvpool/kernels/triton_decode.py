"""Paged decode attention in Triton: one query token per sequence, K/V read in place from pages.

A program takes one (sequence, kv head, context split): the G query heads sharing that kv head
are one tile, so each K/V byte is read once for all of them (a group over MAX_BLOCK_G heads, as
in MLA's latent decode, takes several programs). It walks its part of the visible tokens
BLOCK_N at a time, looking each token's page up in the page table (any page size works), with
an online softmax in base 2 accumulated in float32. When batch x kv heads is too small to fill
the GPU, the context is split (flash decoding): each split writes its normalised partial output
and log-sum-exp, and a second kernel merges them. Only slots in [first, seq_len) are
loaded, so unwritten slots (any bits, NaN included) never reach the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels import MAX_DECODE_SPLITS
from kvpool.kernels.triton_support import (
    Launch,
    dot_precision,
    fitting_tile,
    scale_args,
    shared_memory,
)
from kvpool.memory.fp8 import is_fp8

BLOCK_N = 64  # tokens per step: 16 KiB of bf16 K at head_dim 128
WIDE_BLOCK_N = 16  # tokens per step for heads over 256 wide (MLA's 576): pages fit shared memory
MAX_BLOCK_G = 16  # query heads per program
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves
WAVES = 4  # programs per SM to aim for: several small programs per SM hide memory latency
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # in the kernels
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation; PRECISION from `triton_support.dot_precision`."""
    if PRECISION == "ieee":
        result = tl.dot(a, b, input_precision="ieee")
    elif PRECISION == "upcast":
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def _compute_dtype(q_tile, k_cache, k_scale, scale_log2, FP8: tl.constexpr):
    """The query tile in the dtype the dots run in and the scores' factor: for fp8 pages q's
    own dtype, with the K scale folded into the factor (the V scale multiplies the output);
    else the cache's dtype and the factor as it is."""
    if FP8:
        result = q_tile, scale_log2 * tl.load(k_scale)
    else:
        result = q_tile.to(k_cache.dtype.element_ty), scale_log2
    return result


@triton.jit
def softcapped(scores, softcap, SOFTCAP: tl.constexpr):
    """Base-2 `scores` capped as Gemma 2 caps natural ones, `softcap * tanh(s / softcap)`
    (with SOFTCAP; else as they are), to a few float32 ulps of tanh for any positive float32
    softcap (the interpreter has no tanh): below |x| = 1/8 by tanh's odd series to x^7 (the
    exponential's form would cancel there, and a cap far above the scores would zero them),
    above it as (1 - e) / (1 + e), e = exp(-2|x|) <= 1, which neither overflows nor cancels."""
    if SOFTCAP:
        x = scores / _LOG2E / softcap
        x2 = x * x
        series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        e = tl.math.exp2(tl.abs(x) * (-2.0 * _LOG2E))
        tanh = tl.where(x2 < 1.0 / 64.0, series, tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e))
        scores = tanh * softcap * _LOG2E
    return scores


@triton.jit
def base2_sink(sink):
    """A natural sink logit in base 2, at most float32's largest: infinity less infinity would
    be NaN (a NaN sink stays NaN)."""
    scaled = sink * _LOG2E
    return tl.where(scaled > _FLOAT32_MAX, _FLOAT32_MAX, scaled)


@triton.jit
def with_sinks(acc, m, denom, sinks, heads, rows_ok, SINKS: tl.constexpr):
    """The online softmax's (acc, m, denom) with each row's sink (the natural logit
    `sinks[heads]`, with SINKS; else as they are) joined to the denominator as a score of no
    value."""
    if SINKS:
        sink = base2_sink(tl.load(sinks + heads, mask=rows_ok, other=0.0))
        top = tl.maximum(m, sink)
        alpha = tl.math.exp2(m - top)
        denom = denom * alpha + tl.math.exp2(sink - top)
        acc = acc * alpha[:, None]
        m = top
    return acc, m, denom


@triton.jit
def _widen(x, dtype):
    """fp8 tile `x` in `dtype`, exactly (every e4m3 value is a float16 and bfloat16 value too),
    through float32: the interpreter's direct fp8 -> bfloat16 conversion is wrong."""
    return x.to(tl.float32).to(dtype)


@triton.jit
def load_tokens(cache, page, slot, kv_head, d, mask, stride_p, stride_s, stride_h,
                dtype, FP8: tl.constexpr):
    """The `[BLOCK_N, BLOCK_D]` tile of one KV head's K or V for tokens at (`page`, `slot`),
    in `dtype` for fp8 pages (see `_widen`), else in the cache's own dtype."""
    x = tl.load(
        cache + page[:, None] * stride_p + slot[:, None] * stride_s + kv_head * stride_h
        + d[None, :],
        mask=mask, other=0.0,
    )
    if FP8:
        x = _widen(x, dtype)
    return x


# The page tables' row stride is a plain argument, as in triton_prefill: eager steps' widths
# vary.
@triton.jit(do_not_specialize=["stride_table"])
def _decode_split(
    q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, out, part_out, part_lse,
    k_scale, v_scale, sinks, scale_log2, softcap, window, group, page_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head_blocks = tl.cdiv(group, BLOCK_G)
    kv_head = tl.program_id(1) // head_blocks
    head_block = tl.program_id(1) % head_blocks
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens + b)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    # Each sequence cuts its own visible span into num_splits parts of whole blocks, so the
    # work is balanced whatever the batch's longest context; a part past the end is empty.
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = head_block * BLOCK_G + tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    row_ok = g < group
    d_ok = d < HEAD_DIM
    row = tl.load(cu_seqlens_q + b)
    q_tile = tl.load(
        q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q_tile, scale_log2 = _compute_dtype(q_tile, k_cache, k_scale, scale_log2, FP8)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = page_tables + b.to(tl.int64) * stride_table
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(table + t // page_size, mask=t_ok, other=0).to(tl.int64)
        slot = t % page_size
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = load_tokens(k_cache, page, slot, kv_head, d, kv_ok, stride_kp, stride_ks,
                        stride_kh, q_tile.dtype, FP8)
        scores = softcapped(dot(q_tile, tl.trans(k), PRECISION) * scale_log2, softcap, SOFTCAP)
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = load_tokens(v_cache, page, slot, kv_head, d, kv_ok, stride_vp, stride_vs,
                        stride_vh, q_tile.dtype, FP8)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
        m = m_new
    if not SPLIT:  # a split context's sinks join once, in the merge
        acc, m, denom = with_sinks(acc, m, denom, sinks, heads, row_ok, SINKS)

    # An empty split (or seq_len 0, as in padded graph rows) has denom == 0 and acc == 0.
    safe_denom = tl.where(denom > 0, denom, 1.0)
    result = acc / safe_denom[:, None]
    if FP8:
        result = result * tl.load(v_scale)
    if SPLIT:
        num_heads = tl.num_programs(1) // head_blocks * group
        part = (b * num_heads + heads) * num_splits + split
        tl.store(part_out + part[:, None] * BLOCK_D + d[None, :], result, mask=row_ok[:, None])
        lse = tl.where(denom > 0, m + tl.math.log2(safe_denom), float("-inf"))
        tl.store(part_lse + part, lse, mask=row_ok)
    else:
        tl.store(
            out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            result.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )


# The split count is a plain argument: a value divisible by 16 would otherwise compile again.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits(
    part_out, part_lse, cu_seqlens_q, out, sinks, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    first = (b * tl.num_programs(1) + head) * num_splits
    # An online sum over the splits in base 2, as in the split kernel: top is the largest
    # log-sum-exp so far, total and acc the weights and weighted outputs under it; with
    # SINKS the head's sink starts them, a weight of no value.
    if SINKS:
        top = base2_sink(tl.load(sinks + head))
        total = tl.full([], 1.0, tl.float32)
    else:
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(num_splits):
        lse = tl.load(part_lse + first + s)
        new_top = tl.maximum(top, lse)
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)  # every split so far empty
        alpha = tl.math.exp2(top - safe_top)
        weight = tl.math.exp2(lse - safe_top)
        total = total * alpha + weight
        acc = acc * alpha + weight * tl.load(part_out + (first + s) * BLOCK_D + d)
        top = new_top
    result = acc / tl.where(total > 0, total, 1.0)
    row = tl.load(cu_seqlens_q + b)
    tl.store(out + row * stride_ot + head * stride_oh + d, result.to(out.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_span: int, sms: int) -> int:
    """Context splits per (sequence, kv head) on a GPU of `sms` streaming multiprocessors
    (`triton_support.num_sms`): enough programs for WAVES per SM, never a split
    under MIN_SPLIT_TOKENS tokens of the longest visible span `max_span` (tokens), and none
    when the batch alone gives half the programs aimed at: the GPU is full, and the merge
    (a second launch, partial results written and read back) would cost more than it adds."""
    programs = max(1, batch * num_kv_heads)
    wanted = -(-WAVES * sms // programs)
    if wanted <= 2:
        return 1
    return max(1, min(wanted, MAX_DECODE_SPLITS, -(-max_span // MIN_SPLIT_TOKENS)))


def decode_launch(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, group: int,
                  num_splits: int, split_tokens: int, shared: int,
                  softcap: bool = False, sinks: bool = False) -> Launch:
    """How `paged_decode` compiles `_decode_split` for queries of `dtype` over pages of
    `cache_dtype`, `group` query heads per kv head, in `num_splits` context splits of at most
    `split_tokens` tokens, on a GPU giving a program `shared` bytes of shared memory, its
    scores softcapped or not, with attention sinks or not. A split
    takes its tokens in blocks of the power of two that covers it, from 16 to BLOCK_N (on an
    H200, 128 tokens a step with 8 warps or 4 were no faster: benchmarks/tiles.py); heads over
    256 wide step WIDE_BLOCK_N tokens. Where two pipeline stages or that block do not fit
    (MLA's float32 decode, float32 on sm_86 and sm_89), one stage or a smaller block
    (`triton_support.fitting_tile`)."""
    fp8 = is_fp8(cache_dtype)
    compute = dtype if fp8 else cache_dtype
    block_d = triton.next_power_of_2(head_dim)
    if block_d > 256:
        block_n = WIDE_BLOCK_N
    else:
        block_n = min(BLOCK_N, max(16, triton.next_power_of_2(split_tokens)))
    block_g = _block_g(group)
    _, block_n, stages = fitting_tile(block_g, block_n, block_d, compute, shared,
                                      min_rows=block_g)
    return Launch(dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_N=block_n,
        SPLIT=num_splits > 1, PRECISION=dot_precision(compute), FP8=fp8, SOFTCAP=softcap,
        SINKS=sinks,
    ), num_warps=8 if block_n * block_d >= 128 * 128 else 4, num_stages=stages)


def merge_launch(head_dim: int, sinks: bool = False) -> Launch:
    """How `paged_decode` compiles `_merge_splits` (split contexts only), with attention
    sinks or not."""
    return Launch(dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                       SINKS=sinks), num_warps=4, num_stages=1)


def _block_g(group: int) -> int:
    """Query heads per program: the group (at least 16, tl.dot's smallest tile), at most
    MAX_BLOCK_G: a larger group (MLA's latent decode: every head shares one kv head) is
    spread over several programs, each reading the pages again."""
    return min(max(16, triton.next_power_of_2(group)), MAX_BLOCK_G)


def paged_decode(q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, *, scale: float,
                 window: int | None, num_splits: int, max_span: int, workspace=None,
                 k_scale=None, v_scale=None, softcap: float | None = None,
                 sinks=None) -> torch.Tensor:
    """Decode attention of one query token per sequence (row `cu_seqlens_q[b]` of
    `q [tokens, heads, head_dim]`) over the first `seq_lens[b]` tokens of its pages (fp8 pages
    through `k_scale`/`v_scale`), scores softcapped unless `softcap` is None, each head's
    sink logit (float32 `sinks [heads]`, or None) in its softmax denominator; `max_span`
    (tokens, a host int) bounds every sequence's visible span.

    Reads nothing back from the device; `num_splits` (from `choose_num_splits`) fixes the grid,
    and with `max_span` the tile (`decode_launch`).
    Partial results of split contexts come from `workspace.alloc` when a workspace is given.
    """
    batch = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    k_scale, v_scale = scale_args(k_cache, k_scale, v_scale)
    if num_splits > 1:
        alloc = workspace.alloc if workspace is not None else _alloc(q.device)
        part_out = alloc((batch, num_heads, num_splits, block_d), torch.float32)
        part_lse = alloc((batch, num_heads, num_splits), torch.float32)
    else:
        part_out = part_lse = out  # not touched
    launch = decode_launch(q.dtype, k_cache.dtype, head_dim, group, num_splits,
                           -(-max_span // num_splits), shared_memory(q.device),
                           softcap is not None, sinks is not None)
    head_blocks = triton.cdiv(group, launch.constexprs["BLOCK_G"])
    sink_arg = q if sinks is None else sinks  # q stands in: not read
    _decode_split[(batch, num_kv_heads * head_blocks, num_splits)](
        q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, out, part_out, part_lse,
        k_scale, v_scale, sink_arg, scale * LOG2E, softcap or 1.0, window or 0, group,
        k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], page_tables.stride(0),
        **launch.kwargs(),
    )
    if num_splits > 1:
        _merge_splits[(batch, num_heads)](
            part_out, part_lse, cu_seqlens_q, out, sink_arg, num_splits, out.stride(0),
            out.stride(1), **merge_launch(head_dim, sinks is not None).kwargs(),
        )
    return out


def _alloc(device: torch.device):
    """`alloc(shape, dtype)` over plain torch allocations on `device`."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)
