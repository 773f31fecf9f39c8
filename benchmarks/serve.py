"""The cost of HTTP: `kvpool bench`'s workload in process against the same workload sent to
`kvpool serve` through streamed completions, in the same run.

Each round runs both on fresh engines (a new LLM in this process, a new `kvpool serve`
subprocess, so neither starts with a warm prefix cache), with the same model, pool, seed
and workload; the rounds interleave, so the machine's changes of speed reach both alike.
The server is a separate process, as in use: the HTTP client (this process) and the server
share the machine's cores. Both engines run torch on `--threads` threads (default 1): on a
small machine that other processes also load, two OpenMP threads that wait for each other
at every operation made either side up to 14x slower, which would swamp the comparison.
Prints the median of the rounds, the ratio of throughputs, and each round's ratio.
Target: the HTTP path at most 10% slower (generated tok/s ratio >= 0.90).

    python benchmarks/serve.py [--num-requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch

from kvpool.bench import DEFAULT_NUM_PAGES, BenchResult, Workload, make_workload, run_workload
from kvpool.engine import LLM
from kvpool.server.http_bench import model_info, run_requests, session

SRC = Path(__file__).resolve().parents[1] / "src"


def run_client(coroutine):
    """Run the client on uvloop when it is installed (the server extra brings it): the
    client shares the cores with the server, and uvloop takes less of them."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def in_process(workload: Workload) -> BenchResult:
    llm = LLM("tiny", num_pages=DEFAULT_NUM_PAGES, seed=workload.seed)
    return run_workload(llm, make_workload(workload, llm.model_config.vocab_size),
                        show_progress=False)


def over_http(workload: Workload) -> BenchResult:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli", "serve", "--model", "tiny", "--port", str(port),
         "--num-pages", str(DEFAULT_NUM_PAGES), "--seed", str(workload.seed)],
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": str(torch.get_num_threads())},
        stderr=subprocess.DEVNULL)
    try:
        return run_client(_client(f"http://127.0.0.1:{port}", workload))
    finally:
        server.terminate()
        server.wait(60)


async def _client(url: str, workload: Workload) -> BenchResult:
    async with session(url) as client:
        deadline = time.monotonic() + 120
        while True:
            try:
                info = await model_info(client)
                break
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("kvpool serve did not answer in 120 s") from None
                await asyncio.sleep(0.2)
        requests = make_workload(workload, info["vocab_size"])
        return await run_requests(client, info["id"], requests, show_progress=False)


def summary(result: BenchResult) -> tuple[float, float, float, float]:
    """Wall time (s), generated tok/s, TTFT p50 and TPOT p50 (ms) of one run."""
    generated = sum(t.num_output_tokens for t in result.timings)
    ttft = np.percentile([t.ttft for t in result.timings], 50) * 1000
    tpot = np.percentile([t.tpot for t in result.timings if t.tpot is not None], 50) * 1000
    return result.wall_time, generated / result.wall_time, ttft, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = Workload(args.num_requests)
    runs: dict[str, list[tuple[float, float, float, float]]] = {"in process": [], "HTTP": []}
    tokens = {}
    for _ in range(args.rounds):
        for name, run in (("in process", in_process), ("HTTP", over_http)):
            result = run(workload)
            tokens[name] = sum(t.num_output_tokens for t in result.timings)
            runs[name].append(summary(result))
    assert tokens["in process"] == tokens["HTTP"], tokens
    print(f"kvpool bench workload: {args.num_requests} requests, {tokens['HTTP']:,} generated "
          f"tokens, tiny model, {DEFAULT_NUM_PAGES} pages; median of {args.rounds} "
          f"interleaved rounds; {args.threads} torch thread(s) per engine; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'path':<12}{'wall s':>9}{'gen tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
          f"{'ratio':>8}")
    base = statistics.median(r[1] for r in runs["in process"])
    for name, rows in runs.items():
        wall, rate, ttft, tpot = (statistics.median(column) for column in zip(*rows,
                                                                              strict=True))
        print(f"{name:<12}{wall:>9.2f}{rate:>11,.1f}{ttft:>13,.1f}{tpot:>13.1f}"
              f"{rate / base:>8.2f}")
    rounds = ", ".join(f"{http[1] / local[1]:.2f}"
                       for local, http in zip(runs["in process"], runs["HTTP"], strict=True))
    print(f"ratio: generated tok/s against in process (target >= 0.90); each round's: {rounds}")


if __name__ == "__main__":
    main()
