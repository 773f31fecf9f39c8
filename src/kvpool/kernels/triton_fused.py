"""The decoder's elementwise steps fused in Triton: RMSNorm with the residual add before it, and
SiLU-and-mul (SwiGLU's gate). Each replaces several torch kernels by one launch and rounds
where the torch code of kvpool.models.layers rounds, so the results differ from it only in
the float32 sum's order and the exponential's last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels.triton_support import Launch

SILU_BLOCK = 1024  # values of a row per SiLU-and-mul program


@triton.jit
def round_to(x, dtype):
    """float32 `x` rounded to `dtype` to nearest, ties to even, as a GPU converts it. For
    bfloat16 the rounding is done on the float32 bits first, so that the conversion only drops
    zero bits: the interpreter's own conversion truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.where(x == x, rounded, x)  # NaN stays NaN (its low bits could carry into inf)
    return x.to(dtype)


@triton.jit
def _rms_norm(
    x, residual, weight, out, summed, eps, size, stride_x, stride_r, stride_o, stride_s,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    h = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        h = round_to(h.to(tl.float32) + r.to(tl.float32), h.dtype)
        tl.store(summed + row * stride_s + cols, h, mask=ok)
    wide = h.to(tl.float32)
    inverse_rms = tl.math.rsqrt(tl.sum(wide * wide, 0) / size + eps)
    normed = round_to(wide * inverse_rms, h.dtype)
    w = tl.load(weight + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out + row * stride_o + cols, round_to(y, out.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul(gate, up, out, size, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0)
    wide = g.to(tl.float32)
    act = round_to(wide / (1.0 + tl.exp(-wide)), g.dtype)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out + row * stride_o + cols, round_to(y, out.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """`weight * rms_normed(x)` over the last dimension of x `[..., size]` (the norm in float32,
    cast to x's dtype before the scale). With `residual` (x's shape), x + residual is normed
    and returned too: `(normed, x + residual)`."""
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    out = torch.empty_like(rows)
    summed = torch.empty_like(rows) if residual is not None else out  # not touched without
    added = residual.reshape(-1, size) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm[(rows.shape[0],)](
            rows, added, weight, out, summed, eps, size, rows.stride(0), added.stride(0),
            out.stride(0), summed.stride(0),
            **norm_launch(size, residual is not None).kwargs(),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), summed.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for gate and up `[T, size]` (last dim dense), in their dtype."""
    tokens, size = gate.shape
    out = torch.empty_like(gate)
    if tokens:
        _silu_mul[(tokens, triton.cdiv(size, SILU_BLOCK))](
            gate, up, out, size, gate.stride(0), up.stride(0), out.stride(0),
            **silu_launch().kwargs(),
        )
    return out


def norm_launch(size: int, residual: bool) -> Launch:
    """How `rms_norm` compiles `_rms_norm` for rows of `size` values: one row a program,
    a warp per 256 values (4 to 16)."""
    block = triton.next_power_of_2(size)
    return Launch(dict(BLOCK=block, RESIDUAL=residual),
                  num_warps=min(max(block // 256, 4), 16), num_stages=1)


def silu_launch() -> Launch:
    """How `silu_mul` compiles `_silu_mul`: SILU_BLOCK values of one row a program."""
    return Launch(dict(BLOCK=SILU_BLOCK), num_warps=4, num_stages=1)
