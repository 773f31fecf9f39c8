"""A fixed number of requests of one hot-path case, for counting machine instructions.

    valgrind --tool=callgrind --instr-atstart=no \
        python benchmarks/instructions.py CASE N

Instructions per request = (count at N=1,200 - count at N=200) / 1,000, which cancels start-up
and shutdown. Counts do not move with the load of a shared machine, unlike times. Setup runs
uninstrumented: the script switches counting on (`callgrind_control -i on`) just before its
loop, and does nothing more when run without valgrind. Cases:
  alloc  PageAllocator(100,000), half held: allocate(16) + free(16)
  off    KVCache, caching off: add a 256-token sequence (16 pages) + free it
  hit    KVCache, caching on, a 256-token prompt cached: add it again (15-page hit, the last
         page is new) + commit + free
  shared KVCache of 16,384 pages, caching on: the prompts of benchmarks/cache.py (b) (50
         shared system prompts, unique tails), each added (match, and eviction: the first
         4,000 fill the pool uncounted) + committed (insert) + freed; each request a fresh
         list, made before counting starts
"""

from __future__ import annotations

import argparse
import os
import subprocess

from kvpool.memory.allocator import PageAllocator

PAGE_SIZE = 16
PROMPT = list(range(1_000, 1_000 + 16 * PAGE_SIZE))


def counting_on() -> None:
    """Tell callgrind, if it runs this process, to start counting."""
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())],
                   capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=("alloc", "off", "hit", "shared"))
    parser.add_argument("requests", type=int)
    args = parser.parse_args()
    if args.case == "alloc":
        allocator = PageAllocator(100_000)
        allocator.allocate(50_000)
        counting_on()
        for _ in range(args.requests):
            allocator.free(allocator.allocate(16))
        return
    import torch

    from kvpool.cache import KVCache
    from kvpool.memory.layout import KVLayout

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                      page_size=PAGE_SIZE)
    if args.case == "shared":
        shared(layout, args.requests)
        return
    cache = KVCache(layout, 4096, device="cpu", prefix_caching=args.case == "hit")
    if args.case == "hit":
        cache.add_sequence(-1, PROMPT)
        cache.commit(-1)
        cache.free_sequence(-1)
    counting_on()
    for i in range(args.requests):
        if args.case == "off":
            cache.add_sequence(i, num_tokens=len(PROMPT))
        else:
            cache.add_sequence(i, PROMPT)
            cache.commit(i)
        cache.free_sequence(i)


def shared(layout, requests: int) -> None:
    """The `shared` case: `requests` prompts counted after 4,000 that fill the pool."""
    from cache import shared_prefix_prompts, tokenizer_output
    from kvpool.cache import KVCache

    warm = 4_000
    prompts = [tokenizer_output(p) for p in shared_prefix_prompts(warm + requests)]
    cache = KVCache(layout, 16_384, device="cpu", prefix_caching=True)
    for i, prompt in enumerate(prompts):
        if i == warm:
            counting_on()
        cache.add_sequence(i, prompt)
        cache.commit(i)
        cache.free_sequence(i)


if __name__ == "__main__":
    main()
