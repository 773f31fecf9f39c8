"""The tier an engine's evicted prefix pages move to (`host_tier_memory`, `disk_tier` or
`redis_tier` of `LLM`), and the fingerprint of the model's weights that, with the layout,
names what its stored pages are valid for."""

from __future__ import annotations

import hashlib

import torch

from kvpool.cache.tiers import DiskTier, HostTier, Tier

FINGERPRINT_SAMPLES = 4096  # values hashed per weight tensor, evenly spaced


def make_tier(config, bytes_per_page: int) -> Tier | None:
    """The tier `config` (an EngineConfig) asks for, sized in pages of `bytes_per_page`
    (every layer of one page), or None. ValueError if the memory holds no page."""
    if config.redis_tier is not None:
        from kvpool.cache.redis_tier import RedisTier

        return RedisTier(config.redis_tier)  # bounded by the server's maxmemory
    if config.host_tier_memory is not None:
        return HostTier(_pages("host_tier_memory", config.host_tier_memory, bytes_per_page))
    if config.disk_tier is not None:
        return DiskTier(config.disk_tier,
                        _pages("disk_tier_memory", config.disk_tier_memory, bytes_per_page))
    return None


def _pages(name: str, nbytes: int, bytes_per_page: int) -> int:
    if nbytes < bytes_per_page:
        raise ValueError(f"{name} of {nbytes:,} bytes holds no page of {bytes_per_page:,} bytes")
    return nbytes // bytes_per_page


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A string naming `model`'s architecture and weights: a hash of every
    parameter's name, shape, dtype and up to FINGERPRINT_SAMPLES of its values, so that two
    engines share stored pages only when they run the same weights."""
    digest = hashlib.blake2b(digest_size=16)
    for pname, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        sample = flat[::step][:FINGERPRINT_SAMPLES].cpu().contiguous()
        digest.update(f"{pname} {tuple(p.shape)} {p.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return f"{type(model).__name__}@{digest.hexdigest()}"


def tier_counters(cache) -> dict[str, int]:
    """The tier counters of EngineStats for `cache` (all zero without a tier)."""
    tier = cache.tier
    if tier is None:
        return {}
    cs, ts = cache.stats(), tier.stats()
    return {"num_tier_stores": cs.num_tier_stores, "num_tier_loads": cs.num_tier_loads,
            "num_tier_misses": ts.num_misses, "num_tier_dropped": ts.num_dropped}
