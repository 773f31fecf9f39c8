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

With `--peer kvpool` or `--peer vllm`, the case off, hit or shared runs through that peer's
adapter in benchmarks/peers.py, as peers.py times it (every request a fresh list of fresh
ints, vLLM's Request and block hashes built inside the count): the ratio of two peers'
counts is the side-by-side comparison without the spread of a loaded machine's timings.
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
    parser.add_argument("--peer", choices=("kvpool", "vllm"),
                        help="serve the case through this peer's adapter in peers.py")
    args = parser.parse_args()
    if args.peer is not None:
        if args.case == "alloc":
            parser.error("--peer serves the cases off, hit and shared")
        through_peer(args.peer, args.case, args.requests)
        return
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


def through_peer(name: str, case: str, requests: int) -> None:
    """`case` served by peers.py's adapter of peer `name`, its prompts made before counting:
    off, fresh prompts with caching off; hit, one prompt served once uncounted; shared, the
    `shared` case's prompts after the same 4,000 uncounted."""
    import random

    from cache import random_prompts, shared_prefix_prompts, tokenizer_output
    from peers import KVPoolPeer, VLLMPeer, why_not

    try:
        peer = {"kvpool": KVPoolPeer, "vllm": VLLMPeer}[name]()
    except Exception as e:  # a peer that does not load here: say why, as peers.py does
        raise SystemExit(f"instructions.py: {name} {why_not(e)}") from None
    if case == "shared":
        warm = 4_000
        serve, _ = peer.server(16_384, True)
        prompts = [tokenizer_output(p) for p in shared_prefix_prompts(warm + requests)]
        for i, prompt in enumerate(prompts[:warm]):
            serve(i, prompt)
        prompts = prompts[warm:]
    elif case == "hit":
        serve, _ = peer.server(4096, True)
        packed = random_prompts(1, random.Random(0))[0]
        serve(-1, tokenizer_output(packed))
        prompts = [tokenizer_output(packed) for _ in range(requests)]
    else:
        serve, _ = peer.server(4096, False)
        prompts = [tokenizer_output(p) for p in random_prompts(requests, random.Random(0))]
    counting_on()
    for i, prompt in enumerate(prompts):
        serve(i, prompt)


if __name__ == "__main__":
    main()
