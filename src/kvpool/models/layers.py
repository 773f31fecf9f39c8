"""The position-wise building blocks of a Llama-family decoder: RMSNorm and the gated MLP
with the activations config.json's `hidden_act` may name."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.models.parallel import ONE_RANK, ColumnLinear, RowLinear, TensorParallel


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 and cast back to the
    input's dtype before the (learned) scale, as transformers does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., size]` -> same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


_GELU_TANH = functools.partial(F.gelu, approximate="tanh")
# transformers' names (ACT2FN) of the activations a gated MLP runs; the tanh approximations
# of GELU are one formula that transformers computes in three ways.
ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": _GELU_TANH, "gelu_new": _GELU_TANH, "gelu_fast": _GELU_TANH,
}


class MLP(nn.Module):
    """Gated feed-forward: `down_proj(act(gate_proj(x)) * up_proj(x))`, `act` one of
    ACTIVATIONS (silu: SwiGLU). Under tensor parallelism (`tp`) it holds this rank's share of
    the intermediate features and returns its partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 act: str = "silu", tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.act = ACTIVATIONS[act]
        part = tp.part(intermediate_size, "intermediate_size")
        self.gate_proj = ColumnLinear(hidden_size, part, 1, bias, dtype)
        self.up_proj = ColumnLinear(hidden_size, part, 1, bias, dtype)
        self.down_proj = RowLinear(part, 1, hidden_size, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]` -> `[T, hidden_size]`."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
