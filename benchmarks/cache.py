"""KVCache bookkeeping cost, in microseconds per request (median of repeats).

Every prompt reaches the cache as a fresh list of fresh int objects, as a tokenizer returns
it, made outside the timed region: serving one list over and over would let list
comparisons stop at object identity, which real requests never allow. Times are net of the
timer's own cost (an empty request, measured in the same run).

(a) add a 256-token sequence + free it: prefix caching off; on with the same prompt each
    time (a hit of 15 pages, then commit); on with a new prompt each time (16 pages
    inserted, eviction once the pool is full). Baseline: the allocator alone taking and
    giving back the same 16 pages (the floor under any page-table bookkeeping).
(b) 10,000 prompts of 256 tokens: 50 system prompts of 64-192 tokens + unique tails.
    Per prompt: add_sequence (match, and evictions once the pool is full) + commit (insert),
    then free_sequence, timed apart; and the hit rate. Once with a pool of 16384 pages (about
    6.5 pages evicted per prompt once it is full), once with a pool that holds every prompt
    (no eviction). Baseline: a plain dict keyed by every page-aligned prefix tuple (hashes
    O(n^2 / page_size) tokens).
(c) A large prefix cache: 6,250 unique 256-token prompts committed (100,000 cached pages,
    1.6 M tokens). The Python heap it holds (tracemalloc) and the references a full garbage
    collection follows through its objects (both exact; timing a collection is too noisy next
    to the ~40 ms one takes with torch loaded). Baseline: the same token ids kept as lists of
    ints, as a tree over lists holds them.
(d) Eviction as the cache grows: add_sequence taking 16 pages from a pool of 1,000, 11,000
    or 100,000 pages that are all cached one-page leaves of the prefix cache, so that it
    evicts 16 and the tree drops them before it returns (the index cleanup included),
    refilled between calls outside the timed region. Baseline: the same call on a pool of
    free pages. Target: at most 4x.
(e) Growing a batch of 64 running sequences (100 tokens each to start) with known token
    ids: a decode step (1 token each) and a prefill chunk (37 tokens each), at page sizes 16
    and 1. `append_batch` over the batch against the baseline, one `append` per sequence;
    microseconds per step, median of interleaved rounds of 20 steps.
(f) A steady stream of fresh prompts, a round being 16 one-page prompts and one of 256 tokens,
    each added, committed and freed: through a pool of 1,000 pages all cached, where every
    page taken is an eviction, and (the baseline) through a pool that holds the whole stream
    and never evicts. Median microseconds per round over interleaved rounds. Target: at most
    1.5x.

    python benchmarks/cache.py
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import struct
import time
import tracemalloc
from collections.abc import Callable

import torch

from kvpool.cache import CacheStats, KVCache
from kvpool.memory.allocator import PageAllocator
from kvpool.memory.layout import KVLayout

PAGE_SIZE = 16
TOKENS = 256
VOCAB = 32000
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                  page_size=PAGE_SIZE)
_PROMPT = struct.Struct(f"<{TOKENS}i")

Serve = Callable[[int, "list[int] | None"], None]


def tokenizer_output(packed: bytes | None) -> list[int] | None:
    """A fresh list of fresh int objects holding a prompt kept packed between requests."""
    return None if packed is None else list(_PROMPT.unpack(packed))


def pass_us(serve: Serve, prompts: list[bytes | None]) -> float:
    """Mean microseconds of `serve(i, prompt)` over `prompts`, each unpacked to a fresh list
    outside the timed region."""
    clock = time.perf_counter_ns
    total = 0
    for i, packed in enumerate(prompts):
        prompt = tokenizer_output(packed)
        t0 = clock()
        serve(i, prompt)
        total += clock() - t0
    return total / len(prompts) / 1e3


def interleaved_us(cases: list[tuple[Callable[[], Serve], list[bytes | None]]],
                   repeats: int) -> list[float]:
    """Each case's median pass time over `repeats` rounds. A round runs every case once, in
    turn, so changes in the machine's speed reach all cases alike. A case is (make_serve,
    prompts): each pass serves `prompts` with a fresh `make_serve()`."""
    samples: list[list[float]] = [[] for _ in cases]
    for _ in range(repeats):
        for times, (make_serve, prompts) in zip(samples, cases, strict=True):
            times.append(pass_us(make_serve(), prompts))
    return [statistics.median(times) for times in samples]


def random_prompts(n: int, rng: random.Random) -> list[bytes]:
    return [_PROMPT.pack(*(rng.randrange(VOCAB) for _ in range(TOKENS))) for _ in range(n)]


def serve_prompts(cache: KVCache) -> Serve:
    def serve(i, prompt):
        cache.add_sequence(0, prompt)
        cache.commit(0)
        cache.free_sequence(0)
    return serve


def no_op(i, prompt):
    """An empty request: what timing one costs."""


def bench_add_free(n: int = 5_000, repeats: int = 15) -> tuple[list[tuple[str, float]], float]:
    """(case, microseconds per request) rows net of the timer's cost, and that cost."""
    pages = TOKENS // PAGE_SIZE
    alloc = PageAllocator(4096)
    off = KVCache(LAYOUT, 4096, device="cpu")
    same = KVCache(LAYOUT, 4096, device="cpu", prefix_caching=True)
    fresh = KVCache(LAYOUT, 4096, device="cpu", prefix_caching=True)  # holds 256 prompts: all miss
    rng = random.Random(0)
    hit_prompt = random_prompts(1, rng)
    serve_prompts(same)(0, tokenizer_output(hit_prompt[0]))  # cached from now on

    def floor(i, _):
        alloc.free(alloc.allocate(pages))

    def caching_off(i, _):
        off.add_sequence(0, num_tokens=TOKENS)
        off.free_sequence(0)

    no_prompts: list[bytes | None] = [None] * n
    overhead, *times = interleaved_us([
        (lambda: no_op, no_prompts),
        (lambda: floor, no_prompts),
        (lambda: caching_off, no_prompts),
        (lambda: serve_prompts(same), hit_prompt * n),
        (lambda: serve_prompts(fresh), random_prompts(n, rng)),
    ], repeats)
    names = ["allocator only (floor)", "caching off", "caching on, same prompt (hit)",
             "caching on, new prompt (insert+evict)"]
    return [(name, us - overhead) for name, us in zip(names, times, strict=True)], overhead


def shared_prefix_prompts(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(64, 193))] for _ in range(50)]
    prompts = []
    for _ in range(n):
        system = rng.choice(systems)
        tail = [rng.randrange(VOCAB) for _ in range(TOKENS - len(system))]
        prompts.append(_PROMPT.pack(*system, *tail))
    return prompts


def kvcache_pass(prompts: list[bytes], num_pages: int) -> tuple[float, float, CacheStats]:
    """One pass of a new KVCache over `prompts`: microseconds per prompt of match + insert
    (add_sequence + commit, evictions included) and of free_sequence, and the cache's stats
    (the cache itself is dropped, so that later passes do not pay for collecting it)."""
    clock = time.perf_counter_ns
    cache = KVCache(LAYOUT, num_pages, device="cpu", prefix_caching=True)
    add_ns = free_ns = 0
    for i, packed in enumerate(prompts):
        prompt = tokenizer_output(packed)
        t0 = clock()
        cache.add_sequence(i, prompt)
        cache.commit(i)
        t1 = clock()
        cache.free_sequence(i)
        add_ns += t1 - t0
        free_ns += clock() - t1
    cache.check()
    return add_ns / len(prompts) / 1e3, free_ns / len(prompts) / 1e3, cache.stats()


def naive_serve() -> Serve:
    """The baseline: a dict keyed by every page-aligned prefix tuple."""
    seen: dict[tuple[int, ...], int] = {}

    def serve(i, p):
        limit = (len(p) - 1) // PAGE_SIZE
        k = 0
        while k < limit and tuple(p[:(k + 1) * PAGE_SIZE]) in seen:
            k += 1
        for j in range(k, len(p) // PAGE_SIZE):
            seen[tuple(p[:(j + 1) * PAGE_SIZE])] = i
    return serve


def bench_shared_prefixes(prompts: list[bytes], pools: list[int],
                          runs: int = 5) -> tuple[float, list[tuple[float, float, CacheStats]]]:
    """Median over `runs` rounds (each round runs every case once, in turn) of the naive
    baseline's microseconds per prompt, and for each pool size the median match + insert and
    free times, net of the timer's cost, with the last round's cache stats."""
    rounds = []
    for _ in range(runs):
        overhead = pass_us(no_op, prompts)
        naive = pass_us(naive_serve(), prompts) - overhead
        rounds.append((naive, [kvcache_pass(prompts, n) for n in pools], overhead))
    naive = statistics.median(r[0] for r in rounds)
    results = []
    for j in range(len(pools)):
        add = statistics.median(r[1][j][0] - r[2] for r in rounds)
        free = statistics.median(r[1][j][1] - r[2] for r in rounds)
        results.append((add, free, rounds[-1][1][j][2]))
    return naive, results


def held_cost(build: Callable[[], object]) -> tuple[float, int]:
    """What `build()`'s result costs while held: MiB of Python heap, and references a full
    collection follows through its objects."""
    gc.collect()
    existing = {id(o) for o in gc.get_objects()}
    tracemalloc.start()
    held = build()
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    refs = sum(len(gc.get_referents(o)) for o in gc.get_objects() if id(o) not in existing)
    del held
    return heap, refs


def bench_large_cache(num_prompts: int = 6_250) -> list[tuple[str, float, int]]:
    prompts = random_prompts(num_prompts, random.Random(1))

    def as_lists():
        return [tokenizer_output(p) for p in prompts]

    def as_kvcache():
        cache = KVCache(LAYOUT, num_prompts * TOKENS // PAGE_SIZE, device="cpu",
                        prefix_caching=True)
        for i, packed in enumerate(prompts):
            cache.add_sequence(i, tokenizer_output(packed))
            cache.commit(i)
            cache.free_sequence(i)
        return cache

    return [("token ids as lists of ints (baseline)", *held_cost(as_lists)),
            ("KVCache with prefix caching", *held_cost(as_kvcache))]


def one_page_prompts(cache: KVCache, first: int, n: int) -> int:
    """Add, commit and free `n` fresh one-page prompts (ids from `first * PAGE_SIZE` on), each
    a new leaf of `cache`'s prefix cache; returns the next unused `first`."""
    page = struct.Struct(f"<{PAGE_SIZE}i")
    for i in range(first, first + n):
        start = i * PAGE_SIZE
        cache.add_sequence(0, list(page.unpack(page.pack(*range(start, start + PAGE_SIZE)))))
        cache.commit(0)
        cache.free_sequence(0)
    return first + n


def bench_eviction(cached: int, calls: int = 2_000, k: int = 16) -> tuple[float, float]:
    """Median microseconds of `add_sequence` taking `k` pages (of unknown content): from a
    pool of `cached` pages that are all cached one-page leaves, so that it evicts `k` of them
    and the prefix cache drops them, and, the baseline, from a pool of free pages. Calls
    alternate between the two; freeing and re-caching happen outside the timed region."""
    cache = KVCache(LAYOUT, cached, device="cpu", prefix_caching=True)
    fresh = KVCache(LAYOUT, cached, device="cpu", prefix_caching=True)
    first = one_page_prompts(cache, 0, cached)
    assert cache.stats().num_cached_pages == cached
    clock = time.perf_counter_ns
    evict_ns, fresh_ns = [], []
    for _ in range(calls):
        for target, times in ((cache, evict_ns), (fresh, fresh_ns)):
            t0 = clock()
            target.add_sequence(1, num_tokens=k * PAGE_SIZE)
            times.append(clock() - t0)
            target.free_sequence(1)
        first = one_page_prompts(cache, first, k)
    assert cache.stats().num_evicted_pages == calls * k
    assert cache.prefix_cache.num_pages == cached
    cache.check()
    return statistics.median(evict_ns) / 1e3, statistics.median(fresh_ns) / 1e3


def bench_stream(rounds: int = 400, cached: int = 1_000, k: int = 16) -> tuple[float, float]:
    """Median microseconds per round of the stream of (f): through a pool of `cached` pages
    all cached (every page taken evicted), and through a pool that never evicts."""
    rng = random.Random(3)
    long_prompts = random_prompts(2 * rounds, rng)
    evicting = KVCache(LAYOUT, cached, device="cpu", prefix_caching=True)
    roomy = KVCache(LAYOUT, rounds * (k + TOKENS // PAGE_SIZE), device="cpu",
                    prefix_caching=True)
    first = one_page_prompts(evicting, 10**6, cached)  # ids no prompt of the stream uses
    assert evicting.stats().num_cached_pages == cached
    clock = time.perf_counter_ns
    samples: dict[KVCache, list[float]] = {evicting: [], roomy: []}
    page = struct.Struct(f"<{PAGE_SIZE}i")
    for r in range(rounds):
        for j, cache in enumerate(samples):
            short = [list(page.unpack(page.pack(*range(i * PAGE_SIZE, (i + 1) * PAGE_SIZE))))
                     for i in range(first, first + k)]
            first += k
            long = tokenizer_output(long_prompts[2 * r + j])
            t0 = clock()
            for prompt in short + [long]:
                cache.add_sequence(0, prompt)
                cache.commit(0)
                cache.free_sequence(0)
            samples[cache].append((clock() - t0) / 1e3)
    assert evicting.stats().num_evicted_pages == rounds * (k + TOKENS // PAGE_SIZE)
    assert roomy.stats().num_evicted_pages == 0
    evicting.check()
    return statistics.median(samples[evicting]), statistics.median(samples[roomy])


def bench_batch_growth(page_size: int, step_tokens: int, batch: int = 64, steps: int = 20,
                       rounds: int = 15) -> tuple[float, float]:
    """Median microseconds per step of growing `batch` sequences by `step_tokens` tokens
    each: with one `append_batch`, and with one `append` per sequence (the baseline)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                      page_size=page_size)
    num_pages = batch * -(-(100 + steps * step_tokens) // page_size)
    rng = random.Random(2)
    new_ids = [[[rng.randrange(VOCAB) for _ in range(step_tokens)] for _ in range(batch)]
               for _ in range(steps)]
    seq_ids = list(range(batch))

    def batched(cache):
        for ids in new_ids:
            cache.append_batch(seq_ids, token_ids=ids)

    def one_by_one(cache):
        for ids in new_ids:
            for seq_id, tokens in zip(seq_ids, ids, strict=True):
                cache.append(seq_id, token_ids=tokens)

    clock = time.perf_counter_ns
    samples: dict[Callable, list[float]] = {batched: [], one_by_one: []}
    for _ in range(rounds):
        for grow, times in samples.items():
            cache = KVCache(layout, num_pages, device="cpu")
            for seq_id in seq_ids:
                cache.add_sequence(seq_id, [rng.randrange(VOCAB) for _ in range(100)])
            t0 = clock()
            grow(cache)
            times.append((clock() - t0) / steps / 1e3)
    return statistics.median(samples[batched]), statistics.median(samples[one_by_one])


def verdict(us: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"<= {target:g}: {'met' if us <= target else 'MISSED'}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows, overhead = bench_add_free()
    floor = rows[0][1]
    targets = [None, 3.0, 8.0, None]
    print(f"(a) add {TOKENS}-token sequence + free, page size {PAGE_SIZE}, median of 15 "
          f"interleaved rounds, net of {overhead:.2f} us timer cost")
    print(f"{'case':<40} {'us/op':>8} {'x floor':>8}  target (us)")
    for (name, us), target in zip(rows, targets, strict=True):
        print(f"{name:<40} {us:>8.2f} {us / floor:>8.2f}  {verdict(us, target)}".rstrip())
    prompts = shared_prefix_prompts(10_000)
    pools = [16384, len(prompts) * TOKENS // PAGE_SIZE]
    naive, results = bench_shared_prefixes(prompts, pools)
    print(f"\n(b) {len(prompts)} prompts of {TOKENS} tokens, 50 shared system prompts, "
          "median of 5 interleaved rounds, net of the timer cost")
    print(f"{'case':<48} {'us/prompt':>10} {'ratio':>7}  target (us)")
    print(f"{'naive prefix-tuple dict (baseline)':<48} {naive:>10.2f} {1.0:>7.2f}")
    for label, (add, free, stats) in zip(["16384 pages", "pool holds all"], results,
                                         strict=True):
        for name, us, target in (("match + insert", add, 20.0), ("free", free, None)):
            print(f"{f'KVCache {name}, {label}':<48} {us:>10.2f} {us / naive:>7.2f}  "
                  f"{verdict(us, target)}".rstrip())
        print(f"  hit rate {stats.prefix_hit_rate:.1%}, evicted pages {stats.num_evicted_pages:,}")
    rows = bench_large_cache()
    print(f"\n(c) 6,250 unique {TOKENS}-token prompts cached: 100,000 pages, 1.6 M tokens")
    print(f"{'what holds them':<40} {'heap MiB':>9} {'ratio':>6} {'gc refs':>10} {'ratio':>6}")
    base_heap, base_refs = rows[0][1], rows[0][2]
    for name, heap, refs in rows:
        print(f"{name:<40} {heap:>9.1f} {heap / base_heap:>6.2f} {refs:>10,} "
              f"{refs / base_refs:>6.2f}")
    print("\n(d) add_sequence taking 16 pages: evicting 16 cached one-page leaves (the prefix "
          "cache drops them too) vs taking 16 free ones, median us per call")
    print(f"{'cached':>8} {'free pages':>11} {'evicting':>9} {'ratio':>7}  target")
    for cached in (1_000, 11_000, 100_000):
        evict_us, fresh_us = bench_eviction(cached)
        print(f"{cached:>8,} {fresh_us:>11.2f} {evict_us:>9.2f} {evict_us / fresh_us:>7.2f}  "
              f"{verdict(evict_us / fresh_us, 4)}")
    print("\n(e) growing 64 sequences by one call per sequence (baseline) or one append_batch, "
          "median us per step")
    print(f"{'step':<26} {'page size':>9} {'per sequence':>13} {'append_batch':>13} {'ratio':>6}")
    for name, step_tokens in (("decode (1 token each)", 1), ("prefill chunk (37 each)", 37)):
        for page_size in (16, 1):
            batch_us, single_us = bench_batch_growth(page_size, step_tokens)
            print(f"{name:<26} {page_size:>9} {single_us:>13.1f} {batch_us:>13.1f} "
                  f"{batch_us / single_us:>6.2f}")
    evicting_us, roomy_us = bench_stream()
    print("\n(f) a round of fresh prompts (16 of one page, one of 256 tokens), each added, "
          "committed and freed, median us per round")
    print(f"{'pool':<44} {'us/round':>9} {'ratio':>6}  target")
    print(f"{'holds the whole stream: never evicts':<44} {roomy_us:>9.1f} {1.0:>6.2f}")
    print(f"{'1,000 pages all cached: every page evicted':<44} {evicting_us:>9.1f} "
          f"{evicting_us / roomy_us:>6.2f}  {verdict(evicting_us / roomy_us, 1.5)}")

if __name__ == "__main__":
    main()
