"""`kvpool bench --url`: the seeded workload of `kvpool bench`, sent to a running server as
streamed completions, timed by the client.

The client is aiohttp, whose HTTP parser is compiled: on a small machine the client shares
the cores with the server, and on the default workload httpx took 1.9-2.6 s of CPU time
where aiohttp takes 0.7-0.9 s (httpx parses in Python, and its connection pool scans every
connection for every request).

Each request is sent at its arrival time as token ids, with the same max_tokens and
ignore_eos as in-process. TTFT runs from the arrival to the first chunk that carries text,
TPOT from there to the end over the generated tokens (from the usage chunk) less one. So a
stream's events are decoded up to the first text and the last (the usage, or the server's
error), not the deltas in between: on the default workload that took the client from
0.70-0.72 s of CPU time to 0.58-0.60 s. The server's preemptions and prefix-cache counters
are read from /metrics before and after (a disaggregated server's two engines' added).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from tqdm import tqdm

from kvpool.cli.bench import BenchRequest, BenchResult, RequestTiming, _percentiles_ms
from kvpool.errors import ServerFailed


def run_client(coroutine):
    """Run the client on uvloop when it is installed (the server extra brings it): the
    client shares the cores with the server, and uvloop takes less of them."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def session(url: str, api_key: str | None = None) -> aiohttp.ClientSession:
    """A client session for the server at `url` (under a path too, as behind a proxy), with
    `api_key` as its bearer token: no limit on connections, no timeout. A URL of the API's
    root (`.../v1`, as `kvpool serve` prints it and OpenAI clients take it) names its server."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    base = url.rstrip("/").removesuffix("/v1")
    return aiohttp.ClientSession(base + "/", connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None), headers=headers)


async def model_info(client: aiohttp.ClientSession) -> dict:
    """The served model's /v1/models entry (id, max_model_len, vocab_size)."""
    async with client.get("v1/models") as response:
        await _check(response)
        return (await response.json())["data"][0]


async def scrape(client: aiohttp.ClientSession) -> dict[str, float]:
    """The samples of /metrics by name (`samples_by_name`)."""
    async with client.get("metrics") as response:
        await _check(response)
        return samples_by_name(await response.text())


def samples_by_name(text: str) -> dict[str, float]:
    """The samples of Prometheus `text` by name, those of one name added over their labels
    (a disaggregated server's engine series have one per side)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.partition("{")[0]
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


async def run_requests(client: aiohttp.ClientSession, model: str, requests: list[BenchRequest],
                       *, show_progress: bool = True) -> BenchResult:
    """Send every request at its arrival time and time its stream; returns the timings
    and the wall time (no per-step stats: the engine runs elsewhere)."""
    result = BenchResult([RequestTiming(r.arrival) for r in requests])
    start = time.perf_counter()
    with tqdm(total=len(requests), unit="req", desc="bench", file=sys.stderr,
              disable=not show_progress) as bar:
        async def one(request: BenchRequest, timing: RequestTiming) -> None:
            await asyncio.sleep(request.arrival - (time.perf_counter() - start))
            await _stream(client, model, request, timing, start)
            bar.update(1)

        await asyncio.gather(*(one(r, t) for r, t in zip(requests, result.timings,
                                                          strict=True)))
    result.wall_time = time.perf_counter() - start
    return result


async def _stream(client: aiohttp.ClientSession, model: str, request: BenchRequest,
                  timing: RequestTiming, start: float) -> None:
    body = {"model": model, "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.post("v1/completions", json=body) as response:
        await _check(response)
        pending, last = b"", None  # bytes of an event not complete yet; the last data event
        async for data in response.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):  # the end: data: [DONE]
                    continue
                last = event
                if timing.first_token is None and any(
                        c.get("text") for c in json.loads(event[6:]).get("choices", ())):
                    timing.first_token = time.perf_counter() - start
    # After the first text only the last event counts: the usage, or the server's error.
    if last is None:
        raise ServerFailed("the server's stream ended without an event")
    chunk = json.loads(last[6:])
    if "error" in chunk:
        raise ServerFailed(f"the server failed a request: {chunk['error']['message']}")
    timing.num_output_tokens = chunk["usage"]["completion_tokens"]
    timing.finish = time.perf_counter() - start
    if timing.first_token is None:  # every token was held back until the end
        timing.first_token = timing.finish


async def _check(response: aiohttp.ClientResponse) -> None:
    """ServerFailed naming the status and the body unless the server answered 200."""
    if response.status != 200:
        raise ServerFailed(f"{response.method} {response.url.path}: the server answered "
                           f"{response.status}: {await response.text()}")


def summary_rows(requests: list[BenchRequest], result: BenchResult,
                 before: dict[str, float], after: dict[str, float]) -> list[tuple[str, str]]:
    """The rows of `kvpool bench` that a client can measure, and the server's counters."""
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    num_generated = sum(t.num_output_tokens for t in result.timings)
    wall = result.wall_time
    tpots = [t.tpot for t in result.timings if t.tpot is not None]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries, hits = delta("kvpool_prefix_cache_queries_total"), delta(
        "kvpool_prefix_cache_hits_total")
    return [
        ("requests", f"{len(requests):,}"),
        ("prompt tokens", f"{num_prompt:,}"),
        ("generated tokens", f"{num_generated:,}"),
        ("wall time", f"{wall:.2f} s ({delta('kvpool_engine_steps_total'):,.0f} steps)"),
        ("generated tok/s", f"{num_generated / wall:,.1f}"),
        ("total tok/s", f"{(num_prompt + num_generated) / wall:,.1f}"),
        ("TTFT p50 / p99", _percentiles_ms([t.ttft for t in result.timings])),
        ("TPOT p50 / p99", _percentiles_ms(tpots)),
        ("prefix hit rate", f"{hits / queries:.1%} ({hits:,.0f} of {queries:,.0f} looked-up "
                            f"prompt tokens)" if queries else "n/a"),
        ("preemptions", f"{delta('kvpool_preemptions_total'):,.0f}"),
    ]


async def bench_url(url: str, requests_for_model, *, api_key: str | None = None,
                    show_progress: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """Run the workload `requests_for_model(vocab_size, max_model_len)` against the server
    at `url` (with `api_key`, for a server that asks one); returns the model's name and the
    summary rows."""
    async with session(url, api_key) as client:
        info = await model_info(client)
        requests = requests_for_model(info["vocab_size"], info["max_model_len"])
        before = await scrape(client)
        result = await run_requests(client, info["id"], requests,
                                    show_progress=show_progress)
        after = await scrape(client)
    return info["id"], summary_rows(requests, result, before, after)
