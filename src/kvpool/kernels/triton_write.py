"""write_kv in one Triton kernel: each program copies one new token's K and V rows to its slot.

One launch writes both caches, with no host synchronisation. With a rotation (kvpool.rope),
the same program rotates the token's K by RoPE before storing it and its query heads in place,
so RoPE costs no launch of its own; each product and sum rounds to K's dtype, as the torch code
does. There is no host-side check of the slots here (it would synchronise): a slot outside
`[0, num_pages * page_size)` is skipped on the device, so a bad slot never writes outside the
caches. fp8 caches store `x / scale` saturated
and rounded to the nearest float8_e4m3fn (ties to even), as kvpool.memory.fp8.quantize does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels.triton_fused import round_to
from kvpool.kernels.triton_support import Launch, scale_args
from kvpool.memory import fp8
from kvpool.rope import Rotation

# A jit function reads a module global only if it is a tl.constexpr: the interpreter takes a
# plain float too, the compiler refuses it.
E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
SUBNORMAL_E4M3 = tl.constexpr(2.0**-6)  # the smallest normal e4m3; below it the step is 2^-9


@triton.jit
def _to_e4m3(x, scale):
    """float32 `x / scale` (NaN stays NaN, as in kvpool.memory.fp8.quantize), saturated at
    +-E4M3_MAX and rounded to the e4m3 grid (ties to even)
    in float32, then converted: the conversion of a value on the grid is exact everywhere,
    while the rounding of the conversion itself differs between GPUs and the interpreter."""
    y = tl.clamp(x / scale, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000  # rounded apart and put back, so that -0.0 stays -0.0
    magnitude = bits ^ sign
    # Normal range: round float32's 23 mantissa bits to e4m3's 3, ties to even.
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & 0xFFF00000
    # Subnormal range: adding 1.5 * 2^14, whose float32 step is 2^-9, rounds to that step.
    small = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((small + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    rounded = tl.where(small < SUBNORMAL_E4M3, subnormal, normal)
    # NaN: one whose top mantissa bits are set, which converts to e4m3's NaN byte (0x7F, as
    # torch's) on a GPU and in the interpreter alike
    rounded = tl.where(y != y, 0x7FF00000, rounded) | sign
    return rounded.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _rotated(x, ptr, rows, d, mask, cos, sin, ROTARY_DIM: tl.constexpr):
    """Tile `x` `[rows, BLOCK_D]` loaded from `ptr + rows + d`, its first ROTARY_DIM channels
    rotated by the token's `cos`/`sin` `[BLOCK_D]` (float32, channel i's angle at i and at
    i + ROTARY_DIM / 2): rotate-half, each product and sum rounded to x's dtype."""
    half: tl.constexpr = ROTARY_DIM // 2
    first = d < half
    turned = d < ROTARY_DIM
    partner_d = tl.where(first, d + half, d - half)
    partner = tl.load(ptr + rows + partner_d[None, :], mask=mask & turned[None, :], other=0.0)
    dtype = x.dtype
    direct = round_to(x.to(tl.float32) * cos[None, :], dtype).to(tl.float32)
    cross = round_to(partner.to(tl.float32) * sin[None, :], dtype).to(tl.float32)
    y = round_to(tl.where(first[None, :], direct - cross, direct + cross), dtype)
    return tl.where(turned[None, :], y, x)


@triton.jit
def _write_kv(
    k_cache, v_cache, slots, k, v, k_scale, v_scale, q, cos, sin, num_slots, page_size,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_kt, stride_kth, stride_vt, stride_vth, stride_qt, stride_qh, stride_cos,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, FP8: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The token's slot, once per head row (the same address): a vector keeps every mask a tile.
    slot = tl.load(slots + token + 0 * h).to(tl.int64)[:, None]
    ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0) & (slot < num_slots)
    page = slot // page_size
    offset = slot % page_size
    k_rows = token * stride_kt + h[:, None] * stride_kth
    k_row = tl.load(k + k_rows + d[None, :], mask=ok)
    v_row = tl.load(v + token * stride_vt + h[:, None] * stride_vth + d[None, :], mask=ok)
    if ROTARY_DIM > 0:
        angle = d % (ROTARY_DIM // 2)
        turned = d < ROTARY_DIM
        c = tl.load(cos + token * stride_cos + angle, mask=turned, other=1.0).to(tl.float32)
        s = tl.load(sin + token * stride_cos + angle, mask=turned, other=0.0).to(tl.float32)
        k_row = _rotated(k_row, k, k_rows, d, ok, c, s, ROTARY_DIM)
        # Every query row is rotated, whatever its slot (a padded row's slot may be -1).
        qh = tl.arange(0, BLOCK_QH)
        q_rows = token * stride_qt + qh[:, None] * stride_qh
        q_ok = (qh[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
        q_row = tl.load(q + q_rows + d[None, :], mask=q_ok)
        tl.store(q + q_rows + d[None, :], _rotated(q_row, q, q_rows, d, q_ok, c, s, ROTARY_DIM),
                 mask=q_ok)
    if FP8:
        k_row = _to_e4m3(k_row.to(tl.float32), tl.load(k_scale))
        v_row = _to_e4m3(v_row.to(tl.float32), tl.load(v_scale))
    tl.store(k_cache + page * stride_kp + offset * stride_ks + h[:, None] * stride_kh + d[None, :],
             k_row, mask=ok)
    tl.store(v_cache + page * stride_vp + offset * stride_vs + h[:, None] * stride_vh + d[None, :],
             v_row, mask=ok)


def write_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None,
             rotation: Rotation | None = None) -> None:
    """Store K and V `[n, num_kv_heads, head_dim]` (the caches' dtype, last dim dense) of n
    tokens at `slots` `[n]` of the `[num_pages, page_size, num_kv_heads, head_dim]` caches;
    fp8 caches take K/V of any float dtype and their scales (floats or float32 tensors `[]`).
    With a `rotation` (checked by the caller), K is stored rotated and its q rotated in place."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if slots.shape[0] == 0:
        return
    k_scale, v_scale = scale_args(k_cache, k_scale, v_scale)
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    # Without a rotation, k stands in for q, cos and sin, which the kernel does not read;
    # with one, cos and sin are read dense, at one stride
    q, cos, sin = rotation if rotation is not None else (k, k, k)
    cos, sin = cos.contiguous(), sin.contiguous()
    _write_kv[(slots.shape[0],)](
        k_cache, v_cache, slots, k, v, k_scale, v_scale, q, cos, sin, num_pages * page_size,
        page_size, *k_cache.stride()[:3], *v_cache.stride()[:3],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q.stride(0), q.stride(1),
        cos.stride(0),
        **write_launch(k_cache.dtype, num_kv_heads, head_dim, q.shape[1],
                       2 * cos.shape[-1] if rotation is not None else 0).kwargs(),
    )


def write_launch(cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_heads: int = 0,
                 rotary_dim: int = 0) -> Launch:
    """How `write_kv` compiles `_write_kv` for caches of `cache_dtype` and head geometry, with
    `num_heads` query heads rotated over `rotary_dim` channels (0: no rotation)."""
    return Launch(dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8.is_fp8(cache_dtype), NUM_HEADS=num_heads if rotary_dim else 0,
        BLOCK_QH=triton.next_power_of_2(num_heads) if rotary_dim else 1, ROTARY_DIM=rotary_dim,
    ), num_warps=4, num_stages=1,  # no loop to pipeline
        fp_fusion=False)  # the rotation's products round before the sum, as in torch
