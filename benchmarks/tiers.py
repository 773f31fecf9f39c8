"""Tiers below the pool: how much prefill a host or disk tier saves when the device pool is
too small for the working set of shared prefixes, and what moving one page costs.

Workload: 200 prompts cycling over 40 system prompts of 256 tokens, each followed by its own
32-token question; a pool of 128 pages of 16 tokens, while the 40 system prompts alone need
640. Each prompt is added, committed and freed, as a finished request would be.
Baseline: no tier, where an evicted page is lost (and LRU over a cycle longer than the pool
hits nothing). Page geometry of TinyLlama-1.1B: 22 layers, 4 KV heads, head_dim 64, fp16,
352 KiB per page. Times are the tier's own `put` / `get` per page moved, in microseconds
(the pool's gather and scatter of the same pages are not included).

    python benchmarks/tiers.py
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.cache import KVCache
from kvpool.layout import KVLayout
from kvpool.tiers import DiskTier, HostTier, Tier, page_namespace

LAYOUT = KVLayout(num_layers=22, num_kv_heads=4, head_dim=64, dtype=torch.float16,
                  page_size=16)
NUM_PAGES = 128
TIER_PAGES = 2048
NUM_PROMPTS = 200
NUM_SYSTEMS = 40
SYSTEM_TOKENS = 256
QUESTION_TOKENS = 32


@dataclass(slots=True)
class Run:
    """One pass of the workload: token counts, pages moved, and time spent moving them."""

    query_tokens: int = 0
    recomputed_tokens: int = 0  # prompt tokens whose KV was not served by a cache
    tier_loads: int = 0  # pages
    tier_stores: int = 0  # pages
    put_seconds: float = 0.0
    get_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache or the tier."""
        return 1 - self.recomputed_tokens / self.query_tokens

    @property
    def put_us(self) -> float:
        """Microseconds per page stored into the tier."""
        return self.put_seconds / self.tier_stores * 1e6 if self.tier_stores else 0.0

    @property
    def get_us(self) -> float:
        """Microseconds per page loaded from the tier (the one miss that ends each
        prompt's lookup included)."""
        return self.get_seconds / self.tier_loads * 1e6 if self.tier_loads else 0.0


def workload(seed: int = 0) -> list[list[int]]:
    """`NUM_PROMPTS` prompts: system prompt i % NUM_SYSTEMS, then a question of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(SYSTEM_TOKENS)]
               for _ in range(NUM_SYSTEMS)]
    return [systems[i % NUM_SYSTEMS] + [rng.randrange(32000) for _ in range(QUESTION_TOKENS)]
            for i in range(NUM_PROMPTS)]


def timed(run: Run, tier: Tier) -> None:
    """Make `tier` add the time spent in its `put` and `get` to `run`."""
    put, get = tier.put, tier.get

    def timed_put(key, data):
        t0 = time.perf_counter()
        put(key, data)
        run.put_seconds += time.perf_counter() - t0

    def timed_get(key):
        t0 = time.perf_counter()
        data = get(key)
        run.get_seconds += time.perf_counter() - t0
        return data

    tier.put, tier.get = timed_put, timed_get


def primed_host_tier() -> HostTier:
    """A HostTier whose store (allocated and zeroed when it is bound, once) already exists,
    so the timed run measures steady-state puts; prints what the allocation took."""
    tier = HostTier(TIER_PAGES)
    t0 = time.perf_counter()
    tier.bind(page_namespace(LAYOUT), (LAYOUT.num_layers, 2, LAYOUT.page_size,
                                       LAYOUT.num_kv_heads, LAYOUT.head_dim), LAYOUT.dtype)
    seconds = time.perf_counter() - t0
    print(f"HostTier store: {tier.nbytes / 2**20:.0f} MiB allocated once in {seconds * 1e3:.0f} ms")
    return tier


def serve(prompts: list[list[int]], tier: Tier | None) -> Run:
    """Add, commit and free each prompt in turn; count what had to be recomputed."""
    run = Run()
    if tier is not None:
        timed(run, tier)
    cache = KVCache(LAYOUT, NUM_PAGES, device="cpu", prefix_caching=True, tier=tier)
    for i, prompt in enumerate(prompts):
        hit = cache.add_sequence(i, prompt)
        run.query_tokens += len(prompt)
        run.recomputed_tokens += len(prompt) - hit
        cache.commit(i)
        cache.free_sequence(i)
    cache.check()
    stats = cache.stats()
    run.tier_loads, run.tier_stores = stats.num_tier_loads, stats.num_tier_stores
    return run


def main() -> None:
    torch.set_num_threads(1)
    prompts = workload()
    with tempfile.TemporaryDirectory() as directory:
        cases: list[tuple[str, Callable[[], Tier | None]]] = [
            ("no tier (baseline)", lambda: None),
            (f"HostTier({TIER_PAGES})", primed_host_tier),
            (f"DiskTier({TIER_PAGES})", lambda: DiskTier(directory, TIER_PAGES)),
        ]
        runs = [(name, serve(prompts, make())) for name, make in cases]
    page_kib = LAYOUT.bytes_per_page / 1024
    print(f"{NUM_PROMPTS} prompts over {NUM_SYSTEMS} system prompts of {SYSTEM_TOKENS} tokens "
          f"+ {QUESTION_TOKENS}-token questions; pool {NUM_PAGES} pages of "
          f"{LAYOUT.page_size} tokens; page {page_kib:.0f} KiB")
    print(f"{'case':<20} {'hit rate':>8} {'recomputed':>11} {'ratio':>6} {'loads':>6} "
          f"{'stores':>7} {'put us/page':>12} {'get us/page':>12}")
    baseline = runs[0][1].recomputed_tokens
    for name, r in runs:
        print(f"{name:<20} {r.hit_rate:>8.1%} {r.recomputed_tokens:>11} "
              f"{r.recomputed_tokens / baseline:>6.2f} {r.tier_loads:>6} {r.tier_stores:>7} "
              f"{r.put_us:>12.1f} {r.get_us:>12.1f}")
    print("recomputed: prompt tokens whose KV must be computed (prefill); ratio: vs baseline")


if __name__ == "__main__":
    main()
