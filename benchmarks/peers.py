"""Bookkeeping side by side with the peers, in one process, on the same workloads: kvpool's
KVCache and vLLM v1's KVCacheManager (its BlockPool inside). For SGLang's RadixCache and
nano-vllm's BlockManager it reports whether their modules import here (not installed, or the
module that stops them). A peer that does not load is printed as such, and the rest run.

(1) caching off: add a 256-token prompt (16 pages of 16 tokens) and free it;
(2) a 15-page hit: the same 256-token prompt each time, matched, the rest allocated, cached
    (committed), freed;
(3) 10,000 prompts of 256 tokens over 50 shared system prompts of 64-192 tokens (as in
    benchmarks/cache.py (b)) through 16,384 pages, so that pages are evicted once it fills:
    microseconds per prompt, and the hit rate;
(4) the Python heap (tracemalloc) held by 100,000 cached pages: 6,250 unique prompts served
    into a pool of exactly that many pages.

Every prompt reaches a peer as a fresh list of fresh ints, made outside the timed region; what
a peer builds per request (vLLM's Request, which hashes the prompt's blocks with the default
sha256) is built inside it. Times are medians of interleaved rounds, net of the timer's cost.

    PYTHONPATH=src:<where the peers are installed> python benchmarks/peers.py
"""

from __future__ import annotations

import argparse
import importlib
import random
import traceback
from collections.abc import Callable

from cache import (
    LAYOUT,
    PAGE_SIZE,
    TOKENS,
    held_cost,
    interleaved_us,
    no_op,
    random_prompts,
    shared_prefix_prompts,
    tokenizer_output,
)
from kvpool.cache import KVCache

Serve = Callable[[int, list[int]], None]


class KVPoolPeer:
    """kvpool's KVCache: add_sequence, commit, free_sequence."""

    name = "kvpool KVCache"

    def server(self, num_pages: int, caching: bool) -> tuple[Serve, Callable[[], float]]:
        """A function serving one prompt, and one giving the hit rate so far."""
        cache = KVCache(LAYOUT, num_pages, device="cpu", prefix_caching=caching)

        def serve(i, ids):
            cache.add_sequence(0, ids)
            cache.commit(0)
            cache.free_sequence(0)
        return serve, lambda: cache.stats().prefix_hit_rate


class VLLMPeer:
    """vLLM v1's KVCacheManager over one full-attention group: a Request (its block hashes),
    get_computed_blocks, allocate_slots (which caches the full blocks), free."""

    name = "vLLM v1 KVCacheManager"

    def __init__(self):
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        kv_cache_utils.init_none_hash(sha256)
        self._spec = FullAttentionSpec(PAGE_SIZE, num_kv_heads=1, head_size=1,
                                       dtype=torch.float16)
        self._config, self._group = KVCacheConfig, KVCacheGroupSpec
        self._manager, self._request = KVCacheManager, Request
        self._hasher = kv_cache_utils.get_request_block_hasher(PAGE_SIZE, sha256)
        self._params = SamplingParams(max_tokens=1)

    def server(self, num_pages: int, caching: bool) -> tuple[Serve, Callable[[], float]]:
        config = self._config(num_blocks=num_pages + 1, kv_cache_tensors=[],  # + the null block
                              kv_cache_groups=[self._group(["layer"], self._spec)])
        manager = self._manager(config, max_model_len=4 * TOKENS, scheduler_block_size=PAGE_SIZE,
                                hash_block_size=PAGE_SIZE, enable_caching=caching)
        hasher, params, request = self._hasher if caching else None, self._params, self._request
        counts = [0, 0]  # tokens asked, tokens hit

        def serve(i, ids):
            req = request(str(i), ids, params, None, block_hasher=hasher)
            blocks, hit = manager.get_computed_blocks(req)[:2]
            manager.allocate_slots(req, len(ids) - hit, hit, blocks)
            manager.free(req)
            counts[0] += len(ids)
            counts[1] += hit
        return serve, lambda: counts[1] / counts[0] if counts[0] else 0.0


# Peers this script has no adapter for yet: it reports only whether their bookkeeping
# module imports here, and why not.
UNMEASURED = {"SGLang RadixCache": "sglang.srt.mem_cache.radix_cache",
              "nano-vllm BlockManager": "nanovllm.engine.block_manager"}
PEER_PACKAGES = ("vllm", "sglang", "nanovllm")


def why_not(error: Exception) -> str:
    """Why a peer could not be loaded, in a few words."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        if error.name.split(".")[0] in PEER_PACKAGES:
            return "not installed"
        return f"cannot be imported here: it needs {error.name}"
    return f"cannot be imported here: {traceback.format_exception_only(error)[-1].strip()}"


def load_peers() -> tuple[list, list[tuple[str, str]]]:
    """The peers that run here, and (name, why not) for the others."""
    peers, missing = [KVPoolPeer()], []
    try:
        peers.append(VLLMPeer())
    except Exception as e:  # any failure to load a peer is reported, not fatal
        missing.append((VLLMPeer.name, why_not(e)))
    for name, module in UNMEASURED.items():
        try:
            importlib.import_module(module)
        except Exception as e:
            missing.append((name, why_not(e)))
        else:
            missing.append((name, f"{module} imports, but this script has no adapter for it"))
    return peers, missing


def bench_requests(peers: list, n: int = 2_000, repeats: int = 9) -> list[tuple[float, float]]:
    """(1) and (2) for each peer: microseconds per request, net of the timer's cost."""
    rng = random.Random(0)
    fresh = random_prompts(n, rng)
    hit = random_prompts(1, rng) * n
    cases = [(lambda: no_op, fresh)]
    for peer in peers:
        cases.append((lambda peer=peer: peer.server(4096, False)[0], fresh))
        cases.append((lambda peer=peer: warmed(peer.server(4096, True)[0], hit[0]), hit))
    overhead, *times = interleaved_us(cases, repeats)
    return [(off - overhead, on - overhead) for off, on in zip(times[::2], times[1::2],
                                                                 strict=True)]


def warmed(serve: Serve, packed: bytes) -> Serve:
    """`serve` after serving `packed` once, so that every later request of it hits."""
    serve(-1, tokenizer_output(packed))
    return serve


def bench_shared(peers: list, prompts: list[bytes], num_pages: int = 16_384,
                 repeats: int = 3) -> list[tuple[float, float]]:
    """(3) for each peer: microseconds per prompt and the hit rate."""
    hit_rates = {}

    def make(peer):
        serve, rate = peer.server(num_pages, True)
        hit_rates[peer.name] = rate
        return serve
    cases = [(lambda: no_op, prompts)] + [(lambda peer=peer: make(peer), prompts)
                                          for peer in peers]
    overhead, *times = interleaved_us(cases, repeats)
    return [(us - overhead, hit_rates[peer.name]()) for us, peer in zip(times, peers,
                                                                         strict=True)]


def bench_heap(peers: list, num_prompts: int = 6_250) -> list[float]:
    """(4) for each peer: MiB of Python heap held by `num_prompts` unique prompts cached."""
    prompts = random_prompts(num_prompts, random.Random(1))
    num_pages = num_prompts * TOKENS // PAGE_SIZE

    def build(peer):
        serve, _ = peer.server(num_pages, True)
        for i, packed in enumerate(prompts):
            serve(i, tokenizer_output(packed))
        return serve
    return [held_cost(lambda peer=peer: build(peer))[0] for peer in peers]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    peers, missing = load_peers()
    for name, why in missing:
        print(f"{name}: {why}")
    requests = bench_requests(peers)
    prompts = shared_prefix_prompts(10_000)
    shared = bench_shared(peers, prompts)
    heaps = bench_heap(peers)
    base_off, base_hit = requests[0]
    base_shared, base_heap = shared[0][0], heaps[0]
    print(f"\nbookkeeping per request, page size {PAGE_SIZE}, {TOKENS}-token prompts; "
          "ratio: the peer's figure / kvpool's")
    print(f"{'':<24} {'(1) caching off':>17} {'(2) 15-page hit':>17} "
          f"{'(3) 10k shared, us':>19} {'hit':>6} {'(4) heap MiB':>14}")
    for peer, (off, hit), (us, rate), heap in zip(peers, requests, shared, heaps, strict=True):
        print(f"{peer.name:<24} {off:>7.2f} ({off / base_off:>5.2f}x) "
              f"{hit:>7.2f} ({hit / base_hit:>5.2f}x) {us:>9.2f} ({us / base_shared:>5.2f}x) "
              f"{rate:>6.1%} {heap:>6.1f} ({heap / base_heap:>4.2f}x)")
    print(f"(1), (2): us per request, median of 9 interleaved rounds of 2,000; (3): us per "
          f"prompt over {len(prompts):,} prompts through 16,384 pages, median of 3 rounds; "
          f"(4): 100,000 cached pages")


if __name__ == "__main__":
    main()
