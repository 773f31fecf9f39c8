"""Rotating packed queries and keys by RoPE: the torch code every device runs for queries
and keys that no kernel rotates (write_kv rotates K, and q with it, in its Triton kernel).

The angles come from kvpool.models.rotary (cos/sin `[T, 1, rotary_dim // 2]` in the
activations' dtype). Each product and sum rounds to that dtype, as transformers computes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]` by the angles whose cos/sin are `[T, 1, rotary_dim // 2]`
    (the rotate-half convention: dimension i pairs with i + rotary_dim / 2); channels past
    rotary_dim (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs (x0, x1), (x2, x3), ... of x `[T, heads, dim]` (DeepSeek's
    layout); the result holds the rotated first members, then the second ones, as
    transformers lays it out. Queries and keys rotated alike keep their dot products."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotation(NamedTuple):
    """RoPE that `write_kv` applies as it writes: K is stored rotated and `q`
    `[n, heads, head_dim]` is rotated in place, by cos/sin `[n, 1, rotary_dim // 2]` (in K's
    dtype, rotate-half convention; channels past rotary_dim pass through)."""

    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def check(self, k: torch.Tensor) -> None:
        """ValueError naming the shapes unless it fits keys `k [n, kv_heads, head_dim]`."""
        n, _, head_dim = k.shape
        half = self.cos.shape[-1]
        problem = None
        if self.q.dim() != 3 or self.q.shape[0] != n or self.q.shape[2] != head_dim:
            problem = f"q must be [{n}, heads, {head_dim}]"
        elif self.q.dtype != k.dtype or self.cos.dtype != k.dtype or self.sin.dtype != k.dtype:
            problem = f"q, cos and sin must be in k's {k.dtype}"
        elif self.q.stride(2) != 1:
            problem = "q must be dense in head_dim (it is rotated in place)"
        elif self.cos.shape != (n, 1, half) or self.sin.shape != (n, 1, half) \
                or not 0 < 2 * half <= head_dim:
            problem = f"cos and sin must be [{n}, 1, rotary_dim // 2] with rotary_dim <= {head_dim}"
        if problem:
            raise ValueError(
                f"write_kv rotation: {problem}; got q {tuple(self.q.shape)} {self.q.dtype}, "
                f"cos {tuple(self.cos.shape)} {self.cos.dtype}, sin {tuple(self.sin.shape)}, "
                f"k {tuple(k.shape)} {k.dtype}")
