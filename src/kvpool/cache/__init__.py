"""The cache: what the engine asks for memory. `SequenceCache` is the protocol the scheduler,
the runner and LLM use; `KVCache` (the coordinator) is its one implementation, driving one
manager per layer group, each of one group type: `FullAttention` and `SlidingWindow` pages,
`MambaState` slots and checkpoints. Beside them: the prefix index (`prefix_cache`), token
packing (`tokens`) and the tiers below device memory (`tiers`, `redis_tier`).

May import: memory and kvpool's shared modules (errors, numeric, devices, threads, formats);
nothing of the engine or the models."""

from kvpool.cache.coordinator import KVCache, group_layout
from kvpool.cache.group import CacheStats, GroupManager, Plan
from kvpool.cache.pages import HOLE, FullAttention, SlidingWindow
from kvpool.cache.protocol import SequenceCache
from kvpool.cache.state import MambaState, StateSpec

__all__ = ["HOLE", "CacheStats", "FullAttention", "GroupManager", "KVCache", "MambaState",
           "Plan", "SequenceCache", "SlidingWindow", "StateSpec", "group_layout"]
