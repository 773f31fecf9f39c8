"""fp8 KV pages: float8_e4m3fn values with one float32 scale per layer for K and one for V.
x is stored as `e4m3(clamp(x / scale, -448, 448))` (round to nearest even), so a page never
holds inf or NaN its K/V did not, and read back as `float32(byte) * scale`. A layer's scale is
the user's, or taken from the first K/V written to it: `amax * HEADROOM / E4M3_MAX`."""

from __future__ import annotations

import torch

from kvpool.numeric import FLOAT32_MAX, FLOAT32_TINY, check_float32

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
HEADROOM = 2.0  # room for later tokens above the first amax (docs/design-notes.md)
# The amax floor: a first prefill of all-zero K/V (or none finite) still gives a usable scale.
MIN_AMAX = 2.0**-10
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of KV pages for the `kv_cache_dtype` option: "auto" is the model's dtype,
    "fp8_e4m3" is float8_e4m3fn. ValueError names any other value."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def check_scale(name: str, value: object) -> float:
    """`value` as a float if it is a positive normal float32 (the pool stores scales in
    float32: 1e39 would be inf there and 1e-46 zero); else TypeError/ValueError naming `name`
    and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive finite number, got {value!r}")
    if not value > 0:  # NaN included
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    try:
        return check_float32(name, value, normal=True)
    except ValueError:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}, which the "
                         f"pool's float32 scales cannot hold: they take [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX:.4g}]") from None


def scale_of(x: torch.Tensor) -> torch.Tensor:
    """The scale (a float32 tensor `[]` on x's device, never read back) that stores `x` with
    HEADROOM: its largest finite |value|, at least MIN_AMAX, times HEADROOM / E4M3_MAX."""
    magnitude = x.detach().float().abs().nan_to_num_(nan=0.0, posinf=0.0)
    amax = magnitude.amax() if magnitude.numel() else magnitude.new_zeros(())
    return amax.clamp(min=MIN_AMAX) * (HEADROOM / E4M3_MAX)


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`x` stored as float8_e4m3fn under `scale`, saturating at +-E4M3_MAX."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn `x` read back: `float32(x) * scale`, in `dtype`."""
    return (x.float() * scale).to(dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether pages of `dtype` are quantized (hold fp8 bytes and need scales)."""
    return dtype == FP8_DTYPE
