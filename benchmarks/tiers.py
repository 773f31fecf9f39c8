"""Tiers below the pool: how much prefill a host or disk tier saves when the device pool is
too small for the working set of shared prefixes, and what moving one page costs.

Workload: 200 prompts cycling over 40 system prompts of 256 tokens, each followed by its own
32-token question; a pool of 128 pages of 16 tokens, while the 40 system prompts alone need
640. Each prompt is added, committed and freed, as a finished request would be.
Baseline: no tier, where an evicted page is lost (and LRU over a cycle longer than the pool
hits nothing). Page geometry of TinyLlama-1.1B: 22 layers, 4 KV heads, head_dim 64, fp16,
352 KiB per page. Times are the tier's own `put` / `get` per page moved, in microseconds
(the pool's gather and scatter of the same pages are not included).

Two replicas: the same prompts sent at random to one of two caches (as a load balancer
would), each with no tier, a HostTier of its own, or a RedisTier on one Redis server both
share (redis-server started on a free local port, or --redis-url). Wall time is the caches'
own work and the tiers' traffic, with no model: the prefill the recomputed tokens would
cost comes on top.

    python benchmarks/tiers.py [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.cache import KVCache
from kvpool.cache.tiers import DiskTier, HostTier, Tier, page_namespace
from kvpool.memory.layout import KVLayout

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


def serve_replicas(prompts: list[list[int]], make_tier: Callable[[], Tier | None],
                   seed: int = 0) -> tuple[int, float]:
    """Send each prompt to one of two caches at random (each with a tier of `make_tier`);
    the prompt tokens recomputed and the wall time in seconds."""
    rng = random.Random(seed)
    caches = [KVCache(LAYOUT, NUM_PAGES, device="cpu", prefix_caching=True, tier=make_tier())
              for _ in range(2)]
    recomputed = 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        cache = caches[rng.randrange(2)]
        recomputed += len(prompt) - cache.add_sequence(i, prompt)
        cache.commit(i)
        cache.free_sequence(i)
    return recomputed, time.perf_counter() - t0


@contextlib.contextmanager
def redis_url(given: str | None):
    """`given`, or the URL of a redis-server started on a free local port for the block;
    None when neither is at hand."""
    if given or shutil.which("redis-server") is None:
        yield given
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(url, server)
        yield url
    finally:
        server.terminate()
        server.wait()


def wait_for_redis(url: str, server: subprocess.Popen, seconds: float = 10.0) -> None:
    """Return once the redis-server just started answers PING at `url`; exit if it quits
    or stays silent for `seconds`."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.ping()
            return
        except redis.RedisError:
            if server.poll() is not None:
                sys.exit(f"redis-server exited with code {server.returncode} before answering")
            if time.monotonic() > deadline:
                sys.exit(f"redis-server did not answer at {url} in {seconds:.0f} s")
            time.sleep(0.05)
        finally:
            client.close()


def main_replicas(prompts: list[list[int]], url: str | None) -> None:
    redis_tiers: list = []  # the RedisTiers made, whose failed calls are counted
    cases: list[tuple[str, Callable[[], Tier | None]]] = [
        ("no tier", lambda: None),
        (f"HostTier({TIER_PAGES}) each", lambda: HostTier(TIER_PAGES)),
    ]
    if url is not None:
        from kvpool.cache.redis_tier import RedisTier

        def shared_redis() -> RedisTier:
            redis_tiers.append(RedisTier(url))
            return redis_tiers[-1]

        cases.append(("one shared RedisTier", shared_redis))
    print(f"\ntwo replicas, each prompt to one at random; {NUM_PAGES} pages each")
    print(f"{'case':<24} {'recomputed':>11} {'ratio':>6} {'wall s':>7}")
    baseline = None
    for name, make in cases:
        recomputed, seconds = serve_replicas(prompts, make)
        errors = sum(tier.num_errors for tier in redis_tiers)
        if errors:
            sys.exit(f"{name}: {errors} Redis calls to {url} failed; no result for this case")
        baseline = baseline or recomputed
        print(f"{name:<24} {recomputed:>11} {recomputed / baseline:>6.2f} {seconds:>7.2f}")
    if url is None:
        print("(no redis-server on PATH and no --redis-url: the RedisTier case is left out)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a Redis server to use (default: start one)")
    args = parser.parse_args()
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
    with redis_url(args.redis_url) as url:
        main_replicas(prompts, url)


if __name__ == "__main__":
    main()
