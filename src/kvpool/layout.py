"""KV-cache geometry: bytes per token and per page of a paged KV cache. How many pages fit
on a device is the planner's question (kvpool.planner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of the paged KV cache: for every token, K and V of `num_kv_heads` heads of
    `head_dim` elements of `dtype` in each of `num_layers` layers; pages of `page_size` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            check_int(name, getattr(self, name), minimum=1)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: `page_size` tokens."""
        return self.page_size * self.bytes_per_token

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens (a partly filled last page counts whole)."""
        check_int("num_tokens", num_tokens, minimum=0)
        return -(-num_tokens // self.page_size)


def __getattr__(name: str):
    # MemoryPlan and plan_memory live in kvpool.planner; the package's __init__ still imports
    # them from here. Resolved on first use so that this bottom layer imports no model code.
    if name in ("MemoryPlan", "plan_memory"):
        from kvpool import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_int(name: str, value: object, *, minimum: int) -> None:
    """Raise TypeError unless `value` is an int (not a bool), ValueError if below `minimum`."""
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value}")
