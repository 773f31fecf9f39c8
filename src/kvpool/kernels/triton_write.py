"""write_kv in one Triton kernel: each program copies one new token's K and V rows to its slot.

One launch writes both caches, with no host synchronisation. There is no host-side check of the
slots here (it would synchronise): a slot outside `[0, num_pages * page_size)` is skipped on the
device, so a bad slot never writes outside the caches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_kv(
    k_cache, v_cache, slots, k, v, num_slots, page_size,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_kt, stride_kth, stride_vt, stride_vth,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The token's slot, once per head row (the same address): a vector keeps every mask a tile.
    slot = tl.load(slots + token + 0 * h).to(tl.int64)[:, None]
    ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0) & (slot < num_slots)
    page = slot // page_size
    offset = slot % page_size
    k_row = tl.load(k + token * stride_kt + h[:, None] * stride_kth + d[None, :], mask=ok)
    v_row = tl.load(v + token * stride_vt + h[:, None] * stride_vth + d[None, :], mask=ok)
    tl.store(k_cache + page * stride_kp + offset * stride_ks + h[:, None] * stride_kh + d[None, :],
             k_row, mask=ok)
    tl.store(v_cache + page * stride_vp + offset * stride_vs + h[:, None] * stride_vh + d[None, :],
             v_row, mask=ok)


def write_kv(k_cache, v_cache, slots, k, v) -> None:
    """Store K and V `[n, num_kv_heads, head_dim]` (the caches' dtype, last dim dense) of n
    tokens at `slots` `[n]` of the `[num_pages, page_size, num_kv_heads, head_dim]` caches."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if slots.shape[0] == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    _write_kv[(slots.shape[0],)](
        k_cache, v_cache, slots, k, v, num_pages * page_size, page_size,
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
