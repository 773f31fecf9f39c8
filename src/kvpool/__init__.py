"""kvpool: paged KV-cache memory for LLM inference.

One pool of fixed-size pages allocated once, an allocator with reference counts, per-sequence
page tables with fork and copy-on-write, a radix-tree prefix cache with LRU eviction, paged
attention, Llama-family models on the paged cache, and an engine with continuous batching.
"""

# OpenMP reads its wait policy when torch loads it, so this runs before the imports below.
from kvpool.threads import limit_threads, prefer_passive_wait

prefer_passive_wait()

from kvpool.allocator import AllocatorStats, PageAllocator
from kvpool.cache import CacheStats, KVCache
from kvpool.engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from kvpool.errors import (
    CheckpointError,
    ConfigError,
    DuplicateSequence,
    InvalidPage,
    KVPoolError,
    OutOfPages,
    SequenceTooLong,
    UnknownSequence,
)
from kvpool.layout import KVLayout, MemoryPlan, plan_memory
from kvpool.pool import KVPool
from kvpool.prefix_cache import PrefixCache
from kvpool.tiers import DiskTier, HostTier, Tier

__all__ = [
    "LLM",
    "AllocatorStats",
    "CacheStats",
    "CheckpointError",
    "CompletionOutput",
    "ConfigError",
    "DiskTier",
    "DuplicateSequence",
    "HostTier",
    "InvalidPage",
    "KVCache",
    "KVLayout",
    "KVPool",
    "KVPoolError",
    "MemoryPlan",
    "OutOfPages",
    "PageAllocator",
    "PrefixCache",
    "RequestOutput",
    "SamplingParams",
    "SequenceTooLong",
    "Tier",
    "UnknownSequence",
    "plan_memory",
]
__version__ = "0.1.0"

limit_threads()
