"""The cost of HTTP: `kvpool bench`'s workload in process against the same workload sent to
`kvpool serve` through streamed completions, in the same run.

Each round runs both on fresh engines (a new LLM in this process, a new `kvpool serve`
subprocess, so neither starts with a warm prefix cache), with the same model, pool, seed
and workload; the rounds interleave, so the machine's changes of speed reach both alike.
The server is a separate process, as in use: the HTTP client (this process) and the server
share the machine's cores. Both engines run torch on `--threads` threads (default 1): on a
small machine that other processes also load, two OpenMP threads that wait for each other
at every operation made either side up to 14x slower, which would swamp the comparison.
Prints the median of the rounds and of their throughput ratios (HTTP over in process in the
same round: the two run back to back, so a change in the machine's load reaches both more
alike than it reaches two rounds), and each round's ratio.
Target: the HTTP path at most 10% slower (generated tok/s ratio >= 0.90).

It also prints the CPU time each side used while the workload ran (read from /proc: Linux):
the engine's (in process: this process; over HTTP: the server's child processes), the
server's event loop and the client's. When other jobs keep every core busy, a process group
gets its share of the cores whatever it runs, so the wall-time ratio tends to in-process CPU
over the HTTP path's total; that ratio is printed too, and it moves far less with the load.

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
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np
import torch

from kvpool.cli.bench import DEFAULT_NUM_PAGES, BenchResult, Workload, make_workload, run_workload
from kvpool.cli.http_bench import model_info, run_client, run_requests, session
from kvpool.engine import LLM
from options import positive_int

SRC = Path(__file__).resolve().parents[1] / "src"


class Cpu(NamedTuple):
    """CPU seconds of each side while the workload ran (0 where a side is absent)."""

    engine: float
    server: float
    client: float


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendant_pids(pid: int) -> list[int]:
    """The live descendants of process `pid` (children of every thread, theirs, and so on):
    the server's engine is a child of the forkserver the server started."""
    tasks = Path(f"/proc/{pid}/task")
    children = [int(c) for task in tasks.iterdir()
                for c in (task / "children").read_text().split()]
    return children + [d for child in children for d in descendant_pids(child)]


def in_process(workload: Workload) -> tuple[BenchResult, Cpu]:
    llm = LLM("tiny", num_pages=DEFAULT_NUM_PAGES, seed=workload.seed)
    requests = make_workload(workload, llm.model_config.vocab_size)
    start = time.process_time()
    result = run_workload(llm, requests, show_progress=False)
    return result, Cpu(time.process_time() - start, 0.0, 0.0)


class ServerFailed(RuntimeError):
    """`kvpool serve` exited, or did not answer in time, before the workload ran."""


def over_http(workload: Workload) -> tuple[BenchResult, Cpu]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pythonpath = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryFile() as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "serve", "--model", "tiny",
             "--port", str(port), "--num-pages", str(DEFAULT_NUM_PAGES),
             "--seed", str(workload.seed)],
            env={**os.environ, "PYTHONPATH": pythonpath,
                 "OMP_NUM_THREADS": str(torch.get_num_threads())},
            stderr=stderr)
        try:
            return run_client(_client(f"http://127.0.0.1:{port}", workload, server))
        except ServerFailed as e:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace").splitlines()[-20:]
            sys.exit("\n".join([f"error: {e}; its stderr ends:", *tail]))
        finally:
            server.terminate()
            server.wait(60)


async def _client(url: str, workload: Workload,
                  server: subprocess.Popen) -> tuple[BenchResult, Cpu]:
    async with session(url) as client:
        deadline = time.monotonic() + 120
        while True:
            try:
                info = await model_info(client)
                break
            except aiohttp.ClientConnectionError:
                if server.poll() is not None:
                    raise ServerFailed(f"kvpool serve exited with code {server.returncode} "
                                       f"before answering") from None
                if time.monotonic() > deadline:
                    raise ServerFailed("kvpool serve did not answer in 120 s") from None
                await asyncio.sleep(0.2)
        requests = make_workload(workload, info["vocab_size"])
        engines = descendant_pids(server.pid)
        before = Cpu(sum(map(cpu_seconds, engines)), cpu_seconds(server.pid),
                     time.process_time())
        result = await run_requests(client, info["id"], requests, show_progress=False)
        after = Cpu(sum(map(cpu_seconds, engines)), cpu_seconds(server.pid),
                    time.process_time())
    return result, Cpu(*(a - b for a, b in zip(after, before, strict=True)))


def summary(result: BenchResult) -> tuple[float, float, float, float]:
    """Wall time (s), generated tok/s, TTFT p50 and TPOT p50 (ms) of one run."""
    generated = sum(t.num_output_tokens for t in result.timings)
    ttft = np.percentile([t.ttft for t in result.timings], 50) * 1000
    tpot = np.percentile([t.tpot for t in result.timings if t.tpot is not None], 50) * 1000
    return result.wall_time, generated / result.wall_time, ttft, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=positive_int, default=200)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads of each engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = Workload(args.num_requests)
    runs: dict[str, list[tuple[float, ...]]] = {"in process": [], "HTTP": []}
    tokens, loads = {}, []
    for _ in range(args.rounds):
        for name, run in (("in process", in_process), ("HTTP", over_http)):
            result, cpu = run(workload)
            tokens[name] = sum(t.num_output_tokens for t in result.timings)
            runs[name].append((*summary(result), *cpu))
        loads.append(os.getloadavg()[0])
    assert tokens["in process"] == tokens["HTTP"], tokens
    print(f"kvpool bench workload: {args.num_requests} requests, {tokens['HTTP']:,} generated "
          f"tokens, tiny model, {DEFAULT_NUM_PAGES} pages; median of {args.rounds} "
          f"interleaved rounds; {args.threads} torch thread(s) per engine")
    print(f"{'path':<12}{'wall s':>9}{'gen tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
          f"{'ratio':>8}   CPU s: engine  server  client")
    pairs = list(zip(runs["in process"], runs["HTTP"], strict=True))
    ratios = {"in process": [1.0] * args.rounds,
              "HTTP": [http[1] / local[1] for local, http in pairs]}
    for name, rows in runs.items():
        wall, rate, ttft, tpot, engine, server, client = (
            statistics.median(column) for column in zip(*rows, strict=True))
        print(f"{name:<12}{wall:>9.2f}{rate:>11,.1f}{ttft:>13,.1f}{tpot:>13.1f}"
              f"{statistics.median(ratios[name]):>8.2f}{engine:>16.2f}{server:>8.2f}"
              f"{client:>8.2f}")
    rounds = ", ".join(f"{ratio:.2f} (load {load:.1f})"
                       for ratio, load in zip(ratios["HTTP"], loads, strict=True))
    print(f"ratio: generated tok/s against in process in the same round, median of the rounds "
          f"(target >= 0.90); each round's, with the load average at its end: {rounds}")
    cpu_ratios = [local[4] / sum(http[4:]) for local, http in pairs]
    print(f"CPU ratio: in-process engine CPU over the HTTP path's engine + server + client: "
          f"median {statistics.median(cpu_ratios):.2f}; each round's: "
          f"{', '.join(f'{r:.2f}' for r in cpu_ratios)}")

if __name__ == "__main__":
    main()
