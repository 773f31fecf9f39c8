"""`kvpool bench`: a model under a synthetic serving workload, driven through the step API.

Prompt and output lengths are long-tailed (lognormal, capped) like ShareGPT's; some prompts
start with one of a few shared system prompts, so the prefix cache has something to hit.
Each request is timed from its arrival: TTFT (arrival -> first generated token) and TPOT
((finish - first token) / (output tokens - 1)). The pool is sampled after every step.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvpool.cli.kv_flags import add_kv_arguments, kv_options
from kvpool.cli.parallel_flag import add_tensor_parallel_argument
from kvpool.cli.reply import request_error
from kvpool.cli.serve import api_keys
from kvpool.cli.step_flags import add_step_arguments, step_options
from kvpool.cli.tier_flags import add_tier_arguments, tier_options
from kvpool.engine import LLM, EngineStats, SamplingParams
from kvpool.errors import KVPoolError, check_int
from kvpool.formats import format_bytes, format_table

DEFAULT_NUM_REQUESTS = 200
# Small enough that the default workload's peak demand exceeds it (and preempts).
DEFAULT_NUM_PAGES = 384
DEFAULT_PLOT = "kvpool-bench.png"
MAX_ARRIVAL_SPAN = 86_400  # seconds: mean arrival time of the last request, at most a day
# The workload is built before the run: about 2 KB a request at the default lengths.
MAX_NUM_REQUESTS = 1_000_000


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Lengths in tokens: lognormal with this median and sigma, clipped to [1, maximum]."""

    median: int
    sigma: float
    maximum: int

    def draw(self, rng: random.Random) -> int:
        """One length (tokens)."""
        return min(self.maximum, max(1, round(rng.lognormvariate(math.log(self.median),
                                                                 self.sigma))))

    def with_median(self, median: int) -> LogNormal:
        """The same shape moved to `median`: the cap keeps its ratio to the median."""
        if median < 1:
            raise ValueError(f"a median length must be >= 1 token, got {median}")
        return LogNormal(median, self.sigma, max(1, round(self.maximum * median / self.median)))


PROMPT_LEN = LogNormal(median=100, sigma=1.0, maximum=1000)
OUTPUT_LEN = LogNormal(median=50, sigma=1.0, maximum=400)


@dataclass(frozen=True, slots=True)
class Workload:
    """The shape of a synthetic workload. A fraction `shared_fraction` of the prompts start
    with one of `num_system_prompts` system prompts of `system_prompt_len` (min, max) tokens;
    every prompt then has a user part drawn from `prompt_len`. `request_rate` is the mean
    arrivals per second (Poisson); infinity puts every arrival at t=0."""

    num_requests: int = DEFAULT_NUM_REQUESTS
    prompt_len: LogNormal = PROMPT_LEN
    output_len: LogNormal = OUTPUT_LEN
    shared_fraction: float = 0.3
    num_system_prompts: int = 5
    system_prompt_len: tuple[int, int] = (64, 256)
    request_rate: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("num_requests", self.num_requests, 1, MAX_NUM_REQUESTS)
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s, got {self.request_rate}")
        span = self.num_requests / self.request_rate
        if span > MAX_ARRIVAL_SPAN:
            raise ValueError(f"request_rate {self.request_rate:g}/s spreads {self.num_requests} "
                             f"requests over {span:.3g} s on average; a bench run may span "
                             f"{MAX_ARRIVAL_SPAN:,} s at most (rate >= "
                             f"{self.num_requests / MAX_ARRIVAL_SPAN:.3g}/s)")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: `arrival` in seconds after the start; `system_prompt` is
    the index of the shared prompt it starts with, or None."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float
    system_prompt: int | None


def make_workload(workload: Workload, vocab_size: int,
                  max_model_len: int | None = None) -> list[BenchRequest]:
    """The requests of `workload`, in arrival order, with token ids in [0, vocab_size).
    Lengths, system prompts and arrivals depend on the seed only, not on the vocabulary.
    With `max_model_len`, a request whose drawn lengths pass it is cut to fit (its user
    prompt first, then its output), so that the tail never fails a run."""
    rng = random.Random(workload.seed)
    lo, hi = workload.system_prompt_len
    system_lens = [rng.randint(lo, hi) for _ in range(workload.num_system_prompts)]
    shapes, arrival = [], 0.0
    for _ in range(workload.num_requests):
        shared = rng.random() < workload.shared_fraction
        system = rng.randrange(workload.num_system_prompts) if shared else None
        shapes.append((system, workload.prompt_len.draw(rng), workload.output_len.draw(rng),
                       arrival))
        if math.isfinite(workload.request_rate):
            arrival += rng.expovariate(workload.request_rate)
    tokens = random.Random(workload.seed + 1)
    systems = [_random_tokens(tokens, n, vocab_size) for n in system_lens]
    if max_model_len is not None:
        shapes = [_fit(s, system_lens[s] if s is not None else 0, user_len, output_len, t,
                       max_model_len) for s, user_len, output_len, t in shapes]
    return [BenchRequest((systems[s] if s is not None else []) +
                         _random_tokens(tokens, user_len, vocab_size), output_len, t, s)
            for s, user_len, output_len, t in shapes]


def _fit(system: int | None, system_len: int, user_len: int, output_len: int, arrival: float,
         max_model_len: int) -> tuple[int | None, int, int, float]:
    """A request's shape cut to `max_model_len` tokens: its user prompt, then its output
    (at least one token each), without its system prompt if that leaves no room for them."""
    if system_len + 2 > max_model_len:
        system, system_len = None, 0
    room = max_model_len - system_len
    user_len = max(1, min(user_len, room - output_len))
    return system, user_len, max(1, min(output_len, room - user_len)), arrival


def check_lengths(workload: Workload, max_model_len: int) -> None:
    """ValueError when a request of the median lengths does not fit in `max_model_len`
    tokens: most of the workload could never run (and its prompts are built first)."""
    prompt, output = workload.prompt_len.median, workload.output_len.median
    if prompt + output > max_model_len:
        raise ValueError(f"--prompt-len {prompt} + --output-len {output} = "
                         f"{prompt + output:,} tokens, over the model's max_model_len "
                         f"{max_model_len:,}")


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


@dataclass(slots=True)
class RequestTiming:
    """When one request arrived, got its first token and finished (seconds after the start),
    how many tokens it generated, and why the engine failed it (finish reason "error"), if
    it did."""

    arrival: float
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    error: KVPoolError | None = None

    @property
    def failed(self) -> bool:
        """Whether the engine failed the request."""
        return self.error is not None

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds); None without one, or for a failed request."""
        if self.failed or self.first_token is None:
            return None
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (seconds); None for a single token, or for
        a failed request."""
        if self.failed or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class BenchResult:
    """What a run measured: per-request timings, the engine's stats after every step, and
    the run's wall time (seconds)."""

    timings: list[RequestTiming]
    steps: list[EngineStats] = field(default_factory=list)
    wall_time: float = 0.0


def run_workload(llm: LLM, requests: list[BenchRequest], *,
                 show_progress: bool = True) -> BenchResult:
    """Add each request at its arrival time, step the engine until every request is done,
    and time them. Progress (requests done, generated tok/s) goes to stderr. A request that
    could never fit the pool (or max_model_len) raises before the run, as the engine would
    at its arrival: a late one would end the run there, its measurements lost."""
    for num_prompt, max_tokens in dict.fromkeys((len(r.prompt_token_ids), r.max_tokens)
                                                for r in requests):
        llm.scheduler.check_length(num_prompt, max_tokens)
    result = BenchResult([RequestTiming(r.arrival) for r in requests])
    pending = deque(enumerate(requests))
    index_of: dict[str, int] = {}
    start = time.perf_counter()
    with tqdm(total=len(requests), unit="req", desc="bench", file=sys.stderr,
              disable=not show_progress) as bar:
        while pending or llm.has_unfinished():
            now = time.perf_counter() - start
            _add_arrived(llm, pending, index_of, now)
            if not llm.has_unfinished():
                time.sleep(pending[0][1].arrival - now)
                continue
            outputs = llm.step()
            now = time.perf_counter() - start
            result.steps.append(llm.stats())
            for output in outputs:
                timing = result.timings[index_of[output.request_id]]
                timing.num_output_tokens = len(output.outputs[0].token_ids)
                if timing.first_token is None and timing.num_output_tokens:
                    timing.first_token = now
                if output.finished:
                    timing.finish = now
                    timing.error = request_error(output)
                    bar.update(1)
            rate = result.steps[-1].num_generated_tokens / now
            bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
    result.wall_time = time.perf_counter() - start
    return result


def _add_arrived(llm: LLM, pending: deque[tuple[int, BenchRequest]],
                 index_of: dict[str, int], now: float) -> None:
    """Add the pending requests that have arrived by `now` (seconds after the start),
    recording which request each engine request id is."""
    while pending and pending[0][1].arrival <= now:
        i, request = pending.popleft()
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        index_of[llm.add_request(request.prompt_token_ids, params)] = i


def summary_rows(llm: LLM, requests: list[BenchRequest],
                 result: BenchResult) -> list[tuple[str, str]]:
    """(label, value) rows summarizing a run of `requests` on `llm`. The tokens, throughput,
    TTFT and TPOT are those of the requests that did not fail; failed ones get a row of
    their own."""
    final = result.steps[-1]
    cache = llm.cache.stats()
    done = [(r, t) for r, t in zip(requests, result.timings, strict=True) if not t.failed]
    num_failed = len(requests) - len(done)
    num_prompt = sum(len(r.prompt_token_ids) for r, _ in done)
    num_generated = sum(t.num_output_tokens for _, t in done)
    num_pages = cache.num_pages
    peak = max(s.num_used_pages for s in result.steps)
    wall = result.wall_time
    hit_rate = (f"{cache.prefix_hit_rate:.1%} ({cache.prefix_hit_tokens:,} of "
                f"{cache.prefix_query_tokens:,} looked-up prompt tokens)"
                if llm.cache.prefix_cache else "off")
    return [
        ("requests", f"{len(requests):,}"),
        *([("failed requests", f"{num_failed:,} (not in the tokens, throughput, TTFT and TPOT)")]
          if num_failed else []),
        ("prompt tokens", f"{num_prompt:,} ({final.num_prompt_tokens:,} computed by prefill)"),
        ("generated tokens", f"{num_generated:,}"),
        ("wall time", f"{wall:.2f} s ({final.num_steps:,} steps)"),
        ("generated tok/s", f"{num_generated / wall:,.1f}"),
        ("total tok/s", f"{(num_prompt + num_generated) / wall:,.1f}"),
        ("TTFT p50 / p99", _percentiles_ms([t.ttft for t in result.timings])),
        ("TPOT p50 / p99", _percentiles_ms([t.tpot for t in result.timings])),
        ("peak pages used", f"{peak:,} ({peak / num_pages:.0%} of the pool)"),
        ("pool pages", _pool_summary(llm)),
        ("KV utilization", f"{np.mean([s.kv_utilization for s in result.steps]):.1%} "
                           f"(filled slots of used pages, mean over steps)"),
        ("prefix hit rate", hit_rate),
        ("tier pages", _tier_summary(llm)),
        ("preemptions", f"{final.num_preemptions:,}"),
    ]


def _pool_summary(llm: LLM) -> str:
    """The pool's pages and tokens, and the bytes of all its layer groups' pools; with
    several groups, the pages of each and the tokens of the first (full attention)."""
    groups, page_size = llm.cache.page_groups, llm.cache.page_size
    pages = " + ".join(f"{group.allocator.num_pages:,} {group.name}" for group in groups) \
        if len(groups) > 1 else f"{groups[0].allocator.num_pages:,}"
    tokens = groups[0].allocator.num_pages * page_size
    return (f"{pages} x {page_size} tokens = {tokens:,} tokens "
            f"({format_bytes(llm.cache.kv_pools.nbytes)})")


def _tier_summary(llm: LLM) -> str:
    """Pages the engine's tier stored, loaded, missed and dropped; "off" without one."""
    option = llm.config.tier_option
    if option is None:
        return "off"
    e = llm.stats()
    return (f"{e.num_tier_stores:,} stored, {e.num_tier_loads:,} loaded, "
            f"{e.num_tier_misses:,} missed, {e.num_tier_dropped:,} dropped ({option})")


def _percentiles_ms(seconds: list[float | None]) -> str:
    """"p50 / p99 ms" of durations in seconds, None (no figure) left out; "n/a" when there
    are none."""
    seconds = [s for s in seconds if s is not None]
    if not seconds:
        return "n/a"
    p50, p99 = np.percentile(seconds, [50, 99]) * 1000
    return f"{p50:,.1f} / {p99:,.1f} ms"


def plot_available() -> bool:
    """True when matplotlib (the `plot` extra) can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def check_plot_path(path: str) -> None:
    """ValueError when the plot could not be written at `path` (a .png file in a writable
    folder), checked before the run that it comes after."""
    folder = os.path.dirname(path) or "."
    if os.path.splitext(path)[1].lower() != ".png":
        raise ValueError(f"--plot {path!r} is not the path of a .png file")
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path!r}: no folder {folder!r}")
    if os.path.isdir(path):
        raise ValueError(f"--plot {path!r} is a folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path!r}: folder {folder!r} is not writable")


def write_plot(result: BenchResult, path: str, title: str) -> None:
    """Write a PNG of the pool's used, cached and free pages after each step (stacked areas).
    Needs matplotlib."""
    from matplotlib.figure import Figure

    used = [s.num_used_pages for s in result.steps]
    cached = [s.num_cached_pages for s in result.steps]
    free = [s.num_free_pages for s in result.steps]
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.stackplot(range(len(used)), used, cached, free, colors=["#d62728", "#1f77b4", "#dddddd"],
                 labels=["used (live sequences)", "cached (prefix cache, evictable)", "free"])
    ax.set(xlabel="step", ylabel="pages", title=title, xlim=(0, max(len(used) - 1, 1)),
           ylim=(0, used[0] + cached[0] + free[0]))
    fig.legend(loc="outside lower center", ncols=3)
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool bench`."""
    parser.add_argument("--model", default="tiny", metavar="PATH",
                        help="checkpoint folder or 'tiny' (default: tiny)")
    parser.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, metavar="N",
                        help=f"requests in the workload (default: {DEFAULT_NUM_REQUESTS})")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN.median,
                        metavar="TOKENS", help="median user prompt length, capped at 10x "
                                               "(default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN.median,
                        metavar="TOKENS", help="median output length, capped at 8x "
                                               "(default: %(default)s)")
    parser.add_argument("--request-rate", type=float, default=math.inf, metavar="PER_SECOND",
                        help="Poisson arrivals per second (default: inf, all at t=0)")
    parser.add_argument("--page-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per page (default: 16)")
    parser.add_argument("--num-pages", type=int, default=DEFAULT_NUM_PAGES, metavar="PAGES",
                        help=f"pool size (default: {DEFAULT_NUM_PAGES}, less than the default "
                             f"workload's peak demand, so it preempts)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn the prefix cache off")
    add_kv_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, metavar="N",
                        help="running sequences at most (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS",
                        help="tokens per forward at most (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the workload and the sampling (default: 0)")
    add_step_arguments(parser)
    add_tier_arguments(parser)
    add_tensor_parallel_argument(parser)
    parser.add_argument("--url", metavar="URL",
                        help="send the workload to a running `kvpool serve` at URL (e.g. "
                             "http://127.0.0.1:8000, or its API root .../v1) through HTTP "
                             "streaming instead; the engine options are the server's then")
    parser.add_argument("--api-key", metavar="KEY",
                        help="with --url: the server's API key (default: the first key of "
                             "$KVPOOL_API_KEY, comma-separated as `kvpool serve` reads it)")
    plot = parser.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="PATH",
                      help=f"PNG of the pool over the engine's steps (default: {DEFAULT_PLOT}; "
                           f"needs matplotlib; not with --url)")
    plot.add_argument("--no-plot", action="store_true", help="write no plot")


def run(args: argparse.Namespace) -> int:
    """Run the workload, print the summary table and write the plot; 1 when the engine
    failed a request (the first one's error on stderr)."""
    if args.url:
        return run_url(args)
    path = None if args.no_plot else args.plot or DEFAULT_PLOT
    workload = Workload(args.num_requests, PROMPT_LEN.with_median(args.prompt_len),
                        OUTPUT_LEN.with_median(args.output_len),
                        request_rate=args.request_rate, seed=args.seed)
    if path is not None:
        check_plot_path(path)
    options = {"max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, **step_options(args)}
    llm = LLM(args.model, page_size=args.page_size, num_pages=args.num_pages,
              prefix_caching=not args.no_prefix_caching, seed=args.seed,
              **kv_options(args), **tier_options(args),
              tensor_parallel_size=args.tensor_parallel_size,
              **{name: value for name, value in options.items() if value is not None})
    with llm:
        check_lengths(workload, llm.max_model_len)
        requests = make_workload(workload, llm.model_config.vocab_size, llm.max_model_len)
        result = run_workload(llm, requests)
    rows = [("model", args.model), *summary_rows(llm, requests, result)]
    plot = path is not None and plot_available()
    if path is not None:
        rows.append(("plot", path if plot else "pip install 'kvpool[plot]' (matplotlib) "
                                               "for a PNG of the pool over the steps"))
    print(format_table(rows))
    if plot:
        write_plot(result, path, f"kvpool bench: {args.model}, {len(requests)} requests, "
                                      f"{args.num_pages} pages of {args.page_size} tokens")
    failed = [t.error for t in result.timings if t.failed]
    if failed:
        print(f"kvpool bench: {len(failed):,} of {len(requests):,} requests failed; the "
              f"first: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def run_url(args: argparse.Namespace) -> int:
    """`kvpool bench --url`: the same seeded workload sent to a running server through
    HTTP streaming; prints the table's client-side rows and the server's counters."""
    from kvpool.cli.http_bench import bench_url, run_client

    if args.plot is not None:
        raise ValueError(f"--plot {args.plot!r}: the plot shows the pool over the engine's "
                         f"steps, which a run against --url cannot see")
    keys = api_keys(None if args.api_key is None else [args.api_key])
    workload = Workload(args.num_requests, PROMPT_LEN.with_median(args.prompt_len),
                        OUTPUT_LEN.with_median(args.output_len),
                        request_rate=args.request_rate, seed=args.seed)

    def requests_for(vocab_size: int, max_model_len: int) -> list[BenchRequest]:
        check_lengths(workload, max_model_len)
        return make_workload(workload, vocab_size, max_model_len)

    model, rows = run_client(bench_url(args.url.rstrip("/"), requests_for,
                                       api_key=keys[0] if keys else None))
    print(format_table([("model", model), ("url", args.url), *rows]))
    return 0
