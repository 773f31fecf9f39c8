"""GroupedPool: what the attention layers of a model read, one KVPool per layer group; a
step's forward context holds one AttentionMetadata per group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool

if TYPE_CHECKING:  # a pool knows the metadata's type, not the attention code
    from kvpool.attention import AttentionMetadata


@dataclass(slots=True)
class GroupedPool:
    """The pools of a layout's layer groups (`pools[g]` holds the layers of `layout.groups[g]`
    in order) and, for each attention layer, where its K/V lie: `where[layer]` is (group,
    layer in that group's pool). One pool holds every layer in order, whatever the windows
    (a KVCache's pool: `GroupedPool(pool.layout, (pool,))`)."""

    layout: KVLayout
    pools: tuple[KVPool, ...]
    where: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        where = [(0, layer) for layer in range(self.layout.num_layers)]  # one pool: in order
        if len(self.pools) > 1:
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
        """Whether every group's pool has all its fp8 scales (KVPool.scales_ready)."""
        return all(pool.scales_ready for pool in self.pools)

    @property
    def nbytes(self) -> int:
        """Bytes of all the groups' pools."""
        return sum(pool.nbytes for pool in self.pools)

    @contextmanager
    def calibration_paused(self) -> Iterator[None]:
        """KVPool.calibration_paused for every group's pool."""
        with ExitStack() as stack:
            for pool in self.pools:
                stack.enter_context(pool.calibration_paused())
            yield

    def locate(self, layer: int, attention: tuple[AttentionMetadata, ...]
               ) -> tuple[KVPool, int, AttentionMetadata]:
        """(pool, pool layer, metadata) of attention layer `layer` in a step whose groups'
        metadata is `attention` (in group order)."""
        group, pool_layer = self.where[layer]
        return self.pools[group], pool_layer, attention[group]
