"""DisaggregatedLLM: prefill and decode on two engines in two processes.

The decode engine runs in the caller's process; the prefill engine in a child process. A
request's prompt but its last token is prefilled on the prefill side (which keeps its own
prefix cache), and its KV pages (and a hybrid model's Mamba state after those tokens) go to
the decode side in one batch over torch.distributed (gloo, in a group reachable from this
machine only: kvpool.engine.rendezvous; pages on a GPU travel through the host). The decode
side admits the request with those pages written past its own prefix hit (and the state in
its slot), computes the last prompt token, samples and decodes: sampling (seeds, n samples,
logprobs) happens on the decode side alone, as in one engine, so greedy tokens are one
engine's.

Control messages (requests, aborts, errors, heartbeats) travel over a pair of pipes; page
data over the process group. Commands to the prefill side are written by a thread of their
own from an unbounded queue, so that adding or aborting a request never waits on the pipe
(the prefill side's messages are read only in step(), and it stops reading commands while
its own pipe is full). A prefill side that dies, raises out of its loop or stays silent past
`timeout` seconds fails every request waiting on it with EngineDied; a request it refuses
(too long for its pool) fails alone with StepFailed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import abc
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from kvpool.engine.config import EngineConfig
from kvpool.engine.handoff import PrefilledKV
from kvpool.engine.llm import LLM, Prompt, _per_prompt
from kvpool.engine.params import SamplingParams
from kvpool.engine.rendezvous import file_store, loopback_gloo, private_directory, store_path
from kvpool.engine.request import CompletionOutput, RequestOutput
from kvpool.engine.stats import EngineStats
from kvpool.errors import EngineDied, KVPoolError, OutOfPages, SequenceTooLong, StepFailed
from kvpool.numeric import check_seconds

PREFILL_RANK, DECODE_RANK = 0, 1
HEARTBEAT = 1.0  # seconds: the prefill side says it is alive at least this often
# The prefill side computes the prompt's KV and samples one token, which is dropped: two
# tokens asked so that the request is still running (its pages held) when it is read.
PREFILL_PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class DisaggregatedLLM:
    """LLM's `generate` and step API (add_request, step, abort, has_unfinished, stats, check)
    over a prefill engine and a decode engine. `prefill` and `decode` are each side's LLM
    options (a dict or an EngineConfig); the two must lay pages out alike (page size, KV
    dtype). Both sides serve models of one KV pool, hybrids (Mamba) included; not a full
    and a window pool together, nor a pool giving pages back out of the window (a side
    built with free_out_of_window=False keeps them).
    `timeout`: the seconds the prefill side may stay silent while requests wait on it (it
    says it is alive between two steps once a second has passed without a message: make it
    longer than its longest step), or a page transfer may take; `start_timeout`: the
    seconds it may take to load its model. `close()` (or leaving a `with` block) stops the
    prefill process. Call it from one thread (the server's engine loop does)."""

    def __init__(self, model: str, *, prefill: dict | EngineConfig | None = None,
                 decode: dict | EngineConfig | None = None, timeout: float = 60.0,
                 start_timeout: float = 600.0):
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
            check_seconds(name, value)
        # The prefill side reads each prompt's KV between two steps: without overlap, since
        # with it the step after the prompt would already be running (and, for a hybrid,
        # advancing the state that is read).
        prefill, decode = {**_options(prefill), "overlap": False}, _options(decode)
        prefill_config = EngineConfig(**prefill)  # a bad option fails before a process starts
        if prefill.get("tensor_parallel_size", 1) != 1:
            raise ValueError(f"the prefill engine runs on one rank; got tensor_parallel_size="
                             f"{prefill['tensor_parallel_size']} (a pair with tensor "
                             f"parallelism on either side is not supported yet)")
        self.timeout = timeout
        self.decode = LLM(model, **decode)
        prefill_config.resolve_max_model_len(self.decode.model_config)
        if self.decode.cache.pool.quantized and (
                decode.get("kv_scales") is None or prefill.get("kv_scales") != decode["kv_scales"]):
            raise ValueError("fp8 pages handed from the prefill engine need the same kv_scales "
                             "given to both sides: scales each calibrates from its first "
                             "prefill differ")
        _same_rope(prefill, self.decode)
        if not self.decode.takes_prefilled:
            raise ValueError("disaggregation serves models of one KV pool that keeps every "
                             "page (and hybrids), on one rank; this decode engine's cache "
                             "(full and window pools, pages given back out of the window, or "
                             "tensor parallelism) takes none yet")
        directory = private_directory()  # the group's store, removed when the pair stops
        self._store = file_store(store_path(directory), 2, datetime.timedelta(seconds=timeout))
        self._process, self._conn = _start_prefill_process()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # its commands
        writer = threading.Thread(target=_write, args=(self._outbox, self._conn),
                                  name="kvpool-prefill-commands", daemon=True)
        writer.start()
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn,
                                           self._outbox, writer, directory)
        self._send(str(model), prefill, store_path(directory), timeout)
        self._group = None
        self._dead: str | None = None  # why the prefill side is gone
        # handoff key -> id of each request the prefill side has: a key of its own per
        # submission, so that KV sent for an aborted request never reaches a later one of
        # the same id
        self._pending: dict[str, str] = {}
        self._handoffs = itertools.count()
        self._failed: list[RequestOutput] = []  # to report at the next step
        self._prefill_stats: EngineStats | None = None  # the prefill side's last answer
        self._last_heard = time.monotonic()  # when the prefill side last sent a message
        try:
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    # ---- what LLM exposes ---------------------------------------------------------------

    @property
    def tokenizer(self):
        """The model's tokenizer (None when it has none)."""
        return self.decode.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The decode engine's options (the one that takes requests and decodes them)."""
        return self.decode.config

    @property
    def model_config(self):
        """The model's config."""
        return self.decode.model_config

    @property
    def max_model_len(self) -> int:
        """The longest sequence the decode engine serves (tokens)."""
        return self.decode.max_model_len

    @property
    def cache(self):
        """The decode engine's cache."""
        return self.decode.cache

    # ---- batch API ---------------------------------------------------------------------

    def generate(self, prompts: Prompt | abc.Sequence[Prompt],
                 sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """LLM.generate over the two engines: one RequestOutput per prompt, in order; a
        request that could never fit gets its error in its output, the others run. Raises
        RuntimeError while step-API requests are unfinished; if it raises, its requests are
        aborted first."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        if self.has_unfinished():
            raise RuntimeError("generate() serves only its own requests: step the step API's "
                               "requests to completion or abort them first")
        outputs: list[RequestOutput | str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                try:
                    outputs.append(self.add_request(prompt, sp))
                except (SequenceTooLong, OutOfPages) as e:
                    outputs.append(_refused(prompt, sp, e))
            ids = {o: i for i, o in enumerate(outputs) if isinstance(o, str)}
            with tqdm(total=len(ids), unit="req", desc="generate", disable=not use_tqdm) as bar:
                while self.has_unfinished():
                    for out in self.step():
                        if out.finished and out.request_id in ids:
                            outputs[ids[out.request_id]] = out
                            bar.update()
        except BaseException:
            for output in outputs:
                if isinstance(output, str):
                    self.abort(output)
            raise
        return outputs

    # ---- step API ----------------------------------------------------------------------

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, cache_salt: str | None = None) -> str:
        """Queue a prompt (LLM.add_request's checks and errors, against the decode engine);
        its prompt goes to the prefill side. EngineDied once that side is gone."""
        self._check_alive()
        request_id, token_ids = self.decode.hold_request(prompt, sampling_params, request_id,
                                                         cache_salt=cache_salt)
        if len(token_ids) == 1:  # nothing to prefill but the last token: computed here
            self.decode.resume_request(request_id, None)
            return request_id
        key = str(next(self._handoffs))
        self._send("add", key, token_ids[:-1], cache_salt)
        self._pending[key] = request_id
        return request_id

    def step(self) -> list[RequestOutput]:
        """Take the prefilled KV that arrived (waiting a little for it when the decode engine
        has nothing to do), then run one decode-engine step. Returns the requests that got
        new tokens, or failed (on either side)."""
        self._receive(wait=not self.decode.has_unfinished())
        outputs, self._failed = self._failed, []
        if self.decode.has_unfinished():
            outputs += self.decode.step()
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel an unfinished request, on either side; returns its final output (None for
        an unknown or finished id)."""
        key = next((k for k, r in self._pending.items() if r == request_id), None)
        if key is not None:
            del self._pending[key]
            self._send("abort", key)
        return self.decode.abort(request_id)

    def has_unfinished(self) -> bool:
        """True while a request waits on either side or runs, or its failure is still to be
        returned by step()."""
        return bool(self._pending or self._failed) or self.decode.has_unfinished()

    def check(self) -> None:
        """The decode engine's invariants (`LLM.check`): its requests held for the prefill
        side's KV among them. For tests and debugging."""
        self.decode.check()

    def stats(self) -> EngineStats:
        """The decode engine's counters (prompt tokens counted there are the last token of
        each prompt and recomputations after preemption); `num_waiting` counts the samples
        of the requests on the prefill side too (the decode engine holds them), so that a
        limit on waiting sequences (the server's --max-waiting) holds for both sides."""
        return self.decode.stats()

    @property
    def alive(self) -> bool:
        """Whether the pair can still serve: False once the prefill side is gone (its
        process exited, seen now, or found dead before) or the decode engine is not alive."""
        return self._dead is None and self._process.poll() is None and self.decode.alive

    def stats_by_side(self) -> dict[str | None, EngineStats]:
        """Each engine's counters: "prefill" (`prefill_stats`) and "decode" (`stats`); each
        has its own pool, prefix cache and tier."""
        return {"prefill": self.prefill_stats(), "decode": self.stats()}

    def prefill_stats(self) -> EngineStats:
        """The prefill engine's counters (its prefix cache's hits among them), asked for now:
        waits `timeout` seconds at most for the answer; EngineDied once that side is gone."""
        self._check_alive()
        self._send("stats")
        self._prefill_stats = None
        deadline = time.monotonic() + self.timeout
        while self._prefill_stats is None and self._dead is None:
            message = self._next_message(max(deadline - time.monotonic(), 0.0))
            if message is not None:
                self._last_heard = time.monotonic()
                self._handle(message)
            elif time.monotonic() >= deadline:
                self._died(f"no answer to a stats request in {self.timeout} s")
        self._check_alive()
        return self._prefill_stats

    def close(self) -> None:
        """Stop the prefill process (waiting 5 seconds at most, then killing it); requests
        still waiting on it fail. Safe to call twice."""
        self._died("closed", kill=False)

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------

    def _start(self, start_timeout: float) -> None:
        """Wait for the prefill side to load its model and join the process group; check
        that it keeps every page of a prompt and lays them out as the decode side does."""
        message = self._next_message(start_timeout)
        if message is None:
            raise EngineDied(f"the prefill engine did not start within {start_timeout} s")
        if message[0] == "died":
            raise EngineDied(f"the prefill engine failed to start: {message[1]}")
        _, page_shape, dtype, whole = message
        if not whole:
            raise ValueError("the prefill engine's cache gives pages back out of the sliding "
                             "window (or has a full and a window pool): it cannot hand a long "
                             "prompt's KV over whole; give it free_out_of_window=False")
        pool = self.decode.runner.kv.pools[0]
        mine = (tuple(pool.kv[:, :, 0].shape), str(pool.kv.dtype))
        if (tuple(page_shape), dtype) != mine:
            raise ValueError(f"the prefill engine's pages are {tuple(page_shape)} {dtype}, the "
                             f"decode engine's {mine[0]} {mine[1]}: give both sides the same "
                             f"page_size and kv_cache_dtype")
        self._send("join")
        self._group = _process_group(self._store, DECODE_RANK, self.timeout)
        self._last_heard = time.monotonic()

    def _receive(self, *, wait: bool) -> None:
        """Handle the prefill side's messages: KV to queue on the decode engine, refused
        requests to fail. With `wait` and requests pending there, wait for a first message a
        little. Fails every pending request if the side died or stayed silent too long."""
        if self._dead is not None:
            return
        message = self._next_message(0.05 if wait and self._pending else 0.0)
        while message is not None and self._dead is None:
            self._last_heard = time.monotonic()
            self._handle(message)
            message = self._next_message(0.0)
        silent = time.monotonic() - self._last_heard
        if self._dead is None and self._pending and silent > self.timeout:
            self._died(f"silent for {silent:.0f} s, over the timeout of {self.timeout} s")

    def _send(self, *message) -> None:
        """Queue a message for the prefill side, pickled here (what does not pickle raises
        to the caller); the writer thread sends it. A side that is gone never reads it: its
        death is seen where its messages are read."""
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _next_message(self, wait: float) -> tuple | None:
        """The prefill side's next message, waiting up to `wait` seconds; None when there is
        none. A closed pipe marks the side dead."""
        try:
            if not self._conn.poll(wait):
                if self._process.poll() is not None:
                    self._died(f"its process exited with code {self._process.returncode}")
                return None
            return self._conn.recv()
        except (EOFError, OSError):
            self._died(f"its pipe closed (exit code {self._process.poll()})")
            return None

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "kv":
            _, key, num_tokens, described, scales = message
            try:
                pages, *state = [self._receive_tensor(*d) for d in described]
            except RuntimeError as e:  # gloo: the peer closed, or the timeout passed
                # the request stays pending until here, so that it fails with the others
                self._died(f"receiving the KV of request {self._pending.get(key)!r} failed: {e}")
                return
            request_id = self._pending.pop(key, None)  # None: aborted meanwhile, dropped
            if request_id is not None:
                try:
                    self.decode.resume_request(request_id, PrefilledKV(
                        num_tokens, pages, tuple(state),
                        None if scales is None else torch.tensor(scales, dtype=torch.float32)))
                except (ValueError, TypeError) as e:  # KV that does not fit: this one fails
                    self._fail(request_id, StepFailed(
                        f"request {request_id!r}: the prefill engine's KV was refused: {e}"))
        elif kind == "failed":
            _, key, reason = message
            request_id = self._pending.pop(key, None)
            if request_id is not None:
                self._fail(request_id, StepFailed(
                    f"request {request_id!r} failed on the prefill engine: {reason}"))
        elif kind == "stats":
            self._prefill_stats = message[1]
        elif kind == "died":
            self._died(f"it raised: {message[1]}")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDied(f"the prefill engine is gone ({self._dead}): close this "
                             f"DisaggregatedLLM and start another")

    def _receive_tensor(self, shape: abc.Sequence[int], dtype_name: str) -> torch.Tensor:
        """The next tensor the prefill side sends, on the decode engine's device."""
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buffer = torch.empty(nbytes, dtype=torch.uint8)  # gloo moves host tensors
        self._group.recv([buffer], PREFILL_RANK, 0).wait()
        return buffer.view(dtype).view(shape).to(self.decode.cache.device)

    def _fail(self, request_id: str, error: KVPoolError) -> None:
        output = self.decode.fail_request(request_id, error)
        if output is not None:
            self._failed.append(output)

    def _died(self, reason: str, *, kill: bool = True) -> None:
        """The prefill side is gone: fail every request waiting on it, stop its process
        (killed at once unless not `kill`)."""
        if self._dead is not None:
            return
        self._dead = reason
        pending, self._pending = self._pending, {}
        for request_id in pending.values():
            self._fail(request_id, EngineDied(
                f"request {request_id!r} failed: the prefill engine is gone ({reason})"))
        if kill:
            self._process.kill()
        # Let go of the group's connections first: the prefill process, told to close, may
        # wait on them as it exits.
        self._group = self._store = None
        self._finalizer()


class _Channel:
    """Pickled messages over two one-way pipes: sent on one, received on the other."""

    def __init__(self, read_fd: int, write_fd: int):
        self._in = Connection(read_fd, writable=False)
        self._out = Connection(write_fd, readable=False)

    def send(self, message: tuple) -> None:
        self._out.send(message)

    def send_bytes(self, message: bytes) -> None:
        self._out.send_bytes(message)

    def poll(self, timeout: float) -> bool:
        return self._in.poll(timeout)

    def recv(self) -> tuple:
        return self._in.recv()

    def close_reader(self) -> None:
        self._in.close()

    def close_writer(self) -> None:
        self._out.close()


def _start_prefill_process() -> tuple[subprocess.Popen, _Channel]:
    """Start the prefill process (a new interpreter, so that a daemonic process, such as
    the server's engine process, may start it too) and the channel to it."""
    to_child, from_parent = os.pipe()[::-1]
    from_child, to_parent = os.pipe()
    code = "from kvpool.engine.disaggregated import prefill_process; prefill_process()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    process = subprocess.Popen([sys.executable, "-c", code, str(from_parent), str(to_parent)],
                               pass_fds=(from_parent, to_parent), env=env,
                               start_new_session=True)  # a terminal's ^C: we stop it
    os.close(from_parent)
    os.close(to_parent)
    return process, _Channel(from_child, to_child)


def prefill_process() -> None:
    """The prefill process's entry point: its channel's descriptors are its arguments, and
    the first message is what `_prefill_main` takes."""
    conn = _Channel(int(sys.argv[1]), int(sys.argv[2]))
    with contextlib.suppress(EOFError, OSError):
        _prefill_main(*conn.recv(), conn)
    sys.stderr.flush()
    # The interpreter's teardown can wait seconds in torch's native destructors (the
    # process group's); nothing is left to save, so the process ends here.
    os._exit(0)


def _prefill_main(model: str, options: dict, store_file: str, timeout: float,
                  conn: _Channel) -> None:
    """The prefill process: load the engine, join the group, serve prefills until told to
    close or the pipe breaks; a raise is reported before the process ends. `store_file`: the
    path of the group's store."""
    try:
        llm = LLM(model, **options)
        pool = llm.runner.kv.pools[0]
        store = file_store(store_file, 2, datetime.timedelta(seconds=timeout))
        conn.send(("ready", tuple(pool.kv[:, :, 0].shape), str(pool.kv.dtype),
                   llm.takes_prefilled))  # its KV is read whole
        if conn.recv() != ("join",):
            return  # the decode side refused these pages, and closed this side
        try:
            _serve_prefills(llm, _process_group(store, PREFILL_RANK, timeout), conn)
        except RuntimeError:  # gloo: a connect or send failed; a closing decode side drops
            # its group first (at once if it closes as soon as it started)
            if not _told_to_close(conn, timeout=5.0):
                raise
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the decode side went away
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(("died", f"{type(e).__name__}: {e}"))
        raise


def _serve_prefills(llm: LLM, group, conn: _Channel) -> None:
    """Prefill the prompts the decode side sends and send back their KV, until "close"."""
    sends = []  # (work, buffer): a buffer lives until its send completes
    last_sent = time.monotonic()
    while True:
        if conn.poll(0.0 if llm.has_unfinished() else HEARTBEAT):
            message = conn.recv()
            if message[0] == "close":
                return
            _command(llm, conn, message)
            continue  # take every command before the next step
        for output in llm.step() if llm.has_unfinished() else []:
            if output.error is not None:
                conn.send(("failed", output.request_id, str(output.error)))
            elif output.outputs[0].token_ids:
                sends += _send_kv(llm, group, conn, output.request_id)
            last_sent = time.monotonic()
        sends = [(work, buffer) for work, buffer in sends if not work.is_completed()]
        if time.monotonic() - last_sent > HEARTBEAT:
            conn.send(("alive",))
            last_sent = time.monotonic()


def _told_to_close(conn: _Channel, timeout: float) -> bool:
    """Whether the decode side says "close" (or goes away) within `timeout` seconds, the
    commands before it skipped."""
    deadline = time.monotonic() + timeout
    try:
        while conn.poll(max(deadline - time.monotonic(), 0.0)):
            if conn.recv() == ("close",):
                return True
    except (EOFError, OSError):
        return True
    return False


def _command(llm: LLM, conn: _Channel, message: tuple) -> None:
    """Take one command of the decode side: "add" a prompt, "abort" a request, send the
    engine's "stats"."""
    if message[0] == "add":
        _, request_id, token_ids, cache_salt = message
        try:
            llm.add_request(token_ids, PREFILL_PARAMS, request_id, cache_salt=cache_salt)
        except (KVPoolError, ValueError) as e:
            conn.send(("failed", request_id, f"{type(e).__name__}: {e}"))
    elif message[0] == "abort":
        llm.abort(message[1])
    elif message[0] == "stats":
        conn.send(("stats", llm.stats()))


def _send_kv(llm: LLM, group, conn: _Channel, request_id: str):
    """Send the KV of a prefilled request (its header on the pipe; its pages, and a hybrid's
    state, on the group) and let it go (its full pages stay in the prefix cache). Returns the
    sends with their buffers."""
    kv = llm.read_prefilled(request_id)
    llm.abort(request_id)
    tensors = [x.cpu().contiguous() for x in kv.tensors]  # gloo moves host tensors
    conn.send(("kv", request_id, kv.num_tokens, [(tuple(x.shape), str(x.dtype)) for x in tensors],
               None if kv.scales is None else kv.scales.tolist()))
    buffers = [x.view(-1).view(torch.uint8) for x in tensors]
    return [(group.send([buffer], DECODE_RANK, 0), buffer) for buffer in buffers]


def _process_group(store: dist.Store, rank: int, timeout: float) -> dist.ProcessGroupGloo:
    """A two-rank gloo group of its own (no global torch.distributed state) on the loopback
    interface; a send or receive raises once the peer is gone or `timeout` seconds pass."""
    return loopback_gloo(store, rank, 2, datetime.timedelta(seconds=timeout))


def _write(outbox: queue.SimpleQueue, conn: _Channel) -> None:
    """The writer thread: send the queued messages (pickled) to the prefill side until None
    or until that side is gone (OSError; its death is seen where its messages are read)."""
    with contextlib.suppress(OSError):
        while (message := outbox.get()) is not None:
            conn.send_bytes(message)


def _stop(process: subprocess.Popen, conn: _Channel, outbox: queue.SimpleQueue,
          writer: threading.Thread, directory: tempfile.TemporaryDirectory) -> None:
    """Ask the prefill process to close (after the commands queued before), then kill it if
    it lingers, and remove the group's store `directory`. Its messages are read no more: a
    send of its fails, which ends it too (it may be waiting to send while its pipe is
    full)."""
    outbox.put(pickle.dumps(("close",)))
    outbox.put(None)
    conn.close_reader()
    try:
        process.wait(5.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    writer.join()  # its last send is done, or failed once the process was gone
    conn.close_writer()
    directory.cleanup()


def _same_rope(prefill: dict, decode: LLM) -> None:
    """Have the prefill side rotate K as the decode side does: LongRoPE's factors follow an
    engine's max_model_len (ModelConfig.for_max_model_len), so the prefill side takes the
    decode side's unless given one that picks the same factors; ValueError, before any
    process starts, for one that does not."""
    config = decode.model.config
    if config.rope_scaling is None or config.rope_scaling["rope_type"] != "longrope":
        return
    if prefill.get("max_model_len") is None:  # an EngineConfig's options hold None
        prefill["max_model_len"] = decode.max_model_len
    given = prefill["max_model_len"]
    if type(given) is int and config.for_max_model_len(given) != config:  # else its to refuse
        raise ValueError(f"the prefill engine's max_model_len={given} and the decode "
                         f"engine's {decode.max_model_len} pick different LongRoPE factors "
                         f"(the trained context is "
                         f"{config.rope_scaling['original_max_position_embeddings']} "
                         f"tokens): their KV would not agree; give both sides one side of it")


def _options(side: dict | EngineConfig | None) -> dict:
    """One side's LLM options as keyword arguments."""
    if side is None:
        return {}
    if isinstance(side, EngineConfig):
        return {f.name: getattr(side, f.name) for f in dataclasses.fields(side)}
    return dict(side)


def _refused(prompt: Prompt, params: SamplingParams, error: KVPoolError) -> RequestOutput:
    """The output of a request refused before it was queued."""
    text, token_ids = (prompt, []) if isinstance(prompt, str) else (None, list(prompt))
    outputs = [CompletionOutput(i, [], "", "error") for i in range(params.n)]
    return RequestOutput("", text, token_ids, outputs, True, error)
