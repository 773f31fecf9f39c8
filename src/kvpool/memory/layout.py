"""KV-cache geometry: bytes per token and per page of a paged KV cache. How many pages fit
on a device is the planner's question (kvpool.planning.planner)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvpool.errors import check_int
from kvpool.memory.fp8 import FP8_DTYPE
from kvpool.numeric import check_int64

KINDS = ("mha", "mla")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers of a KVLayout that attend alike: `window` tokens back (None: the whole
    context); `bytes_per_token` is what one token stores in these layers."""

    window: int | None
    layers: tuple[int, ...]
    bytes_per_token: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of the paged KV cache: per token, in each of `num_layers` layers and each
    plane, `num_kv_heads` heads of `head_dim` elements of `dtype`; pages of `page_size` tokens.
    `kind` "mha" stores two planes, K and V; "mla" (DeepSeek's latent attention) one latent
    per token and layer (`num_kv_heads` 1, `head_dim` kv_lora_rank + qk_rope_head_dim), the
    key, whose first kv_lora_rank values are the value. float8_e4m3fn pages have scales
    (kvpool.memory.fp8). `layer_windows`: each layer's sliding window in tokens (None: full
    attention), or empty when no layer has one."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 16
    kind: str = "mha"
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            check_int64(name, getattr(self, name), 1)  # tensor shapes are int64
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        if self.dtype.itemsize == 1 and self.dtype != FP8_DTYPE:
            raise TypeError(f"the only 8-bit KV dtype is {FP8_DTYPE}, got {self.dtype}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an mla layout stores one latent per token and layer: "
                             f"num_kv_heads must be 1, got {self.num_kv_heads}")
        if not isinstance(self.layer_windows, tuple):
            raise TypeError(f"layer_windows must be a tuple, got {self.layer_windows!r}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows names {len(self.layer_windows)} layers, the "
                             f"layout has {self.num_layers}")
        for window in self.layer_windows:
            if window is not None:
                check_int64("layer_windows[i]", window, 1)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layers gathered by window: full attention first, then windows from the
        smallest; each with its bytes per token (K and V, or the latent, of its layers)."""
        windows = self.layer_windows or (None,) * self.num_layers
        order = sorted(set(windows), key=lambda w: -1 if w is None else w)
        per_layer = self.bytes_per_token // self.num_layers
        layers = [tuple(i for i, w in enumerate(windows) if w == window) for window in order]
        return tuple(LayerGroup(window, group, per_layer * len(group))
                     for window, group in zip(order, layers, strict=True))

    @property
    def num_planes(self) -> int:
        """Vectors stored per token, layer and KV head: 2 (K and V) for mha, 1 for mla."""
        return 1 if self.kind == "mla" else 2

    def per_rank(self, tensor_parallel_size: int) -> KVLayout:
        """The layout of one tensor-parallel rank's pool: its share of the KV heads, or one
        head when there are fewer heads than ranks (each replicated on several; an MLA latent
        is whole on every rank). ValueError when the heads do not split evenly."""
        ranks = check_int("tensor_parallel_size", tensor_parallel_size, 1)
        heads = self.num_kv_heads
        if (heads % ranks if heads >= ranks else ranks % heads) and self.kind == "mha":
            raise ValueError(f"{heads} KV heads do not split evenly across {ranks} "
                             f"tensor-parallel ranks")
        return replace(self, num_kv_heads=max(1, heads // ranks))

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's KV over all layers: K and V (mha), or the latent (mla)."""
        return (self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: `page_size` tokens."""
        return self.page_size * self.bytes_per_token

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens (a partly filled last page counts whole)."""
        check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.page_size)
