"""The position-wise building blocks of a Llama-family decoder: RMSNorm (with the residual add
before it) and the gated MLP (or Arcee's and Apertus's ungated one) with the activations
config.json's `hidden_act` may name. On CUDA the norm and SiLU-and-mul run fused Triton
kernels (kvpool.kernels.triton_fused; where, says `triton_support.fused_on`), elsewhere the
torch code below."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.kernels import triton_support
from kvpool.models.parallel import (
    ONE_RANK,
    ColumnLinear,
    Index,
    RowLinear,
    Sharded,
    TensorParallel,
)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 and cast back to the
    input's dtype before the (learned) scale, as transformers does. Given the residual stream
    too, it adds x to it first and returns the sum as well (the next residual)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x `[..., size]` -> normed, same shape and dtype; with `residual` (x's shape),
        `(normed x + residual, x + residual)`."""
        if triton_support.fused_on(x.device):
            from kvpool.kernels import triton_fused

            return triton_fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Float32RMSNorm(nn.Module):
    """RMSNorm whose learned scale, `offset + weight` (Gemma's 1 + weight, OLMo 2's weight),
    is applied in float32 before the cast back to the input's dtype (transformers' order for
    those models)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., size]` -> same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` (SwiGLU's gate), gate and up `[T, size]`: one Triton launch on CUDA."""
    if triton_support.fused_on(gate.device):
        from kvpool.kernels import triton_fused

        return triton_fused.silu_mul(gate, up)
    return F.silu(gate) * up


def _gated(act):
    """The gate `act(gate) * up` of an activation that has no fused kernel."""
    return lambda gate, up: act(gate) * up


def gpt_oss_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's experts' gate: gate clamped to at most 7 and up to [-7, 7], then
    `(up + 1) * gate * sigmoid(1.702 * gate)` (its config's swiglu_limit and swiglu_alpha,
    which models/config.py holds to these values)."""
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


_GELU_TANH = _gated(functools.partial(F.gelu, approximate="tanh"))
# transformers' names (ACT2FN) of the activations a gated MLP runs, each as its gate
# `(gate, up) -> act(gate) * up`; the tanh approximations of GELU are one formula that
# transformers computes in three ways. GPT-OSS's experts gate with a clamped SwiGLU that
# transformers computes in the experts themselves (no ACT2FN name): kvpool names it
# "gpt_oss_swiglu".
ACTIVATIONS = {
    "silu": silu_and_mul, "swish": silu_and_mul, "relu": _gated(F.relu), "gelu": _gated(F.gelu),
    "gelu_pytorch_tanh": _GELU_TANH, "gelu_new": _GELU_TANH, "gelu_fast": _GELU_TANH,
    "gpt_oss_swiglu": gpt_oss_swiglu,
}


class ReLUSquared(nn.Module):
    """relu(x) squared (Arcee's `relu2`); it holds no weights, whatever their `dtype`."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class XIELU(nn.Module, Sharded):
    """Apertus's xIELU, with its learned `alpha_p` and `alpha_n` and the checkpoint's
    constants `beta` and `eps`: `a_p x^2 + beta x` for x > 0, else
    `(expm1(min(x, eps)) - x) a_n + beta x`, where a_p = softplus(alpha_p) and
    a_n = beta + softplus(alpha_n) (transformers' formula, in the weights' dtype)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1, dtype=dtype))
        self.alpha_n = nn.Parameter(torch.empty(1, dtype=dtype))
        self.register_buffer("beta", torch.empty((), dtype=dtype))
        self.register_buffer("eps", torch.empty((), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)

    def checkpoint_index(self, name: str) -> Index:
        return ((),)  # all of each tensor on every rank, the 0-d beta and eps included


# ... and those an ungated MLP runs, as modules (xIELU holds weights)
UNGATED_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu2": ReLUSquared, "xielu": XIELU}


class MLP(nn.Module):
    """Gated feed-forward: `down_proj(act(gate_proj(x)) * up_proj(x))`, `act` one of
    ACTIVATIONS (silu: SwiGLU, its gate fused on CUDA). Under tensor parallelism (`tp`) it
    holds this rank's share of the intermediate features and returns its partial sum; `what`
    names its width in the error when that does not split."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 act: str = "silu", tp: TensorParallel = ONE_RANK, *,
                 what: str = "intermediate_size"):
        super().__init__()
        self.act_and_mul = ACTIVATIONS[act]
        part = tp.part(intermediate_size, what)
        self.gate_proj = ColumnLinear(hidden_size, part, 1, bias, dtype)
        self.up_proj = ColumnLinear(hidden_size, part, 1, bias, dtype)
        self.down_proj = RowLinear(part, 1, hidden_size, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]` -> `[T, hidden_size]`."""
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))


class UngatedMLP(nn.Module):
    """Ungated feed-forward (Arcee's, Apertus's): `down_proj(act_fn(up_proj(x)))`, `act_fn`
    one of UNGATED_ACTIVATIONS (whole on every rank); split across the ranks as MLP is."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 act: str, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.act_fn = UNGATED_ACTIVATIONS[act](dtype)
        part = tp.part(intermediate_size, "intermediate_size")
        self.up_proj = ColumnLinear(hidden_size, part, 1, bias, dtype)
        self.down_proj = RowLinear(part, 1, hidden_size, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden_size]` -> `[T, hidden_size]`."""
        return self.down_proj(self.act_fn(self.up_proj(x)))
