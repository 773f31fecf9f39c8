"""KVCache bookkeeping cost, in microseconds per operation (median of repeats).

(a) add a 256-token sequence + free it: prefix caching off; on with the same prompt each
    time (a hit of 15 pages, then commit); on with a new prompt each time (16 pages
    inserted, eviction once the pool is full). Baseline: the allocator alone taking and
    giving back the same 16 pages (the floor under any page-table bookkeeping).
(b) 10,000 prompts of 256 tokens: 50 system prompts of 64-192 tokens + unique tails.
    Per prompt: add_sequence (match, and evictions once the pool is full) + commit (insert),
    then free_sequence, timed apart; and the hit rate. Baseline: a plain dict keyed by every
    page-aligned prefix tuple (hashes O(n^2 / page_size) tokens).

    python benchmarks/cache.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from kvpool.allocator import PageAllocator
from kvpool.cache import KVCache
from kvpool.layout import KVLayout

PAGE_SIZE = 16
TOKENS = 256
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                  page_size=PAGE_SIZE)


def per_op_us(fn, ops: int, repeats: int = 7) -> float:
    """Median over repeats of the time of `fn()` (which runs `ops` operations), per op."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / ops * 1e6)
    return statistics.median(times)


def bench_add_free(n: int = 20_000) -> list[tuple[str, float]]:
    pages = TOKENS // PAGE_SIZE
    alloc = PageAllocator(4096)

    def floor():
        for _ in range(n):
            alloc.free(alloc.allocate(pages))

    off = KVCache(LAYOUT, 4096)

    def caching_off():
        for _ in range(n):
            off.add_sequence(0, num_tokens=TOKENS)
            off.free_sequence(0)

    same = KVCache(LAYOUT, 4096, prefix_caching=True)
    prompt = list(range(TOKENS))

    def caching_on_hit():
        for _ in range(n):
            same.add_sequence(0, prompt)
            same.commit(0)
            same.free_sequence(0)

    fresh = KVCache(LAYOUT, 4096, prefix_caching=True)
    counter = iter(range(10**9))

    def caching_on_miss():
        for _ in range(n):
            start = next(counter) * TOKENS
            fresh.add_sequence(0, range(start, start + TOKENS))
            fresh.commit(0)
            fresh.free_sequence(0)

    return [
        ("allocator only (floor)", per_op_us(floor, n)),
        ("caching off", per_op_us(caching_off, n)),
        ("caching on, same prompt (hit)", per_op_us(caching_on_hit, n)),
        ("caching on, new prompt (insert+evict)", per_op_us(caching_on_miss, n)),
    ]


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.randrange(64, 193))] for _ in range(50)]
    prompts = []
    for _ in range(n):
        system = rng.choice(systems)
        prompts.append(system + [rng.randrange(32000) for _ in range(TOKENS - len(system))])
    return prompts


def bench_shared_prefixes(prompts: list[list[int]]) -> dict[str, float]:
    """Microseconds per prompt (median of 3 runs over every prompt): match + insert
    (add_sequence + commit, evictions included), free_sequence, and the naive baseline."""
    clock = time.perf_counter
    runs = []
    for _ in range(3):
        cache = KVCache(LAYOUT, 16384, prefix_caching=True)
        add_s = free_s = 0.0
        for i, p in enumerate(prompts):
            t0 = clock()
            cache.add_sequence(i, p)
            cache.commit(i)
            t1 = clock()
            cache.free_sequence(i)
            add_s += t1 - t0
            free_s += clock() - t1
        cache.check()
        runs.append((add_s, free_s))
    n = len(prompts)
    result = {
        "match + insert": statistics.median(a for a, _ in runs) / n * 1e6,
        "free": statistics.median(f for _, f in runs) / n * 1e6,
        "hit rate": cache.stats().prefix_hit_rate,
        "evicted": cache.stats().num_evicted_pages,
    }

    def naive():
        seen: dict[tuple[int, ...], int] = {}
        for i, p in enumerate(prompts):
            limit = (len(p) - 1) // PAGE_SIZE
            k = 0
            while k < limit and tuple(p[:(k + 1) * PAGE_SIZE]) in seen:
                k += 1
            for j in range(k, len(p) // PAGE_SIZE):
                seen[tuple(p[:(j + 1) * PAGE_SIZE])] = i

    result["naive"] = per_op_us(naive, n, repeats=3)
    return result


def main() -> None:
    rows = bench_add_free()
    floor = rows[0][1]
    print(f"(a) add {TOKENS}-token sequence + free, page size {PAGE_SIZE} "
          "(targets: off <= 3 us, on <= 8 us)")
    print(f"{'case':<40} {'us/op':>8} {'x floor':>8}")
    for name, us in rows:
        print(f"{name:<40} {us:>8.2f} {us / floor:>8.2f}")
    prompts = shared_prefix_prompts(10_000)
    r = bench_shared_prefixes(prompts)
    print(f"\n(b) {len(prompts)} prompts of {TOKENS} tokens, 50 shared system prompts, "
          "16384 pages (target: match + insert <= 20 us)")
    print(f"{'case':<40} {'us/prompt':>10} {'ratio':>8}")
    print(f"{'naive prefix-tuple dict (baseline)':<40} {r['naive']:>10.2f} {1.0:>8.2f}")
    for name in ("match + insert", "free"):
        print(f"{'KVCache ' + name:<40} {r[name]:>10.2f} {r[name] / r['naive']:>8.2f}")
    print(f"hit rate {r['hit rate']:.1%}, evicted pages {r['evicted']}")

if __name__ == "__main__":
    main()
