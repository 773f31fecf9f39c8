"""The engine loop: one background thread owns the LLM and drives it step by step; the HTTP
handlers, on the asyncio event loop, only submit and abort requests and read their outputs.

Handlers put commands on a thread-safe queue; the thread runs every queued command before
each step, so an abort gives its pages back before the next step runs. Each step's outputs
go back to the event loop in one `call_soon_threadsafe`, into one queue per request. An
exception inside a step fails the requests in flight (their streams get an EngineFailure)
and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import abc
from typing import Any

from kvpool.engine import LLM, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class ServerBusy(Exception):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class EngineStopped(Exception):
    """The server is shutting down and takes no new request (HTTP 503)."""


class EngineFailure(Exception):
    """A step raised; the requests in flight fail with this (HTTP 500)."""


class RequestStream:
    """The outputs of one request as the engine produces them. Each RequestOutput holds
    the request's whole state so far, so a reader that falls behind gets the latest one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._outputs: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()

    def put(self, item: RequestOutput | EngineFailure) -> None:
        """Called on the event loop by the engine thread's hand-off."""
        self._outputs.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The latest output (waits for one); raises EngineFailure if the engine failed."""
        item = await self._outputs.get()
        while not self._outputs.empty():
            item = self._outputs.get_nowait()
        if isinstance(item, EngineFailure):
            raise item
        return item


class EngineLoop:
    """Runs `llm` in a background thread. `max_waiting`: sequences that may wait for a
    seat (the scheduler's waiting queue); a request beyond it raises ServerBusy."""

    def __init__(self, llm: LLM, *, max_waiting: int):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.llm = llm
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[abc.Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # unfinished requests; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def num_requests(self) -> int:
        """Requests the engine holds (waiting or running)."""
        return len(self._streams)

    # ---- event-loop side ---------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._thread.start()

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams) -> RequestStream:
        """Queue a request; returns its stream once the engine took it. Raises what
        `LLM.add_request` raises (SequenceTooLong, OutOfPages, ValueError), ServerBusy or
        EngineStopped, and then the engine holds nothing of it."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        stream = RequestStream(request_id)
        await self._submit(lambda: self._add(stream, prompt_token_ids, params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it finished); its pages come back before the next step."""
        self._commands.put(lambda: self._abort(request_id))

    async def call(self, fn: abc.Callable[[LLM], Any]) -> Any:
        """Run `fn(llm)` on the engine thread between two steps; return its result."""
        return await self._submit(lambda: fn(self.llm))

    async def stop(self) -> None:
        """Take no new request, abort those in flight, and end the thread."""
        self._stopping = True
        self._commands.put(self._abort_all)
        await asyncio.to_thread(self._thread.join)

    async def _submit(self, command: abc.Callable[[], Any]) -> Any:
        """Run `command` on the engine thread; its result or exception comes back here."""
        future = self._loop.create_future()

        def run() -> None:
            try:
                result = command()
            except Exception as e:  # the caller gets it (a refusal, or a failed check)
                self._loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not (self._stopping and not self._streams):
            self._run_commands(block=not self.llm.has_unfinished())
            if self.llm.has_unfinished():
                self._step()

    def _run_commands(self, *, block: bool) -> None:
        """Run the queued commands; when `block`, wait for the first one."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # an abort that failed: log it, keep the loop alive
                logger.exception("an engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:
            logger.exception("a step failed; the requests in flight fail with it")
            self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        handoff = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                del self._streams[output.request_id]
            handoff.append((stream, output))
        self._loop.call_soon_threadsafe(_deliver, handoff)

    def _add(self, stream: RequestStream, prompt_token_ids: list[int],
             params: SamplingParams) -> None:
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        waiting = self.llm.stats().num_waiting
        if waiting + params.n > self.max_waiting:
            raise ServerBusy(f"{waiting} sequences wait already; this request's {params.n} "
                             f"would pass max_waiting {self.max_waiting}")
        self.llm.add_request(prompt_token_ids, params, request_id=stream.request_id)
        self._streams[stream.request_id] = stream

    def _abort(self, request_id: str) -> None:
        output = self.llm.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if output is not None and stream is not None:
            self._loop.call_soon_threadsafe(_deliver, [(stream, output)])

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id)

    def _fail_all(self, failure: EngineFailure) -> None:
        """Abort every request in flight and hand each stream the failure."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            self.llm.abort(stream.request_id)
        self._loop.call_soon_threadsafe(_deliver, [(s, failure) for s in streams])


def _deliver(handoff: list[tuple[RequestStream | None, RequestOutput | EngineFailure]]) -> None:
    for stream, item in handoff:
        if stream is not None:
            stream.put(item)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():  # the handler went away (client disconnected)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
