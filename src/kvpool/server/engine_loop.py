"""The engine loop: a child process owns the LLM and drives it step by step; the HTTP
handlers, on the server's event loop, only submit and abort requests and read their updates.

The engine runs in its own process because it is Python code for the most part: sharing one
interpreter with the event loop, the two took turns holding its lock, and each step waited
while the event loop formatted and wrote the chunks of the one before. In its own process the
engine steps while the server writes.

Two pipes of small messages join them. The server sends commands (add, abort, call, stop)
through a writer thread, so the event loop never waits on a full pipe; the engine runs every
queued command before each step, so an abort gives its pages back before the next step runs.
After each step the engine sends one message with the news of every request that advanced:
per sample, its text from where the text sent before could still change (a trailing U+FFFD
may become a character), its token count (not its token ids) and finish reason. Plain tuples
and text deltas keep that message cheap to pickle on both sides: at 100 requests, a step's
message as NamedTuples with whole texts took 1.1 ms to pickle and 0.7 ms to unpickle, as
tuples with deltas 0.1 ms each. The event loop reads it when the pipe is readable and hands
each request an Update. An exception inside a step fails the requests in flight (their
streams get an EngineFailure), but not those the step finished (the next step() hands them
out), and the engine goes on serving; an engine that can serve no more (EngineDied: a side of
a DisaggregatedLLM is gone) ends its loop and process. A call's function is pickled apart
from the command, so that one the engine cannot unpickle fails that call alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import threading
from collections import abc
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from kvpool.engine import LLM, RequestOutput, SamplingParams, TokenLogprobs
from kvpool.engine.parallel import process_context
from kvpool.errors import EngineDied, OutOfPages
from kvpool.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
# How long stopping waits for the engine process to end by itself, then once terminated.
STOP_SECONDS = 10.0
# How often an idle engine checks that it can still serve (LLM.alive).
IDLE_CHECK_SECONDS = 1.0


class ServerBusy(Exception):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class EngineStopped(Exception):
    """The server is shutting down and takes no new request (HTTP 503)."""


class EngineExited(EngineStopped):
    """The engine process has exited: the server will serve nothing again (HTTP 503, with no
    Retry-After, and /health answers 503 too)."""


class EngineFailure(Exception):
    """A step raised, or the server stops: the requests in flight fail with this (HTTP
    `status`: 500, or 503 when the server is shutting down)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class EngineInfo(NamedTuple):
    """What the server needs of the engine's model: its tokenizer (None: token ids only),
    its context length and its vocabulary size (tokens), the sequences it runs at once, and
    the most tokens (prompt + generated) one sequence can hold: max_model_len, or less when
    the pool holds fewer."""

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_sequence_tokens: int


class Sample(NamedTuple):
    """One sample of an Update: its decoded text so far, its generated tokens (a count),
    its finish reason (None while it runs) and the log-probabilities of the tokens it got
    since the previous update (None when the request did not ask for them). The engine
    sends it as the tuple (index, start, text[start:], num_tokens, finish_reason,
    new_logprobs). `earlier`: for the updates a reader that fell behind skipped, in order,
    (characters, tokens): the length of the text less its trailing U+FFFD, and the token
    count (where a stop string ends decides the tokens a choice counts)."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None
    new_logprobs: list[TokenLogprobs] | None
    earlier: list[tuple[int, int]] | None = None


class Update(NamedTuple):
    """A request's state after a step or an abort: a RequestOutput without its token ids,
    which would make every message as long as the requests' prompts and outputs.
    `scheduled_time`: time.perf_counter() of its first admission (a system-wide clock, so
    the server process can compare it with its own readings)."""

    request_id: str
    finished: bool
    num_cached_tokens: int
    scheduled_time: float | None
    samples: list[Sample]


class RequestStream:
    """The updates of one request as the engine sends them. Each Update holds the request's
    whole text so far, so a reader that falls behind gets the latest one, merged as it comes
    (one text held, however far behind): the log-probabilities of the updates it skipped
    come with it, and where their texts ended (`Sample.earlier`). (A list and one future,
    not an asyncio.Queue: a queue's bookkeeping cost more than the rest of a token's trip.)"""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self._texts = [""] * n  # each sample's text, as the engine's news rebuild it
        self._items: list[Update | EngineFailure] = []
        self._waiter: asyncio.Future | None = None

    def receive(self, finished: bool, num_cached_tokens: int, scheduled_time: float | None,
                samples: list[tuple]) -> None:
        """Take the engine's news of this request (as `_Engine._news` sends it)."""
        texts = self._texts
        updated = []
        for index, start, tail, num_tokens, finish_reason, new_logprobs in samples:
            texts[index] = texts[index][:start] + tail
            updated.append(Sample(index, texts[index], num_tokens, finish_reason,
                                  new_logprobs))
        self.put(Update(self.request_id, finished, num_cached_tokens, scheduled_time, updated))

    def put(self, item: Update | EngineFailure) -> None:
        """Queue an update (merged into one not read yet), or the failure that ends the
        stream."""
        items = self._items
        if items and isinstance(item, Update) and isinstance(items[-1], Update):
            items[-1] = _merge(items[-1], item)
        else:
            items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Update:
        """The latest update (waits for one); raises EngineFailure if the engine failed."""
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        if isinstance(items[-1], EngineFailure):
            raise items[-1]
        return items[-1]  # the one update queued: put merges


def _merge(skipped: Update, update: Update) -> Update:
    """`update`, with what a reader that skips `skipped` needs of it: each sample's earlier
    log-probabilities and where its text ended. The lists of `skipped`, dropped after this,
    are extended in place, so that a reader far behind costs a step per update."""
    before = {sample.index: sample for sample in skipped.samples}
    samples = []
    for sample in update.samples:
        old = before.get(sample.index)
        if old is not None:
            earlier = [] if old.earlier is None else old.earlier
            earlier.append((_stable_length(old.text), old.num_tokens))
            logprobs = sample.new_logprobs
            if old.new_logprobs is not None:
                logprobs = old.new_logprobs
                logprobs.extend(sample.new_logprobs or ())
            sample = sample._replace(new_logprobs=logprobs, earlier=earlier)
        samples.append(sample)
    return update._replace(samples=samples)


def _stable_length(text: str) -> int:
    """The length of `text` less its trailing U+FFFD (characters whose bytes may not all
    have come), without copying it."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    return end


class EngineLoop:
    """Runs the LLM that `make_llm()` builds in a child process. `make_llm` must pickle (a
    function of a module, or functools.partial of LLM with its arguments). `max_waiting`:
    sequences that may wait for a seat (the scheduler's waiting queue); a request beyond it
    raises ServerBusy."""

    def __init__(self, make_llm: abc.Callable[[], LLM], *, max_waiting: int):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.make_llm = make_llm
        self.max_waiting = max_waiting
        self.info: EngineInfo | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._events: Connection | None = None  # the engine's messages
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # its commands
        self._streams: dict[str, RequestStream] = {}  # unfinished requests
        self._calls: dict[int, asyncio.Future] = {}  # commands waiting for their reply
        self._next_call = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Future | None = None  # done when the engine's pipe closes
        self._stopping = False
        self._draining = False  # takes no new request; those in flight may finish

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the engine process still runs (as far as its pipe tells)."""
        return self._closed is None or not self._closed.done()

    @property
    def num_requests(self) -> int:
        """Requests the engine holds (waiting or running) as the server last heard."""
        return len(self._streams)

    def start(self) -> EngineInfo:
        """Start the engine process and wait until it has built its LLM; raises what
        building it raised (then no process is left)."""
        context = process_context()
        commands_in, commands_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_engine_main, args=(self.make_llm, self.max_waiting, torch.get_num_threads(),
                                       commands_in, events_out),
            name="kvpool-engine", daemon=True)
        self._process.start()
        commands_in.close()
        events_out.close()
        try:
            ok, info = events_in.recv()
        except EOFError:  # it died before it could say
            self._process.join()
            raise RuntimeError(f"the engine process exited with code "
                               f"{self._process.exitcode}") from None
        if not ok:
            self._process.join()
            raise info
        self.info, self._events = info, events_in
        threading.Thread(target=_write, args=(self._outbox, commands_out),
                         name="kvpool-engine-commands", daemon=True).start()
        return info

    def attach(self) -> None:
        """Read the engine's messages on the running event loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._loop.add_reader(self._events.fileno(), self._read)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  cache_salt: str | None = None) -> RequestStream:
        """Queue a request (sharing cached prefix pages only with requests of its
        `cache_salt`); returns its stream once the engine took it. Raises what
        `LLM.add_request` raises (SequenceTooLong, OutOfPages, ValueError), ServerBusy,
        EngineStopped or EngineExited, and then the engine holds nothing of it."""
        if not self.alive:
            raise EngineExited("the engine process has exited")
        if self._stopping or self._draining:
            raise EngineStopped("the server is shutting down")
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        try:
            await self._submit("add", request_id, prompt_token_ids, params, cache_salt)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it finished); its pages come back before the next step."""
        if not self._stopping:
            self._command("abort", request_id)

    async def call(self, fn: abc.Callable[[LLM], Any]) -> Any:
        """Run `fn(llm)` in the engine between two steps; return its result. `fn` and its
        result must pickle, and `fn` unpickle in the engine process (else the call raises,
        and the engine goes on)."""
        return await self._submit("call", pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL))

    async def drain(self, timeout: float) -> None:
        """Take no new request, let those in flight finish for up to `timeout` seconds, then
        fail the rest (EngineFailure, status 503) and abort them in the engine."""
        self._draining = True
        deadline = self._loop.time() + timeout
        while self._streams and self._loop.time() < deadline and not self._closed.done():
            await asyncio.sleep(0.02)
        failure = EngineFailure("the server is shutting down", status=503)
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.put(failure)
            if not self._closed.done():
                self._command("abort", request_id)

    async def stop(self) -> None:
        """Take no new request, abort those in flight, and end the engine process. The
        engine reads the command between two steps: a process still running STOP_SECONDS
        later (in a step that does not return: a device or a collective that hangs) is
        terminated, and killed if it still runs STOP_SECONDS after that."""
        if not self._stopping:
            self._stopping = True
            self._command("stop")
            self._outbox.put(None)  # the writer thread ends
        if not await self._ended():
            self._process.terminate()
            how = "terminated"
            if not await self._ended():
                self._process.kill()
                how = "killed"
            await asyncio.to_thread(self._process.join)
            logger.error("the engine process still ran %g s after it was told to stop (in a "
                         "step that does not return?): %s", STOP_SECONDS, how)
        await self._closed

    async def _ended(self) -> bool:
        """Wait STOP_SECONDS at most for the engine process to end; whether it has."""
        await asyncio.to_thread(self._process.join, STOP_SECONDS)
        return self._process.exitcode is not None

    async def _submit(self, kind: str, *args: Any) -> Any:
        """Send a command that the engine answers; its result or exception comes back."""
        if self._closed.done():
            raise EngineExited("the engine process has exited")
        call_id, self._next_call = self._next_call, self._next_call + 1
        self._command(kind, call_id, *args)  # what does not pickle raises here
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _command(self, *command: Any) -> None:
        """Queue a command for the writer thread, pickled here so that what does not pickle
        fails its caller rather than the thread."""
        self._outbox.put(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))

    def _read(self) -> None:
        """Take a message of the engine (called while its pipe is readable, so once for
        each message, without asking the pipe whether another waits)."""
        try:
            message = self._events.recv()
        except (EOFError, OSError):
            self._close()
        else:
            self._dispatch(*message)

    def _dispatch(self, kind: str, *args: Any) -> None:
        if kind == "news":
            for request_id, finished, *news in args[0]:
                stream = self._streams.get(request_id)
                if finished:
                    self._streams.pop(request_id, None)
                if stream is not None:
                    stream.receive(finished, *news)
        elif kind == "reply":
            call_id, result, error = args
            future = self._calls.get(call_id)
            if future is not None and not future.done():  # else the handler went away
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
        elif kind == "failed":
            request_ids, message = args
            for request_id in request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(EngineFailure(message))

    def _close(self) -> None:
        """The engine's pipe closed (it stopped, or died): fail whatever still waits."""
        self._loop.remove_reader(self._events.fileno())
        self._events.close()
        self._stopping = True
        self._outbox.put(None)
        failure = EngineFailure("the engine process exited")
        for stream in self._streams.values():
            stream.put(failure)
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineExited("the engine process has exited"))
        self._closed.set_result(None)


def _write(outbox: queue.SimpleQueue, commands: Connection) -> None:
    """The writer thread: send the queued commands (pickled) until None (or the engine is
    gone); the engine's `recv` unpickles them."""
    # OSError: the engine process exited; the reader fails what waits.
    with contextlib.suppress(OSError), contextlib.closing(commands):
        while (command := outbox.get()) is not None:
            commands.send_bytes(command)


# ---- the engine process ------------------------------------------------------------------


def _engine_main(make_llm: abc.Callable[[], LLM], max_waiting: int, num_threads: int,
                 commands: Connection, events: Connection) -> None:
    """The engine process: build the LLM, say so (or send what building it raised), then
    serve commands and step until told to stop or the server's pipe closes. It runs torch
    on the server's number of threads, as the engine did inside the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the server stops us
    torch.set_num_threads(num_threads)
    # An LLM of several ranks starts worker processes, which multiprocessing refuses a
    # daemonic process lest they outlive it; they exit with their rank 0 (this process).
    multiprocessing.current_process().daemon = False
    with forkserver_ended():  # the one that starts the workers of an LLM of several ranks
        try:
            llm = make_llm()
        except Exception as e:
            events.send((False, e))
            return
        events.send((True, EngineInfo(llm.tokenizer, llm.max_model_len,
                                      llm.model_config.vocab_size, llm.config.max_num_seqs,
                                      _max_sequence_tokens(llm))))
        try:
            with contextlib.suppress(EOFError):  # the server is gone
                _Engine(llm, max_waiting, events).run(commands)
        finally:
            llm.close()  # its workers, if any


@contextlib.contextmanager
def forkserver_ended():
    """End, when the block ends, the forkserver that it started (multiprocessing's, which
    starts with this process's first forkserver process: see kvpool.engine.parallel.
    process_context), and wait for it; for a block after which this process starts no more
    processes. Left to end when this process exits, the forkserver tears down an interpreter
    that imported torch: seconds of a core, and it outlives this process as long. It holds
    nothing that needs the teardown (it runs no torch op), so SIGTERM ends it at once; the
    processes it forked go on. A forkserver started before the block is left running."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    started_before = getattr(server, "_forkserver_pid", None) is not None
    try:
        yield
    finally:
        pid = getattr(server, "_forkserver_pid", None)
        if not started_before and pid is not None and hasattr(server, "_stop"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            server._stop()  # reaps it and removes its socket's file


def _max_sequence_tokens(llm: LLM) -> int:
    """The most tokens one sequence can hold, prompt and generated: max_model_len, or the
    largest count the cache fits alone (its last token's KV is never written)."""
    def fits(num_tokens: int) -> bool:
        try:
            llm.cache.check_fits(num_tokens - 1)
        except OutOfPages:
            return False
        return True
    low, high = 1, llm.max_model_len  # fits(low); the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


class _Engine:
    """The engine process's loop over one LLM."""

    def __init__(self, llm: LLM, max_waiting: int, events: Connection):
        self.llm = llm
        self.max_waiting = max_waiting
        self.events = events
        # unfinished request -> per sample, (characters of its text sent that cannot change,
        # log-probabilities sent)
        self._requests: dict[str, list[tuple[int, int]]] = {}
        self._stopping = False

    def run(self, commands: Connection) -> None:
        while not self._stopping:
            if commands.poll(0 if self.llm.has_unfinished() else IDLE_CHECK_SECONDS):
                self._run_commands(commands)
            elif not self.llm.has_unfinished() and not self.llm.alive:
                # idle, so no request would meet it: a part of the engine that died (a
                # tensor-parallel rank, a disaggregated pair's prefill side) ends it now
                logger.error("the engine can serve no more (a part of it died while idle); "
                             "its process ends")
                self._stopping = True
            if self.llm.has_unfinished() and not self._stopping:
                self._step()

    def _run_commands(self, commands: Connection) -> None:
        """Run the commands queued, at least one (until one ends the loop: those after it
        are left to the server, which fails them when the process has exited)."""
        self._run(*commands.recv())
        while not self._stopping and commands.poll():
            self._run(*commands.recv())

    def _run(self, kind: str, *args: Any) -> None:
        if kind == "abort":
            self._abort(*args)
        elif kind == "stop":
            self._stopping = True
            for request_id in list(self._requests):
                self._abort(request_id)
        else:  # add or call: the server waits for the reply
            call_id, *rest = args
            try:
                result = self._add(*rest) if kind == "add" else self._call(*rest)
            except Exception as e:  # the caller gets it (a refusal, or a failed check)
                self._send("reply", call_id, None, e)
                self._end_if_gone(e)
            else:
                self._send("reply", call_id, result, None)

    def _call(self, fn: bytes) -> Any:
        """Run a call's function (pickled alone, so that one that does not unpickle here,
        say a function of a module this process cannot import, fails its caller alone)."""
        try:
            fn = pickle.loads(fn)
        except Exception as e:
            raise RuntimeError(f"the engine cannot unpickle the call's function: "
                               f"{type(e).__name__}: {e}") from None
        return fn(self.llm)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:
            logger.exception("a step failed; the requests in flight fail with it")
            self._interrupted(f"the engine failed: {type(e).__name__}: {e}")
            self._end_if_gone(e)
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send the news of a step's outputs, and fail the requests the LLM failed (each
        alone: its client gets the message). The output of a request no longer tracked
        (failed or aborted before) is dropped."""
        outputs = [output for output in outputs if output.request_id in self._requests]
        failed = [output for output in outputs if output.error is not None]
        self._send("news", [self._news(output) for output in outputs if output.error is None])
        for output in failed:
            del self._requests[output.request_id]
            self._send("failed", [output.request_id], f"the request failed: {output.error}")
        for output in failed:
            self._end_if_gone(output.error)

    def _interrupted(self, message: str) -> None:
        """A step raised: abort the requests the LLM still runs or queues and fail them with
        `message`, as generate does (a fault that recurs, a forward out of memory, would
        else fail every step while they wait). Those it holds no more, the step ended: the
        next step() hands out the ones it finished (it runs nothing now, every request
        aborted), and the others, failed by the LLM in the step, fail with `message`."""
        aborted = [request_id for request_id in self._requests
                   if self.llm.abort(request_id) is not None]
        for request_id in aborted:
            del self._requests[request_id]
        try:
            self._deliver(self.llm.step())
        except Exception:  # a second fault: the requests it holds back are lost to it
            logger.exception("a step failed again")
        failed = aborted + list(self._requests)
        self._requests.clear()
        self._send("failed", failed, message)

    def _end_if_gone(self, error: BaseException) -> None:
        """End the loop if `error` says that the engine can serve no more (EngineDied: a
        side of a DisaggregatedLLM is gone, or a tensor-parallel rank, RankFailed): the
        process exits, so that the server answers 503 engine_exited from then on and
        /health says so."""
        if isinstance(error, EngineDied) and not self._stopping:
            logger.error("the engine can serve no more (%s); its process ends", error)
            self._stopping = True

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             cache_salt: str | None) -> None:
        """Queue a request unless more than max_waiting sequences would then wait for a
        seat: those beyond the seats left free by the running ones."""
        stats = self.llm.stats()
        free_seats = max(0, self.llm.config.max_num_seqs - stats.num_running)
        if stats.num_waiting + params.n - free_seats > self.max_waiting:
            raise ServerBusy(f"{stats.num_waiting} sequences wait already; this request's "
                             f"{params.n} would pass max_waiting {self.max_waiting}")
        self.llm.add_request(prompt_token_ids, params, request_id=request_id,
                             cache_salt=cache_salt)
        self._requests[request_id] = [(0, 0)] * params.n

    def _abort(self, request_id: str) -> None:
        output = self.llm.abort(request_id)
        if output is not None and request_id in self._requests:
            self._send("news", [self._news(output)])

    def _news(self, output: RequestOutput) -> tuple:
        """What the server needs of an output, as plain tuples (see RequestStream.receive);
        a finished request is forgotten here. A sample's text goes from where the text sent
        before ended, less its trailing U+FFFD (a character whose bytes had not all come)."""
        sent = self._requests.pop(output.request_id) if output.finished else \
            self._requests[output.request_id]
        samples = []
        for sample in output.outputs:
            start, num_logprobs = sent[sample.index]
            text, new_logprobs = sample.text, None
            if sample.logprobs is not None:
                new_logprobs = sample.logprobs[num_logprobs:]
                num_logprobs = len(sample.logprobs)
            samples.append((sample.index, start, text[start:], len(sample.token_ids),
                            sample.finish_reason, new_logprobs))
            sent[sample.index] = _stable_length(text), num_logprobs
        return (output.request_id, output.finished, output.num_cached_tokens,
                output.scheduled_time, samples)

    def _send(self, *message: Any) -> None:
        """Send a message; one whose contents do not pickle (a call's odd result or error)
        goes as a RuntimeError reply naming it."""
        try:
            self.events.send(message)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # it did not pickle
            if message[0] != "reply":
                raise
            self.events.send(("reply", message[1], None,
                              RuntimeError(f"the engine's reply does not pickle: {e}")))
