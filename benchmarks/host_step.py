"""The engine's host work per decode step, by phase, on the CPU: what a GPU step is left with
when the device is fast (benchmarks/gpu_engine.py's profile point is host-bound).

    python benchmarks/host_step.py [--seqs N] [--context N] [--steps N] [--repeats N]

The built-in `tiny` model (page size 16, greedy, ignore_eos, overlap scheduling on) decodes
N sequences of ~`context` tokens (prompts of context +- 10 random tokens) through the step
API (`add_request`, `step`), the way a server drives it. Decode steps take the GPU's path:
each is staged into its CUDA-graph bucket by `CUDAGraphRunner.stage` (padded rows,
full-width page tables) and the bucket's forward, which a graph replays on a GPU, runs
eagerly on the staged inputs (the context's views, which the graph computes, count as
forward). Every phase is timed with the thread's CPU time (less disturbed than wall time on
a shared machine); the model's forward and the sampler are timed too and left out of the
host total. Torch runs one intra-op thread, so that small host tensors never wait for a busy
core. Each repeat measures `steps` decode steps after a
warm-up; the table gives the median over repeats of each phase's microseconds per step, for
batch 8 (the baseline, same run) and batch N, and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections import defaultdict

import torch

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.graphs import CUDAGraphRunner
from kvpool.engine.scheduler import ScheduledBatch
from options import int_at_least, positive_int

PAGE_SIZE = 16
BASELINE_SEQS = 8
MAX_BATCHED_TOKENS = 4096
PROMPT_SPREAD = 10  # prompts are context +- this many tokens
WARMUP_STEPS = 4
EXCLUDED = ("model forward", "sampling")  # the device's work on a GPU


class EagerGraphs(CUDAGraphRunner):
    """The CUDA-graph path on the CPU: a decode step is staged into its bucket exactly as
    for a replay, and the bucket's forward, which the graph holds, runs eagerly on it."""

    def capture(self, *, progress: bool = True) -> None:
        self.graphs = dict.fromkeys(self.batch_sizes)

    def run(self, batch: ScheduledBatch, bucket: int,
            last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        flat = self.stage(batch, bucket, last_tokens)
        self.num_replays += 1
        return self.runner.model(self.inputs(flat, bucket))[: len(batch.seqs)]


class PhaseClock:
    """Thread CPU seconds spent in each wrapped callable, summed by phase name."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - start
        return timed


def max_tokens(num_seqs: int, context: int, steps: int) -> int:
    """Output tokens per request that none reaches before the last measured step: a
    sequence decodes in every step after its own prefill, those of the others (each step's
    budget less a decode token per sequence), the warm-up and the measured steps."""
    prompt_tokens = num_seqs * (context + PROMPT_SPREAD)
    prefill_steps = -(-prompt_tokens // (MAX_BATCHED_TOKENS - num_seqs))
    return max(2 * steps, prefill_steps + WARMUP_STEPS + steps + 2)


def engine(num_seqs: int, context: int, steps: int, seed: int) -> tuple[LLM, PhaseClock]:
    """A tiny engine decoding `num_seqs` sequences of ~`context` tokens, its phases timed."""
    output_tokens = max_tokens(num_seqs, context, steps)
    llm = LLM("tiny", device="cpu", page_size=PAGE_SIZE, max_num_seqs=num_seqs,
              max_num_batched_tokens=MAX_BATCHED_TOKENS,
              max_model_len=context + 16 + output_tokens, overlap=True, seed=seed)
    torch.set_num_threads(1)
    llm.graphs = EagerGraphs(llm.runner, num_seqs, llm._longest)
    llm.graphs.capture()
    rng = random.Random(seed)
    for _ in range(num_seqs):
        prompt = [rng.randrange(256)
                  for _ in range(context + rng.randint(-PROMPT_SPREAD, PROMPT_SPREAD))]
        llm.add_request(prompt, SamplingParams(max_tokens=output_tokens, temperature=0,
                                               ignore_eos=True))
    clock = PhaseClock()
    s = llm.scheduler
    s.schedule = clock.wrap("scheduler.schedule", s.schedule)
    s.update = clock.wrap("scheduler.update", s.update)
    s.add_placeholders = clock.wrap("scheduler.add_placeholders", s.add_placeholders)
    s.postprocess = clock.wrap("scheduler.postprocess", s.postprocess)
    llm.graphs.stage = clock.wrap("graph staging", llm.graphs.stage)
    # the int32 views of the context are computed inside the graph on a GPU: forward too
    llm.graphs.inputs = clock.wrap("model forward", llm.graphs.inputs)
    llm.runner.model = clock.wrap("model forward", llm.runner.model)
    llm.sampler = clock.wrap("sampling", llm.sampler)
    llm._count = clock.wrap("stats", llm._count)
    # LLM.step is _step, then an output (text decoded) for each request that advanced
    llm._step = clock.wrap("step", llm._step)
    return llm, clock


def measure(num_seqs: int, context: int, steps: int, seed: int) -> dict[str, float]:
    """Microseconds per decode step of each phase, of the rest ("other") and the host total
    (the step less the forward and the sampler)."""
    llm, clock = engine(num_seqs, context, steps, seed)
    while llm.scheduler.waiting or any(
            seq.num_computed_tokens < len(seq.request.prompt_token_ids)
            for seq in llm.scheduler.running):
        llm.step()
    for _ in range(WARMUP_STEPS):  # the last prefill leaves the pipeline; graphs take over
        llm.step()
    clock.seconds.clear()
    replays = llm.graphs.num_replays
    start = time.thread_time()
    for _ in range(steps):
        llm.step()
    total = time.thread_time() - start
    assert llm.graphs.num_replays - replays == steps, "every measured step is a decode step"
    assert len(llm.scheduler.running) == num_seqs
    us = {phase: seconds / steps * 1e6 for phase, seconds in clock.seconds.items()}
    inner = us.pop("step")
    us["other"] = inner - sum(us.values())
    us["outputs (detokenize)"] = total / steps * 1e6 - inner
    us["host total"] = total / steps * 1e6 - sum(us[p] for p in EXCLUDED)
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=positive_int, default=64)
    parser.add_argument("--context", type=int_at_least(PROMPT_SPREAD + 1), default=700)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args()
    if args.seqs >= MAX_BATCHED_TOKENS:
        parser.error(f"argument --seqs: expected an int < {MAX_BATCHED_TOKENS}, the tokens "
                     f"of a step, which also prefill; got {args.seqs}")
    runs: dict[int, list[dict[str, float]]] = {BASELINE_SEQS: [], args.seqs: []}
    for repeat in range(args.repeats):
        for num_seqs in runs:
            runs[num_seqs].append(measure(num_seqs, args.context, args.steps, seed=repeat))
    phases = list(runs[args.seqs][0])
    base = {p: statistics.median(r[p] for r in runs[BASELINE_SEQS]) for p in phases}
    main_ = {p: statistics.median(r[p] for r in runs[args.seqs]) for p in phases}
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"host work per decode step, ~{args.context}-token contexts, {args.steps} steps, "
          f"median of {args.repeats} repeats (CPU us; load average {load})")
    print(f"{'phase':<28}{'batch ' + str(BASELINE_SEQS):>12}{'batch ' + str(args.seqs):>12}"
          f"{'ratio':>8}")
    for phase in phases:
        mark = " (not host)" if phase in EXCLUDED else ""
        ratio = main_[phase] / base[phase] if base[phase] > 0 else float("nan")
        print(f"{phase + mark:<28}{base[phase]:>12.0f}{main_[phase]:>12.0f}{ratio:>8.1f}")


if __name__ == "__main__":
    main()
