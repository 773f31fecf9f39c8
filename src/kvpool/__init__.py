"""kvpool: paged KV-cache memory for LLM inference.

One pool of fixed-size pages allocated once, an allocator with reference counts, per-sequence
page tables with fork and copy-on-write, a radix-tree prefix cache with LRU eviction, paged
attention, Llama-family models on the paged cache, and an engine with continuous batching.

The public names are imported on first use, so that `import kvpool.allocator` (or the
cache alone) does not load the engine, the tokenizer library or the progress bar.
"""

from importlib import import_module

# OpenMP reads its wait policy when torch loads it, so this runs before anything imports torch.
from kvpool.threads import prefer_passive_wait

prefer_passive_wait()

_MODULE_OF = {
    "AllocatorStats": "kvpool.allocator",
    "PageAllocator": "kvpool.allocator",
    "CacheStats": "kvpool.cache",
    "KVCache": "kvpool.cache",
    "SequenceCache": "kvpool.cache",
    "StateSpec": "kvpool.cache",
    "LLM": "kvpool.engine",
    "DisaggregatedLLM": "kvpool.engine",
    "CompletionOutput": "kvpool.engine",
    "RequestOutput": "kvpool.engine",
    "SamplingParams": "kvpool.engine",
    "CheckpointError": "kvpool.errors",
    "ConfigError": "kvpool.errors",
    "DuplicateSequence": "kvpool.errors",
    "EngineDied": "kvpool.errors",
    "EngineStateError": "kvpool.errors",
    "InvalidPage": "kvpool.errors",
    "InvalidStateSlot": "kvpool.errors",
    "KVPoolError": "kvpool.errors",
    "OutOfMemory": "kvpool.errors",
    "OutOfPages": "kvpool.errors",
    "OutOfStateSlots": "kvpool.errors",
    "RankFailed": "kvpool.errors",
    "SequenceTooLong": "kvpool.errors",
    "UnknownSequence": "kvpool.errors",
    "KVLayout": "kvpool.layout",
    "LayerGroup": "kvpool.layout",
    "MemoryPlan": "kvpool.planner",
    "plan_memory": "kvpool.planner",
    "KVPool": "kvpool.pool",
    "PrefixCache": "kvpool.prefix_cache",
    "RedisTier": "kvpool.redis_tier",
    "MambaLayout": "kvpool.state_pool",
    "MambaPool": "kvpool.state_pool",
    "DiskTier": "kvpool.tiers",
    "HostTier": "kvpool.tiers",
    "Tier": "kvpool.tiers",
}

__all__ = sorted(_MODULE_OF)
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])
