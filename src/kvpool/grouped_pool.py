"""What the attention layers of a model with several layer groups read: one KVPool per group
(GroupedPool, with the model layer -> (group, pool layer) map) and one AttentionMetadata per
group for a step (GroupedMetadata: each group has its own page tables and slot mapping)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpool.attention import AttentionMetadata
from kvpool.layout import KVLayout
from kvpool.pool import KVPool


@dataclass(frozen=True, slots=True)
class GroupedMetadata:
    """One step's AttentionMetadata per layer group, in the layout's group order; seq_lens
    and cu_seqlens_q are the same tensors in every group."""

    groups: tuple[AttentionMetadata, ...]

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        """The query offsets `[batch + 1]` int32 (every group's)."""
        return self.groups[0].cu_seqlens_q


@dataclass(slots=True)
class GroupedPool:
    """The pools of a layout's layer groups (`pools[g]` holds the layers of `layout.groups[g]`
    in order) and, for each model layer, where its K/V lie: `where[layer]` is (group, layer
    in that group's pool)."""

    layout: KVLayout
    pools: tuple[KVPool, ...]
    where: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        where = [(0, 0)] * self.layout.num_layers
        for g, group in enumerate(self.layout.groups):
            for i, layer in enumerate(group.layers):
                where[layer] = (g, i)
        self.where = tuple(where)

    @property
    def quantized(self) -> bool:
        """Whether the pages hold fp8 values (every group alike)."""
        return self.pools[0].quantized

    @property
    def scales_ready(self) -> bool:
        """Whether every layer of every group has its fp8 scales (True when not fp8)."""
        return all(pool.scales_ready for pool in self.pools)

    @property
    def nbytes(self) -> int:
        """Bytes of all the groups' pools."""
        return sum(pool.nbytes for pool in self.pools)

    def locate(self, layer: int, meta: GroupedMetadata) -> tuple[KVPool, int, AttentionMetadata]:
        """(pool, pool layer, metadata) of model layer `layer` in this step."""
        group, pool_layer = self.where[layer]
        return self.pools[group], pool_layer, meta.groups[group]
