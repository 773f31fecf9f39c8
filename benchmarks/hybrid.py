"""Prefix caching of a hybrid model: how many prompt tokens state checkpoints save on a
multi-turn chat workload, for decode track intervals of 64, 256 and 1024 tokens and for
several shares of the cache memory given to state slots, against no prefix caching.

Workload: 16 conversations of 4 turns sharing one 512-token system prompt; each turn's
prompt is the conversation so far (the previous prompt and its 256-token answer) plus a new
96-token message, and decodes 256 tokens. Turns run one at a time, conversations
interleaved (turn 1 of each, then turn 2 of each, ...), so their histories compete for the
cache. Each request is added, prefilled in chunks of 512 tokens, decoded token by token
(committing after every step, as the engine does) and freed. Each prefill chunk keeps a
checkpoint at its last multiple of 64 tokens, and the output one every track interval; a
turn can resume from its history only through a checkpoint, so the track interval decides
how much of the last answer is recomputed. Memory: 6 GiB of cache with the geometry of
Bamba-9B in bf16 (59.40 MiB per state slot, 192 KiB per page of 16 tokens), one slot for
the running sequence and the rest for checkpoints; the state tensors themselves are
allocated small, as only their counts matter here. Baseline: the same cache without
prefix caching, which recomputes every prompt token.

    python benchmarks/hybrid.py
"""

from __future__ import annotations

import argparse
import random

import torch

from kvpool.cache import KVCache, StateSpec
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout
from kvpool.models.config import ModelConfig

BAMBA = ModelConfig.from_hf("Bamba-9B")
PAGE_BYTES = BAMBA.kv_layout().bytes_per_page
SLOT_BYTES = BAMBA.mamba_layout().bytes_per_slot
BUDGET = 6 * 2**30
# Small stand-ins: the cache's bookkeeping is what is measured, not the tensors.
LAYOUT = KVLayout(1, 1, 2, dtype=torch.float32, page_size=16)
STATES = MambaLayout(1, 2, 2, 1, 1, 1, torch.float32)
CONVERSATIONS, TURNS = 16, 4
SYSTEM, MESSAGE, ANSWER = 512, 96, 256
CHUNK, INTERVAL = 512, 64


def workload(seed: int = 0) -> list[tuple[int, list[int], list[int]]]:
    """(conversation, prompt, answer) per request, in the order they run."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(SYSTEM)]
    histories = [list(system) for _ in range(CONVERSATIONS)]
    requests = []
    for _ in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = histories[c] + [rng.randrange(50_000) for _ in range(MESSAGE)]
            answer = [rng.randrange(50_000) for _ in range(ANSWER)]
            requests.append((c, prompt, answer))
            histories[c] = prompt + answer
    return requests


def run(cache: KVCache, requests) -> tuple[int, int]:
    """(prompt tokens, prompt tokens served from the prefix cache) over the workload."""
    total = served = 0
    for i, (_, prompt, answer) in enumerate(requests):
        hit = cache.add_sequence(i, prompt)
        total, served = total + len(prompt), served + hit
        for start in range(hit, len(prompt), CHUNK):
            cache.state_batch([i], [start], [min(start + CHUNK, len(prompt))])
        cache.commit(i)
        for token in answer[:-1]:  # the last answer token is never fed back
            n = cache.num_tokens(i)
            cache.append(i, token_ids=[token])
            cache.state_batch([i], [n], [n + 1])
            cache.commit(i)
        cache.free_sequence(i)
    cache.check()
    return total, served


def hybrid_cache(ratio: float, track: int | None) -> KVCache:
    """The cache `ratio` of BUDGET gives state slots; track None: no prefix caching."""
    slots = int(BUDGET * ratio) // SLOT_BYTES
    pages = (BUDGET - slots * SLOT_BYTES) // PAGE_BYTES
    if track is None:
        return KVCache(LAYOUT, pages, device="cpu", states=StateSpec(STATES, 1))
    return KVCache(LAYOUT, pages, device="cpu", prefix_caching=True,
                   states=StateSpec(STATES, 1, slots - 1, INTERVAL, track))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    requests = workload()
    rows = [("none", 0.5, None)] + [(f"track {t}, 50% states", 0.5, t)
                                   for t in (64, 256, 1024)] + [
        (f"track 256, {r:.0%} states", r, 256) for r in (0.1, 0.3, 0.7)]
    baseline = None
    print(f"{'prefix caching':<26}{'ckpt slots':>11}{'pages':>8}{'hit rate':>10}"
          f"{'recomputed':>12}{'vs none':>9}")
    for name, ratio, track in rows:
        cache = hybrid_cache(ratio, track)
        total, served = run(cache, requests)
        recomputed = total - served
        baseline = baseline or recomputed
        slots = cache.state.checkpoints.capacity
        print(f"{name:<26}{slots:>11,}{cache.num_pages:>8,}{served / total:>10.1%}"
              f"{recomputed:>12,}{recomputed / baseline:>9.2f}")


if __name__ == "__main__":
    main()
