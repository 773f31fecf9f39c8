"""How long one allocate(16) + free(16) cycle takes in PageAllocator, next to two baselines.

    python benchmarks/allocator.py [--cycles N] [--repeats N]

Every pool starts half full, as in a busy server, and each cycle takes 16 pages and gives
them back. Baselines, measured in the same run:
  stack   the floor: a bare Python list used as a stack of free ids, no reference counts
  deque   the common simple design: a deque of free ids and a list of reference counts
          (no checks beyond capacity; it does not validate ids, is not atomic, has no lock)
Times are CPU microseconds per cycle (process time, which other processes on a shared
machine disturb less than wall time), median over repeats. Ratios are against deque, taken
within each repeat and then the median, so noise common to a repeat cancels.
Targets: lifo at most 1.0x, first_fit at most 3x, neither growing with the pool size.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections import deque
from collections.abc import Callable

from kvpool.memory.allocator import PageAllocator
from options import positive_int

SIZES = (1_000, 100_000, 1_000_000)
BATCH = 16  # pages per cycle: one allocate and one free of this many


class StackFreeList:
    """The floor: free ids on a list used as a stack, nothing else."""

    def __init__(self, num_pages: int) -> None:
        self.free_ids = list(range(num_pages - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError(f"need {n} pages, {len(self.free_ids)} free")
        ids = self.free_ids[-n:]
        del self.free_ids[-n:]
        return ids

    def free(self, pages: list[int]) -> None:
        self.free_ids.extend(pages)


class DequeAllocator:
    """The common simple design: a deque of free ids and a list of reference counts."""

    def __init__(self, num_pages: int) -> None:
        self.free_ids = deque(range(num_pages))
        self.refcounts = [0] * num_pages

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError(f"need {n} pages, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for page in ids:
            self.refcounts[page] = 1
        return ids

    def free(self, pages: list[int]) -> None:
        for page in pages:
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                self.free_ids.append(page)


# Column name -> factory of an allocator for a pool of that many pages.
CANDIDATES: dict[str, Callable[[int], object]] = {
    "stack": StackFreeList,
    "deque": DequeAllocator,
    "lifo": PageAllocator,
    "lifo, no lock": lambda n: PageAllocator(n, thread_safe=False),
    "first_fit": lambda n: PageAllocator(n, policy="first_fit"),
}


def cycle_loop(allocator, cycles: int) -> Callable[[], None]:
    """A function that runs `cycles` allocate(BATCH) + free cycles on `allocator`."""
    allocate, free = allocator.allocate, allocator.free

    def run() -> None:
        for _ in range(cycles):
            free(allocate(BATCH))

    return run


def measure(num_pages: int, cycles: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Microseconds per cycle and ratio to deque, per candidate, for one pool size."""
    loops = {}
    for name, make in CANDIDATES.items():
        allocator = make(num_pages)
        allocator.allocate(num_pages // 2)  # a busy pool: half the pages stay held
        loops[name] = cycle_loop(allocator, cycles)
    micros: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(repeats):
        # Interleaved, so that a noisy moment slows every candidate of a repeat alike.
        for name, run in loops.items():
            seconds = timeit.Timer(run, timer=time.process_time).timeit(number=1)
            micros[name].append(seconds / cycles * 1e6)
    result = {}
    for name, times in micros.items():
        ratios = [t / base for t, base in zip(times, micros["deque"], strict=True)]
        result[name] = (statistics.median(times), statistics.median(ratios))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=positive_int, default=2_000,
                        help="cycles per measurement")
    parser.add_argument("--repeats", type=positive_int, default=25,
                        help="measurements per candidate")
    args = parser.parse_args()
    names = list(CANDIDATES)
    print(f"allocate({BATCH}) + free({BATCH}): microseconds per cycle (ratio to deque)")
    print(f"{'pages':>10} " + " ".join(f"{name:>16}" for name in names))
    for num_pages in SIZES:
        result = measure(num_pages, args.cycles, args.repeats)
        cells = [f"{result[n][0]:7.2f} ({result[n][1]:4.2f}x)" for n in names]
        print(f"{num_pages:>10,} " + " ".join(f"{cell:>16}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
