"""The recurrent part of a hybrid model's config.json: which layers keep a state slot and the
geometry of their mixer, validated into one dataclass per kind of layer (Bamba's and
GraniteMoeHybrid's Mamba2 mixers, Qwen3-Next's Gated DeltaNet). Each kind declares the shapes
of its per-sequence state (`layout`): a causal conv's last inputs and a recurrent state of
heads x rows x columns, which a MambaPool holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvpool.errors import ConfigError
from kvpool.memory.state_pool import MambaLayout
from kvpool.models.parallel import TensorParallel
from kvpool.numeric import INT64_MAX

# GraniteMoeHybrid's `layer_types` (older configs: `layers_block_type`): transformers 5's
# names and the older ones it reads as them
MAMBA_TYPES, ATTENTION_TYPES = ("linear_attention", "mamba"), ("full_attention", "attention")
# Sane architectural limits of the mixer's sizes (as models/config.py's SIZE_LIMITS).
SIZE_LIMITS = {"mamba_n_heads": 2**14, "mamba_expand": 2**6, "mamba_n_groups": 2**14,
               "mamba_d_state": 2**14, "mamba_d_conv": 2**10, "mamba_chunk_size": 2**20,
               "linear_num_key_heads": 2**14, "linear_num_value_heads": 2**14,
               "linear_key_head_dim": 2**14, "linear_value_head_dim": 2**14,
               "linear_conv_kernel_dim": 2**10, "full_attention_interval": 2**20}
# The chunk of transformers' chunked gated delta rule (torch_chunk_gated_delta_rule's default)
DELTA_RULE_CHUNK = 64


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

    def layout(self, dtype: torch.dtype) -> MambaLayout:
        """A state slot of these layers: the conv's channels x, B and C, an SSM state of
        heads x head_dim x state_size."""
        return MambaLayout(len(self.layers), self.conv_dim, self.conv_kernel, self.num_heads,
                           self.head_dim, self.state_size, dtype)


@dataclass(frozen=True, slots=True)
class GatedDeltaNetConfig:
    """Qwen3-Next's Gated DeltaNet: `num_k_heads` query/key heads of `head_k_dim` channels,
    `num_v_heads` value heads of `head_v_dim` (each key head serving num_v_heads / num_k_heads
    of them), a causal depthwise convolution of width `conv_kernel` over q, k and v, and a
    recurrent state of head_k_dim x head_v_dim per value head; the prefill runs the delta rule
    in chunks of `chunk_size` tokens. `layers` are the model layers it is in."""

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    chunk_size: int = DELTA_RULE_CHUNK

    @property
    def key_dim(self) -> int:
        """Channels of q (and of k): key heads x head_k_dim."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Channels of v (and of the gate z): value heads x head_v_dim."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_size(self) -> int:
        """Outputs of in_proj_qkvz and in_proj_ba: q, k, v, the gate z, then b and a per
        value head."""
        return 2 * self.key_dim + 2 * self.value_dim + 2 * self.num_v_heads

    @property
    def activation_size(self) -> int:
        """Values per token a layer's forward holds at its peak: the projections' outputs,
        the conv's and the rule's."""
        return self.in_proj_size + self.conv_dim + self.value_dim

    def count_parameters(self, hidden_size: int) -> int:
        """Parameters of one layer: the two input projections, the depthwise conv (no bias),
        dt_bias and A_log per value head, the gated norm (one head's), out_proj."""
        return (hidden_size * self.in_proj_size + self.conv_dim * self.conv_kernel
                + 2 * self.num_v_heads + self.head_v_dim + self.value_dim * hidden_size)

    def per_rank(self, size: int) -> GatedDeltaNetConfig:
        """The layer one of `size` tensor-parallel ranks holds: all of it, on one rank only
        (ConfigError for more)."""
        if size != 1:
            raise ConfigError(f"Gated DeltaNet layers run on one rank; tensor parallelism "
                              f"over {size} ranks is not supported")
        return self

    def layout(self, dtype: torch.dtype) -> MambaLayout:
        """A state slot of these layers: the conv's channels q, k and v, a recurrent state of
        value heads x head_k_dim x head_v_dim."""
        return MambaLayout(len(self.layers), self.conv_dim, self.conv_kernel, self.num_v_heads,
                           self.head_k_dim, self.head_v_dim, dtype)


def parse_bamba(cfg: dict, hidden_size: int, num_layers: int) -> MambaConfig:
    """The Mamba layers of a Bamba config: every layer not in `attn_layer_indices`."""
    attention = cfg.get("attn_layer_indices") or []
    if not isinstance(attention, list) or not all(
            _is_int(i) and 0 <= i < num_layers for i in attention):
        raise ConfigError(f"config 'attn_layer_indices' must list layer indices in "
                          f"[0, {num_layers}), got {attention!r}")
    layers = tuple(i for i in range(num_layers) if i not in attention)
    return _mixer(cfg, hidden_size, _mixed("Bamba", "attn_layer_indices", layers, num_layers))


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
    return _mixer(cfg, hidden_size, _mixed("GraniteMoeHybrid", "layer_types", layers, num_layers))


def _mixed(family: str, field: str, layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """`layers`, the state layers `field` names among a hybrid's `num_layers`; ConfigError
    where that leaves no attention layer or no state layer: kvpool runs a hybrid of both."""
    if not layers or len(layers) == num_layers:
        raise ConfigError(f"a {family} config whose {field} leaves no "
                          f"{'state' if not layers else 'attention'} layer of its {num_layers}: "
                          f"kvpool runs hybrids of attention and state layers only")
    return layers


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


def parse_qwen3_next(cfg: dict, hidden_size: int, num_layers: int) -> GatedDeltaNetConfig:
    """The Gated DeltaNet layers of a Qwen3-Next config: those its `layer_types` name
    `linear_attention` (the others `full_attention`), by default all but every
    `full_attention_interval`-th (4), as transformers reads it; transformers' sizes where the
    config leaves them out."""
    types = cfg.get("layer_types")
    if not types:  # transformers reads the interval only then
        interval = _int(cfg, "full_attention_interval", 4)
        types = [ATTENTION_TYPES[0] if (i + 1) % interval == 0 else MAMBA_TYPES[0]
                 for i in range(num_layers)]
    if not (isinstance(types, list) and len(types) == num_layers
            and all(t in (MAMBA_TYPES[0], ATTENTION_TYPES[0]) for t in types)):
        raise ConfigError(f"config 'layer_types' must list linear_attention or full_attention "
                          f"for each of the {num_layers} layers, got {types!r}")
    layers = _mixed("Qwen3-Next", "layer_types", tuple(
        i for i, t in enumerate(types) if t == MAMBA_TYPES[0]), num_layers)
    k_heads = _int(cfg, "linear_num_key_heads", 16)
    v_heads = _int(cfg, "linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise ConfigError(f"linear_num_key_heads={k_heads} does not divide "
                          f"linear_num_value_heads={v_heads}")
    kernel = _int(cfg, "linear_conv_kernel_dim", 4)
    if kernel < 2:
        raise ConfigError(f"linear_conv_kernel_dim={kernel} is not supported: kvpool keeps "
                          f"the conv's last inputs, at least 1 (a kernel of 2 or more)")
    return GatedDeltaNetConfig(
        layers=layers, num_k_heads=k_heads, num_v_heads=v_heads,
        head_k_dim=_int(cfg, "linear_key_head_dim", 128),
        head_v_dim=_int(cfg, "linear_value_head_dim", 128), conv_kernel=kernel)


# The hybrid architectures -> the parser of their state layers
MAMBA_PARSERS = {"BambaForCausalLM": parse_bamba,
                 "GraniteMoeHybridForCausalLM": parse_granite_hybrid,
                 "Qwen3NextForCausalLM": parse_qwen3_next}
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
