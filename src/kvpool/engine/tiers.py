"""The tier an engine's evicted prefix pages move to (`host_tier_memory`, `disk_tier` or
`redis_tier` of `LLM`), and the fingerprint of the model (its config and weights) that, with
the layout, names what its stored pages are valid for."""

from __future__ import annotations

import hashlib
import itertools

import torch

from kvpool.cache.tiers import DiskTier, HostTier, Tier

SUM_CHUNK = 1 << 22  # weights summed at once (a float64 copy of 32 MiB on their device)


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
    """A string naming `model`'s architecture, config and weights, so that two engines share
    stored pages only when they run the same model: a hash of its config (`model.config`:
    RoPE, norms and activation shape the K it stores as much as the weights) and of every
    parameter's and buffer's (checkpoint values some models keep as buffers) name, shape,
    dtype and sums along each row and each column (of the tensor as a matrix of its first
    dimension's rows), in float64 on its device. Any changed weight moves two sums, short of
    changes made to cancel out; a model's weights are read once, a chunk at a time."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(model.config).encode())
    for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
        digest.update(f"{name} {tuple(p.shape)} {p.dtype}".encode())
        for sums in _row_and_column_sums(p.detach()):
            digest.update(sums.cpu().numpy().tobytes())
    return f"{type(model).__name__}@{digest.hexdigest()}"


def _row_and_column_sums(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 sums of each row and each column of `weight` as a matrix (one column
    for a vector: its values), reading SUM_CHUNK weights at a time."""
    matrix = weight.reshape(weight.shape[0], -1) if weight.dim() > 1 else weight.reshape(-1, 1)
    rows = max(1, SUM_CHUNK // max(matrix.shape[1], 1))
    row_sums = []
    column_sums = torch.zeros(matrix.shape[1], dtype=torch.float64, device=weight.device)
    for start in range(0, matrix.shape[0], rows):
        block = matrix[start:start + rows].to(torch.float64)
        row_sums.append(block.sum(dim=1))
        column_sums += block.sum(dim=0)
    return torch.cat(row_sums) if row_sums else column_sums[:0], column_sums


def tier_counters(cache) -> dict[str, int]:
    """The tier counters of EngineStats for `cache` (all zero without a tier)."""
    tier = cache.tier
    if tier is None:
        return {}
    cs, ts = cache.stats(), tier.stats()
    return {"num_tier_stores": cs.num_tier_stores, "num_tier_loads": cs.num_tier_loads,
            "num_tier_misses": ts.num_misses, "num_tier_dropped": ts.num_dropped}
