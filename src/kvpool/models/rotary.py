"""Rotary position embedding (RoPE): inverse frequencies for the default, `linear` and `llama3`
rope types, cos/sin for a step's positions, and their application to packed q/k.

Numerics follow transformers: inverse frequencies in float32, angles `position * inv_freq` in
float32, cos/sin cast to the activations' dtype, and the rotate-half convention (dimension i
pairs with i + head_dim/2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpool.errors import ConfigError
from kvpool.models.config import ModelConfig

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inv_frequencies(config: ModelConfig, device=None) -> torch.Tensor:
    """`[rotary_dim // 2]` float32 inverse frequencies (radians per position) of the config's
    rope type."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_frequencies(inv_freq, scaling)


def _llama3_inv_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the
    band between them interpolated smoothly."""
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ConfigError(f"rope_type 'llama3' needs {', '.join(missing)} in rope_scaling")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotary angles for a step's positions; computed per forward pass (cheap:
    tokens x head_dim/2 values) rather than cached up to max_position_embeddings."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(config, device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions `[T]` int64 -> (cos, sin), each `[T, 1, head_dim // 2]` in `dtype`."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq.float()
        return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]` by the angles whose cos/sin are `[T, 1, rotary_dim // 2]`;
    channels past rotary_dim (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
