"""Under load: how much `kvpool bench` slows down when another process keeps one core busy.

The bench's workload (60 requests of the built-in tiny model, as `kvpool bench
--num-requests 60`) runs in-process, each time in a fresh Python process, idle and next to
one busy process (a pure-Python spin loop), in interleaved rounds so that the rest of the
machine's load reaches every case alike. Two ways to start:

- torch defaults (baseline): torch is imported before kvpool, so OpenMP keeps its default
  spin-waiting, as before kvpool chose it;
- kvpool: kvpool is imported first, so idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE).
Both then have as many threads as the cores this process may use (the `threads` column).

Target: the busy process slows kvpool by at most 1.5x. Ratios are within one run.

    python benchmarks/under_load.py [--rounds 3] [--num-requests 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from options import positive_int

MODES = ("torch defaults", "kvpool")
# Run in a fresh interpreter: the import order decides OpenMP's settings.
CHILD = """
import json, sys
if sys.argv[1] == "torch defaults":
    import torch  # OpenMP starts before kvpool can choose its wait policy
from kvpool import LLM
from kvpool.cli.bench import Workload, make_workload, run_workload
import torch
llm = LLM("tiny", num_pages=384, seed=0)
run_workload(llm, make_workload(Workload(4, seed=1), llm.model_config.vocab_size),
             show_progress=False)  # warm-up: kernel build, allocator, caches
requests = make_workload(Workload(int(sys.argv[2])), llm.model_config.vocab_size)
result = run_workload(llm, requests, show_progress=False)
print(json.dumps({"wall": result.wall_time, "threads": torch.get_num_threads()}))
"""
BUSY = "while True: pass"


def measure(mode: str, num_requests: int, busy: bool) -> dict:
    """Wall time (s) of the workload in a fresh process, with or without a busy neighbour."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    neighbour = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, mode, str(num_requests)], env=env,
                               capture_output=True, text=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if child.returncode:
        tail = child.stderr.splitlines()[-10:]
        sys.exit("\n".join([f"error: the {mode} run{', busy' if busy else ''} exited with code "
                            f"{child.returncode}; its stderr ends:", *tail]))
    return json.loads(child.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--num-requests", type=int, default=60)
    args = parser.parse_args()
    times: dict[tuple[str, bool], list[float]] = {}
    threads = {}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for mode in MODES:
            for busy in (False, True):
                result = measure(mode, args.num_requests, busy)
                print(f"{mode}{', busy' if busy else ''}: {result['wall']:.2f} s",
                      file=sys.stderr, flush=True)
                times.setdefault((mode, busy), []).append(result["wall"])
                threads[mode] = result["threads"]
    cores = len(os.sched_getaffinity(0))
    print(f"kvpool bench --num-requests {args.num_requests} in-process, {cores} cores, median "
          f"of {args.rounds} interleaved rounds; load average {load_before:.1f} before the run "
          f"(other processes on these cores slow every case)")
    print(f"{'start':<16}{'threads':>8}{'idle s':>9}{'busy s':>9}{'slowdown':>10}  target")
    for mode in MODES:
        idle = statistics.median(times[mode, False])
        busy = statistics.median(times[mode, True])
        ratio = busy / idle
        target = f"<= 1.5x: {'met' if ratio <= 1.5 else 'not met'}" if mode == "kvpool" else ""
        print(f"{mode:<16}{threads[mode]:>8}{idle:>9.2f}{busy:>9.2f}{ratio:>9.2f}x  {target}")
    base = statistics.median(times["torch defaults", False])
    print(f"kvpool idle vs torch defaults idle: "
          f"{statistics.median(times['kvpool', False]) / base:.2f}x")
    print("all runs (s): " + "; ".join(
        f"{mode}{', busy' if busy else ''}: {', '.join(f'{t:.2f}' for t in ts)}"
        for (mode, busy), ts in times.items()))


if __name__ == "__main__":
    main()
