"""The server under 64 concurrent streaming clients, some leaving early: every request is
accounted for, the cache stays consistent, and no page is held once they are done. A client
that disconnects, streamed or not, aborts its request, whose pages come back before the next
step."""

import asyncio
import json
import random
import socket
import time
from functools import partial

import pytest

from engine_probes import cache_stats, check_cache, num_steps, used_pages
from kvpool.engine import LLM, SamplingParams
from kvpool.server.engine_loop import EngineLoop
from server_util import metrics, running_server

NUM_CLIENTS = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(device):
    with running_server(partial(LLM, "tiny", num_pages=512, device=device)) as server:
        yield server


def test_64_streaming_clients_some_leaving_early_are_all_accounted_for(server):
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [(system if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randint(4, 40))]
               for i in range(NUM_CLIENTS)]
    leaving = set(range(0, NUM_CLIENTS, 4))
    before = metrics(server)

    async def one(client, i):
        stream = await client.completions.create(
            model="tiny", prompt=prompts[i], stream=True, stream_options={"include_usage": True},
            max_tokens=1000 if i in leaving else MAX_TOKENS, extra_body={"ignore_eos": True})
        text, finish_reason = "", None
        async for chunk in stream:
            if i in leaving:
                await stream.close()
                return "left"
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            else:
                assert chunk.usage.completion_tokens == MAX_TOKENS
        return finish_reason

    async def all_clients():
        client = server.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    results = asyncio.run(all_clients())
    assert results == ["left" if i in leaving else "length" for i in range(NUM_CLIENTS)]
    server.wait_idle()
    server.on_engine(check_cache)
    stats = server.on_engine(cache_stats)
    assert (stats.num_used_pages, stats.num_sequences) == (0, 0)
    after = metrics(server)
    for reason, count in (("length", NUM_CLIENTS - len(leaving)), ("abort", len(leaving))):
        key = "kvpool_requests_total", (("finish_reason", reason),)
        assert after[key] - before.get(key, 0) == count


def test_a_client_that_disconnects_aborts_its_request(server):
    steps = server.on_engine(num_steps)
    client = server.client()
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=2000,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert server.on_engine(used_pages) > 0
    stream.close()
    server.wait_idle()
    assert server.on_engine(used_pages) == 0
    assert server.on_engine(num_steps) - steps < 2000  # the engine did not run it to its end


def test_a_client_that_leaves_a_whole_response_aborts_its_request(server):
    before, steps = metrics(server), server.on_engine(num_steps)
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    deadline = time.monotonic() + 30
    while not server.on_engine(used_pages):
        assert time.monotonic() < deadline, "the request did not start in 30 s"
        time.sleep(0.01)
    sock.close()
    server.wait_idle()
    assert server.on_engine(used_pages) == 0
    assert server.on_engine(num_steps) - steps < 2000  # the engine did not run it to its end
    key = "kvpool_requests_total", (("finish_reason", "abort"),)
    assert metrics(server)[key] - before.get(key, 0) == 1
    assert metrics(server)["kvpool_generation_tokens_total", ()] - before[
        "kvpool_generation_tokens_total", ()] < 2000


def test_an_abort_gives_the_pages_back_before_the_next_step(server):
    engine: EngineLoop = server.engine  # driven directly, on the server's event loop

    async def main():
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        stream = await engine.add("a", [256, *b"Hello"], params)
        await stream.get()
        engine.abort("a")
        # Commands run in the order sent, between two steps: this one runs after the abort.
        pages = await engine.call(used_pages)
        steps = await engine.call(num_steps)
        await asyncio.sleep(0.1)
        return pages, await engine.call(num_steps) - steps

    server.wait_idle()
    pages, steps_later = asyncio.run_coroutine_threadsafe(main(), server.loop).result(30)
    assert pages == 0
    assert steps_later == 0  # the aborted request takes no step once its abort has run
