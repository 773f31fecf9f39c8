"""Rotary position embedding (RoPE): inverse frequencies for the default, `linear`, `llama3`,
`yarn`, `longrope` and `frequency_factors` rope types, and cos/sin for a step's positions
(kvpool.rope applies them to packed q/k). `frequency_factors` divides each inverse frequency
by its own factor: the `rope_freqs` tensor in which GGUF files carry Llama 3.1's scaling.

LongRoPE (Phi-3's) divides them by `short_factor` or `long_factor`: the long ones wherever a
sequence may pass the trained context (`ModelConfig.for_max_model_len`), for every position,
so that a page's K/V never depends on the step that computed it (as vLLM; transformers
switches a sequence to the long factors when it passes the trained context and computes it
again from its first token).

Numerics follow transformers: inverse frequencies in float32, angles `position * inv_freq` in
float32, cos/sin (times yarn's or longrope's attention factor) cast to the activations' dtype."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpool.errors import ConfigError
from kvpool.models.config import ModelConfig

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inv_frequencies(config: ModelConfig, *, device: str | torch.device) -> torch.Tensor:
    """`[rotary_dim // 2]` float32 inverse frequencies (radians per position) of the config's
    rope type, on `device`."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_frequencies(config.rope_theta**exponents, config)
    if scaling["rope_type"] == "frequency_factors":
        return inv_freq / _factors(scaling["factors"], "rope frequency", dim, device)
    if scaling["rope_type"] == "longrope":
        return _longrope_inv_frequencies(
            config, "long_factor" if scaling["long"] else "short_factor", device)
    return _llama3_inv_frequencies(inv_freq, scaling)


def _longrope_inv_frequencies(config: ModelConfig, name: str,
                              device: str | torch.device) -> torch.Tensor:
    """1 / (factor * theta ** (2i / dim)), with rope_scaling[name]'s factor i: transformers'
    operations, so its bits."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    factors = _factors(config.rope_scaling[name], name, dim, device)
    return 1.0 / (factors * config.rope_theta**exponents)


def _factors(factors: list[float], name: str, dim: int,
             device: str | torch.device) -> torch.Tensor:
    """`factors`, one per inverse frequency of a rotary dimension `dim`, as a float32 tensor;
    ConfigError naming `name` for another count."""
    if len(factors) != dim // 2:
        raise ConfigError(f"{name} factors: {len(factors)} given, but a rotary dimension of "
                          f"{dim} has {dim // 2} frequencies")
    return torch.tensor(factors, dtype=torch.float32, device=device)


def attention_factor(config: ModelConfig) -> float:
    """What yarn and longrope multiply cos/sin by (1 for other rope types): the given
    attention_factor, else yarn's mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    longrope's sqrt(1 + ln(factor) / ln(trained context))."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        context = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / context
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))
    factor, mscale, mscale_all_dim = (scaling["factor"], scaling.get("mscale"),
                                      scaling.get("mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the trained one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_frequencies(wavelengths: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """YaRN over `wavelengths` (theta ** (2i / dim), positions per radian): frequencies that
    turn fewer than `beta_slow` times over the trained context are divided by `factor`
    (interpolated), those turning more than `beta_fast` times are kept (extrapolated), with a
    linear ramp between, over dimension indices. Same operations as transformers, so the
    same bits."""
    scaling = config.rope_scaling
    dim, base, factor = config.rotary_dim, config.rope_theta, scaling["factor"]
    context = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(wavelengths.device)
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


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

    def __init__(self, config: ModelConfig, *, device: str | torch.device):
        super().__init__()
        # computed on the CPU: on the meta device (a tensor-parallel rank's whole-model shapes)
        # torch's arange would import torch._dynamo, a second of start-up
        self.register_buffer("inv_freq", inv_frequencies(config, device="cpu").to(device),
                             persistent=False)
        self.attention_factor = attention_factor(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions `[T]` int64 -> (cos, sin), each `[T, 1, rotary_dim // 2]` in `dtype`."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq.float()
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

