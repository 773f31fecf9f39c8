"""kvpool: paged KV-cache memory for LLM inference.

One pool of fixed-size pages allocated once, an allocator with reference counts, per-sequence
page tables with fork and copy-on-write, a radix-tree prefix cache with LRU eviction, paged
attention, Llama-family models on the paged cache, and an engine with continuous batching.

The public names are imported on first use, so that `import kvpool.memory.allocator` (or the
cache alone) does not load the engine, the tokenizer library or the progress bar.
"""

from importlib import import_module

# OpenMP reads its wait policy when torch loads it, so this runs before anything imports torch.
from kvpool.threads import prefer_passive_wait

prefer_passive_wait()

_MODULE_OF = {
    "AllocatorStats": "kvpool.memory.allocator",
    "PageAllocator": "kvpool.memory.allocator",
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
    "InvalidPrompt": "kvpool.errors",
    "InvalidStateSlot": "kvpool.errors",
    "KVPoolError": "kvpool.errors",
    "OutOfMemory": "kvpool.errors",
    "OutOfPages": "kvpool.errors",
    "OutOfStateSlots": "kvpool.errors",
    "RankFailed": "kvpool.errors",
    "SequenceTooLong": "kvpool.errors",
    "ServerFailed": "kvpool.errors",
    "StepFailed": "kvpool.errors",
    "UnknownSequence": "kvpool.errors",
    "WorkspaceFull": "kvpool.memory.workspace",
    "KVLayout": "kvpool.memory.layout",
    "LayerGroup": "kvpool.memory.layout",
    "MemoryPlan": "kvpool.planning.planner",
    "plan_memory": "kvpool.planning.planner",
    "KVPool": "kvpool.memory.pool",
    "PrefixCache": "kvpool.cache.prefix_cache",
    "RedisTier": "kvpool.cache.redis_tier",
    "MambaLayout": "kvpool.memory.state_pool",
    "MambaPool": "kvpool.memory.state_pool",
    "DiskTier": "kvpool.cache.tiers",
    "HostTier": "kvpool.cache.tiers",
    "Tier": "kvpool.cache.tiers",
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
