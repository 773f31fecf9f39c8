"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 (a free port, in a
thread) serving an LLM, and reading the engine's state safely between two of its steps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvpool.engine import LLM
from kvpool.server.app import build_app


class RunningServer:
    """A server started by `running_server`: its URL, app, LLM and event loop."""

    def __init__(self, llm: LLM, **options):
        self.llm = llm
        self.app = build_app(llm, model_name="tiny", **options)
        self.engine = self.app.state.server.engine
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
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
        self._uvicorn.should_exit = True
        self._thread.join(30)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             **options)

    def async_client(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                  **options)

    def on_engine(self, fn):
        """fn(llm), run on the engine thread between two steps; its result."""
        return asyncio.run_coroutine_threadsafe(self.engine.call(fn), self.loop).result(30)

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda llm: llm.has_unfinished()) or self.engine.num_requests:
            assert time.monotonic() < deadline, f"the engine still runs after {timeout} s"
            time.sleep(0.02)


@contextlib.contextmanager
def running_server(llm: LLM, **options):
    """Serve `llm` as "tiny" for the duration of the block."""
    server = RunningServer(llm, **options)
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
