"""The scheduler's own cost per decode step, growing the running sequences with one
`KVCache.append_batch` against one `append` per sequence.

    python benchmarks/scheduler.py [--seqs N] [--steps N] [--repeats N]

N sequences (20-token prompts, page size 16 and 1, prefix caching on, a pool with room for
all) are admitted and prefilled; then every step is schedule + update + postprocess with a
fake sampled token, no model. When the pages suffice, the scheduler grows every running
sequence with one append_batch; the baseline, measured in the same run, is its fallback path
(used when pages run short), which checks and appends one sequence at a time. Times are CPU
microseconds per step (thread time, which other processes on a shared machine disturb less
than wall time), median over the steps of a repeat; the ratio is taken within each repeat
and then the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpool.cache import KVCache
from kvpool.engine.params import SamplingParams
from kvpool.engine.request import Request
from kvpool.engine.scheduler import ScheduledBatch, Scheduler
from kvpool.memory.layout import KVLayout
from options import positive_int


class OneByOneScheduler(Scheduler):
    """The baseline: always the per-sequence path."""

    def _schedule_running_at_once(self, batch: ScheduledBatch) -> int:
        return self._schedule_running_one_by_one(batch)


def step_time(cls: type[Scheduler], num_seqs: int, page_size: int, steps: int) -> float:
    """Median CPU microseconds of one decode step over `steps` steps."""
    layout = KVLayout(1, 1, 4, torch.float32, page_size=page_size)
    num_pages = num_seqs * -(-(20 + steps + 1) // page_size) + 1
    cache = KVCache(layout, num_pages, device="cpu", prefix_caching=True)
    scheduler = cls(cache, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
                    max_model_len=4096, watermark_pages=1, eos_token_ids={1})
    for i in range(num_seqs):
        prompt = list(range(1000 * i + 2, 1000 * i + 22))
        scheduler.add_request(Request(str(i), None, prompt,
                                      SamplingParams(ignore_eos=True, max_tokens=steps + 2)))
    times = []
    for _ in range(steps + 1):  # the first step is the prefill
        start = time.thread_time()
        batch = scheduler.schedule()
        seqs, _ = scheduler.update(batch)
        scheduler.add_placeholders(seqs)
        scheduler.postprocess(seqs, [5] * len(seqs))
        times.append(time.thread_time() - start)
    assert len(scheduler.running) == num_seqs and scheduler.num_preemptions == 0
    return statistics.median(times[1:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    print(f"decode step over {args.seqs} sequences, CPU us per step (median of "
          f"{args.repeats} repeats)")
    print(f"{'page size':<10} {'one by one':>10} {'append_batch':>12} {'ratio':>6}")
    for page_size in (16, 1):
        rows = [(step_time(OneByOneScheduler, args.seqs, page_size, args.steps),
                 step_time(Scheduler, args.seqs, page_size, args.steps))
                for _ in range(args.repeats)]
        base = statistics.median(r[0] for r in rows)
        new = statistics.median(r[1] for r in rows)
        ratio = statistics.median(r[1] / r[0] for r in rows)
        print(f"{page_size:<10} {base:>10.0f} {new:>12.0f} {ratio:>5.2f}x")


if __name__ == "__main__":
    main()
