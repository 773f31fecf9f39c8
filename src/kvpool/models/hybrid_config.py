"""The Mamba2 part of a hybrid model's config.json (Bamba, GraniteMoeHybrid): which layers are
Mamba layers and the geometry of their mixer, validated into one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kvpool.errors import ConfigError
from kvpool.models.parallel import TensorParallel
from kvpool.numeric import INT64_MAX

# GraniteMoeHybrid's `layer_types` (older configs: `layers_block_type`): transformers 5's
# names and the older ones it reads as them
MAMBA_TYPES, ATTENTION_TYPES = ("linear_attention", "mamba"), ("full_attention", "attention")
# Sane architectural limits of the mixer's sizes (as models/config.py's SIZE_LIMITS).
SIZE_LIMITS = {"mamba_n_heads": 2**14, "mamba_expand": 2**6, "mamba_n_groups": 2**14,
               "mamba_d_state": 2**14, "mamba_d_conv": 2**10, "mamba_chunk_size": 2**20}


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """A Mamba2 mixer: `num_heads` heads of `head_dim` channels (`intermediate_size` in all),
    an SSM state of `state_size` per head channel with B and C shared by `num_groups` groups
    of heads, a causal depthwise convolution of width `conv_kernel` over x, B and C, and the
    prefill scan in chunks of `chunk_size` tokens. `layers` are the model layers it is in."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]  # dt is clamped to [low, high] after the softplus

    @property
    def intermediate_size(self) -> int:
        """Channels of x (and of the gate z): heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """Outputs of in_proj: the gate z, the conv channels and one dt per head."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def activation_size(self) -> int:
        """Values per token a mixer's forward holds at its peak: in_proj's outputs, the
        conv's and the scan's."""
        return self.in_proj_size + self.conv_dim + self.intermediate_size

    def count_parameters(self, hidden_size: int) -> int:
        """Parameters of one mixer on a residual stream of `hidden_size`: in_proj, the
        depthwise conv, dt_bias, A_log and D per head, the gated norm, out_proj, and the
        biases the config has."""
        params = hidden_size * self.in_proj_size + self.conv_dim * self.conv_kernel
        params += 3 * self.num_heads + self.intermediate_size
        params += self.intermediate_size * hidden_size
        if self.conv_bias:
            params += self.conv_dim
        if self.proj_bias:
            params += self.in_proj_size + hidden_size
        return params

    def per_rank(self, size: int) -> MambaConfig:
        """The mixer one of `size` tensor-parallel ranks holds: its share of the heads and of
        the B/C groups, or one group replicated when there are fewer groups than ranks
        (kvpool.models.parallel). ConfigError when they do not split evenly."""
        tp = TensorParallel(0, size)
        heads = tp.part(self.num_heads, "mamba_n_heads")
        groups = tp.shared_part(self.num_groups, "mamba_n_groups")
        return replace(self, num_heads=len(heads), num_groups=len(groups))


def parse_bamba(cfg: dict, hidden_size: int, num_layers: int) -> MambaConfig:
    """The Mamba layers of a Bamba config: every layer not in `attn_layer_indices`."""
    attention = cfg.get("attn_layer_indices") or []
    if not isinstance(attention, list) or not all(
            _is_int(i) and 0 <= i < num_layers for i in attention):
        raise ConfigError(f"config 'attn_layer_indices' must list layer indices in "
                          f"[0, {num_layers}), got {attention!r}")
    if not attention:
        raise ConfigError("a Bamba config without attn_layer_indices has no attention layer; "
                          "kvpool needs at least one")
    return _mixer(cfg, hidden_size, tuple(i for i in range(num_layers) if i not in attention))


def parse_granite_hybrid(cfg: dict, hidden_size: int, num_layers: int) -> MambaConfig:
    """The Mamba layers of a GraniteMoeHybrid config: those its `layer_types` (or
    `layers_block_type`) name `mamba` or `linear_attention`; the others `attention` or
    `full_attention`. transformers makes every layer a Mamba layer by default."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    types = [MAMBA_TYPES[0]] * num_layers if types is None else types
    if not (isinstance(types, list) and len(types) == num_layers
            and all(t in MAMBA_TYPES + ATTENTION_TYPES for t in types)):
        raise ConfigError(f"config 'layer_types' must list one of "
                          f"{', '.join(MAMBA_TYPES + ATTENTION_TYPES)} for each of the "
                          f"{num_layers} layers, got {types!r}")
    layers = tuple(i for i, t in enumerate(types) if t in MAMBA_TYPES)
    if len(layers) == num_layers:
        raise ConfigError("a GraniteMoeHybrid config whose layer_types name no attention "
                          "layer: kvpool needs at least one")
    return _mixer(cfg, hidden_size, layers)


def _mixer(cfg: dict, hidden_size: int, layers: tuple[int, ...]) -> MambaConfig:
    """The Mamba2 mixer of a hybrid config, in the model layers `layers`."""
    heads = _int(cfg, "mamba_n_heads")
    expand = _int(cfg, "mamba_expand", 2)
    if (expand * hidden_size) % heads:
        raise ConfigError(f"mamba_n_heads={heads} does not divide mamba_expand x hidden_size "
                          f"= {expand * hidden_size}")
    head_dim = cfg.get("mamba_d_head")
    head_dim = expand * hidden_size // heads if head_dim in (None, "auto") else head_dim
    if not _is_int(head_dim) or head_dim * heads != expand * hidden_size:
        raise ConfigError(f"mamba_d_head={head_dim!r} x mamba_n_heads={heads} must equal "
                          f"mamba_expand x hidden_size = {expand * hidden_size}")
    groups = _int(cfg, "mamba_n_groups", 1)
    if heads % groups:
        raise ConfigError(f"mamba_n_groups={groups} does not divide mamba_n_heads={heads}")
    return MambaConfig(
        layers=layers, num_heads=heads, head_dim=head_dim,
        state_size=_int(cfg, "mamba_d_state"), num_groups=groups,
        conv_kernel=_int(cfg, "mamba_d_conv", 4), chunk_size=_int(cfg, "mamba_chunk_size", 256),
        conv_bias=_bool(cfg, "mamba_conv_bias", True), proj_bias=_bool(cfg, "mamba_proj_bias"),
        time_step_limit=_time_step_limit(cfg.get("time_step_limit")),
    )


# The hybrid architectures -> the parser of their Mamba layers
MAMBA_PARSERS = {"BambaForCausalLM": parse_bamba,
                 "GraniteMoeHybridForCausalLM": parse_granite_hybrid}
HYBRID_ARCHITECTURES = tuple(MAMBA_PARSERS)


def _time_step_limit(value: Any) -> tuple[float, float]:
    """[low, high]; transformers writes infinity as {"__float__": "Infinity"}."""
    if value is None:
        return 0.0, math.inf
    bounds = [float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v
              for v in value] if isinstance(value, list) else None
    if not bounds or len(bounds) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds) or not (
            0 <= bounds[0] <= bounds[1]):
        raise ConfigError(f"config 'time_step_limit' must be [low, high] with "
                          f"0 <= low <= high, got {value!r}")
    return float(bounds[0]), float(bounds[1])


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    limit = SIZE_LIMITS.get(key, INT64_MAX)
    if not _is_int(value) or not 0 < value <= limit:
        raise ConfigError(f"config {key!r} must be a positive integer at most {limit}, "
                          f"got {value!r}")
    return value


def _bool(cfg: dict, key: str, default: bool = False) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config {key!r} must be true or false, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
