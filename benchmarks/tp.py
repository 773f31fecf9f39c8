"""Tensor parallelism on the CPU: how long an engine of 2 ranks takes to start, its workers
forked by the forkserver against spawned as before; one engine of 2 ranks (gloo) against one
rank, same model, same workload, in the same run; and where rank 0's time goes.

Run: python benchmarks/tp.py  (a few minutes on 2 CPU cores; --help for the sizes;
--start-only for the start times alone)

Start: the seconds from `LLM("tiny", tensor_parallel_size=2)` to a ready engine, and of its
`close()`, medians of --starts engines each, after a one-rank engine has loaded everything in
this process. The spawned workers come first (kvpool.engine.parallel's worker_context
replaced by spawn's); then the forkserver's first engine, which starts the server (it
imports torch and the engine once), and its later engines.

A random float32 Llama checkpoint (hidden 512, 8 layers, 8 heads, 4 KV heads, MLP 1408,
vocabulary 8192: 27 M parameters) saved to a temporary folder; a batch of prompts run to
completion with greedy sampling through `LLM.generate`, once per engine after a warm-up batch.
The tokens must be the same for both. Then the 2-rank engine runs the batch again under the
torch profiler, and the table splits rank 0's wall time: the step broadcast, the all-reduces
(two per layer, and the embedding's), the logits' all-gather, and the rest (its share of the
matmuls and attention, scheduling, sampling). Rank 0's time in a collective includes waiting
for the slower rank, so on a machine whose cores are shared that wait shows up there.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from kvpool import LLM, SamplingParams
from kvpool.engine import parallel
from options import positive_int

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
COLLECTIVES = {"broadcast": "step broadcast", "all_reduce": "all-reduce",
               "allgather": "logits all-gather", "all_gather": "logits all-gather"}


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def save_model(folder: str) -> None:
    """A random Llama of CONFIG, saved as a checkpoint in `folder`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, initializer_range=0.2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    """Seconds to generate the batch, and its tokens."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def start_close(repeats: int) -> tuple[float, float]:
    """Median seconds to start an engine of 2 ranks, and to close it, of `repeats` engines."""
    starts, closes = [], []
    for _ in range(repeats):
        begin = time.perf_counter()
        llm = LLM("tiny", device="cpu", num_pages=32, tensor_parallel_size=2)
        ready = time.perf_counter()
        llm.close()
        starts.append(ready - begin)
        closes.append(time.perf_counter() - ready)
    return statistics.median(starts), statistics.median(closes)


def start_times(repeats: int) -> str:
    """The table of start and close times: workers spawned, then forked by the forkserver
    (its first engine, then later ones)."""
    LLM("tiny", device="cpu", num_pages=32).close()  # rank 0's imports and first model
    forkserver = parallel.process_context  # looked up by the group at each start
    parallel.process_context = lambda: multiprocessing.get_context("spawn")
    try:
        spawned = start_close(repeats)
    finally:
        parallel.process_context = forkserver
    first = start_close(1)
    later = start_close(repeats)
    rows = [("2 ranks, tiny: workers", "start (s)", "close (s)", "start vs spawn")]
    for name, (start, close) in (("spawned (before)", spawned),
                                 ("forkserver, first engine", first),
                                 ("forkserver, later engines", later)):
        rows.append((name, f"{start:.2f}", f"{close:.2f}", f"{spawned[0] / start:.1f}x"))
    return format_table(rows)


def collective_seconds(prof) -> dict[str, float]:
    """Rank 0's wall seconds in each kind of collective, from the profiler's events."""
    spent: dict[str, float] = {}
    for event in prof.key_averages():
        for key, kind in COLLECTIVES.items():
            if key in event.key and "c10d" not in event.key:
                spent[kind] = spent.get(kind, 0.0) + event.cpu_time_total / 1e6
                break
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--starts", type=positive_int, default=3, help="engines per start time")
    parser.add_argument("--start-only", action="store_true", help="the start times alone")
    args = parser.parse_args()
    print(start_times(args.starts))
    print(f"\n{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}\n")
    if args.start_only:
        return
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(CONFIG["vocab_size"], (args.prompts, args.prompt_len),
                            generator=gen).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    options = dict(device="cpu", num_pages=2048, max_num_seqs=args.prompts,
                   prefix_caching=False)
    with tempfile.TemporaryDirectory() as folder:
        save_model(folder)
        rows, tokens, seconds = [], {}, {}
        for ranks in (1, 2):
            with LLM(folder, tensor_parallel_size=ranks, **options) as llm:
                run(llm, prompts[:2], params)  # warm-up
                before = llm.stats().num_steps
                seconds[ranks], tokens[ranks] = run(llm, prompts, params)
                steps = llm.stats().num_steps - before
                if ranks == 2:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        profiled, _ = run(llm, prompts, params)
                    spent = collective_seconds(prof)
        generated = args.prompts * args.max_tokens
        rows.append(("engine", "seconds", "tokens/s", "vs 1 rank"))
        for ranks in (1, 2):
            rows.append((f"{ranks} rank(s)", f"{seconds[ranks]:.2f}",
                         f"{generated / seconds[ranks]:.0f}",
                         f"{seconds[1] / seconds[ranks]:.2f}x"))
        print(format_table(rows))
        print(f"\nsame tokens: {tokens[1] == tokens[2]}; {steps} steps per batch\n")
        split = [("rank 0 of 2, profiled run", "seconds", "per step (ms)", "share")]
        for kind, s in sorted(spent.items(), key=lambda item: -item[1]):
            split.append((kind, f"{s:.2f}", f"{1e3 * s / steps:.2f}", f"{s / profiled:.0%}"))
        rest = profiled - sum(spent.values())
        split.append(("the rest", f"{rest:.2f}", f"{1e3 * rest / steps:.2f}",
                      f"{rest / profiled:.0%}"))
        print(format_table(split))
        print(f"\n{os.cpu_count()} CPU cores; torch {torch.__version__}")


if __name__ == "__main__":
    main()
