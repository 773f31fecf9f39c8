"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 (a free port, in a
thread) serving an LLM in its engine process, and reading the engine's state between two of
its steps with the probes of engine_probes.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_probes import has_unfinished
from kvpool.engine import LLM
from kvpool.server.app import build_app
from kvpool.server.listener import DrainingServer

if TYPE_CHECKING:
    import openai  # imported by the clients' methods: a second of every collection else


class RunningServer:
    """A server started by `running_server`: its URL, app, engine loop and event loop.
    `shutdown_timeout`: how long `stop` lets requests in flight finish."""

    def __init__(self, make_llm: Callable[[], LLM], shutdown_timeout: float = 5.0,
                 **options):
        self.app = build_app(make_llm, model_name="tiny", **options)
        self.engine = self.app.state.server.engine
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._uvicorn = DrainingServer(self.app, shutdown_timeout=shutdown_timeout)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self._uvicorn.serve(sockets=[self._socket])

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.02)

    def stop(self) -> None:
        """Shut down as on SIGTERM: drain, then stop the engine; waits for it."""
        self._uvicorn.should_exit = True
        self._thread.join(30)

    def client(self, **options) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             **options)

    def async_client(self, **options) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                  **options)

    def on_engine(self, fn):
        """fn(llm), run in the engine process between two steps; its result."""
        return asyncio.run_coroutine_threadsafe(self.engine.call(fn), self.loop).result(30)

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while self.on_engine(has_unfinished) or self.engine.num_requests:
            assert time.monotonic() < deadline, f"the engine still runs after {timeout} s"
            time.sleep(0.02)


@contextlib.contextmanager
def running_server(make_llm: Callable[[], LLM], **options):
    """Serve the LLM `make_llm()` builds (in the engine process) as "tiny" for the duration
    of the block."""
    server = RunningServer(make_llm, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def metrics(server: RunningServer) -> dict:
    """{(sample name, sorted labels): value} of /metrics, parsed by prometheus_client."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
