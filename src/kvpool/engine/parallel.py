"""Tensor parallelism of the engine: one model split across N ranks (kvpool.models.parallel),
one scheduler.

Rank 0 is the LLM's process: the scheduler, the allocator and the prefix cache run there only.
It starts N-1 worker processes (torch.multiprocessing, forked by a forkserver that imported
the engine once: `process_context`), one per device (rank r on cuda:r, or all on the CPU),
joined in one torch.distributed process group: NCCL on CUDA, gloo on the CPU (meeting at a
store file of this user's alone, gloo on the loopback interface: kvpool.engine.rendezvous).
Every rank holds its part of the weights and a pool of its share of the KV heads with the
same number of pages, so a page id means the same page everywhere.

Each step rank 0 broadcasts one message on a gloo group: the step's layout, the host copies of
its lengths and the flat int64 metadata its runner packed (`StepChannel`). Every worker puts it
in its own workspace and runs the same ModelRunner forward on its part; the model's
all-reduces and its logits' all-gather join the ranks, and rank 0 samples. The copies rank 0's
pools make (copy-on-write and window drops in each page group's pool, a hybrid's state copies)
travel first, in messages of their own, so the workers' pools copy the same pages and slots.
With a host tier each rank keeps its share of every page in a tier of its own: the pages rank
0 stores to its tier and fetches from it travel the same way, keys and all, in rank 0's
order, so every rank's tier holds the same pages.

Failures: the model's collectives time out after `tensor_parallel_timeout` seconds, and the
workers' start and build after the startup timeout; a worker waits for its next message
without limit (the engine may idle). A worker that raises reports
its error and exits. Before each step rank 0 checks that every worker is alive, and a step
that fails names the rank that died or raised (RankFailed); the group is then stopped, since
its ranks are out of step, and the engine refuses further steps. `close` stops the workers
and the group and leaves no process behind."""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import queue
import signal
import struct
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpool.cache import KVCache, StateSpec
from kvpool.cache.pages import store_pages
from kvpool.cache.tiers import KEY_BYTES, HostTier, PageKey, Tier
from kvpool.engine.config import EngineConfig
from kvpool.engine.rendezvous import GLOO, file_store, private_directory, store_path
from kvpool.engine.runner import ModelRunner, StepLayout
from kvpool.engine.tiers import weights_fingerprint
from kvpool.errors import RankFailed
from kvpool.forward_context import HostLengths
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.memory.state_pool import CheckpointRequest
from kvpool.memory.workspace import Workspace
from kvpool.models import load_model
from kvpool.models.parallel import ONE_RANK, TensorParallel
from kvpool.threads import limit_threads

RUN, COPY, STOP, STORE, FETCH, LOAD = 1, 2, 3, 4, 5, 6  # the commands of a message
# a RUN: command, the 6 StepLayout fields, max_seq_len, max_query_len, has seq_lens,
# checkpoints; a COPY, STORE, FETCH or LOAD: command, entries, pool, width, more follow
HEADER = 11
KEY_WORDS = KEY_BYTES // 8  # a tier chain key in messages: this many int64s
_KEY_CODEC = struct.Struct(f"<{KEY_WORDS}q")
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits this long for its next step
STARTUP_SECONDS = 120.0  # the least time the ranks wait for each other to start
JOIN_SECONDS = 60.0  # how long close() waits for a worker to exit before killing it
REPORT_SECONDS = 2.0  # how long a failed step waits for the workers' error reports
POLL_SECONDS = 0.05  # how often rank 0 looks at the workers while they start
# What the forkserver imports for its workers: the engine, and torch._dynamo, which torch
# imports at the first meta-device op of a process (building a model), seconds on a CPU.
WORKER_MODULES = ["kvpool.engine.parallel", "torch._dynamo"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every rank builds besides its part of `model`: the pools of one rank's `layout`,
    `num_pages` pages (one pool, or one per layer group: as KVCache takes them) and a hybrid's
    `states` (one rank's share of each state slot), a host tier of `host_tier_pages` pages
    (0: none) for its share of the pages rank 0's tier keeps, a workspace of
    `workspace_bytes` and a runner for steps up to `max_step` (rank 0's, so that all
    agree)."""

    model: str
    dtype: torch.dtype | None
    layout: KVLayout
    num_pages: int | tuple[int, ...]
    kv_scales: tuple[float, float] | float | None
    workspace_bytes: int
    max_step: StepLayout
    states: StateSpec | None = None
    host_tier_pages: int = 0
    max_model_len: int | None = None  # rank 0's: LongRoPE's factors follow it


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where a worker joins the group: the path of rank 0's `store`, `size` ranks, the
    collectives' `timeout` (seconds), the devices' type."""

    store: str
    size: int
    timeout: float
    device_type: str


class StepChannel:
    """Rank 0's step messages to the workers: one broadcast per message of a fixed-size int64
    buffer on `group`, room for the largest step of `spec` (`max_step`) and its most state
    checkpoints (a hybrid's checkpoint slots: a step saves at most that many)."""

    def __init__(self, group: dist.ProcessGroup, spec: WorkerSpec):
        self.group = group
        step = 2 * spec.max_step.num_seqs + 1 + spec.max_step.size + 3 * max_checkpoints(spec)
        # and room for one tier entry at least: a stored page's id and key
        entry = 1 + 2 * KEY_WORDS + spec.layout.page_size
        self.buffer = torch.zeros(HEADER + max(step, entry),
                                  dtype=torch.int64)

    def send_step(self, layout: StepLayout, host: HostLengths, staged: torch.Tensor,
                  checkpoints: list[CheckpointRequest]) -> None:
        """Broadcast a step: its layout, host lengths, packed metadata `staged` and the
        state checkpoints it saves."""
        seq_lens = host.seq_lens or []
        head = [RUN, *layout[:5], int(layout.states), host.max_seq_len, host.max_query_len,
                host.seq_lens is not None, len(checkpoints)]
        body = [*host.query_starts, *seq_lens]
        self.buffer[:HEADER] = torch.tensor(head)
        self.buffer[HEADER:HEADER + len(body)] = torch.tensor(body, dtype=torch.int64)
        start = HEADER + len(body)
        self.buffer[start:start + layout.size] = staged[:layout.size]
        start += layout.size
        saves = [x for request in checkpoints for x in request]
        self.buffer[start:start + len(saves)] = torch.tensor(saves, dtype=torch.int64)
        self._broadcast()

    def send_entries(self, command: int, pool: int, entries: list[list[int]]) -> None:
        """Broadcast a COPY, STORE, FETCH or LOAD of mirrored pool `pool` (`mirrored_pools`):
        its entries, rows of one length (a copy's [src, dst], a stored page's [page, *its tier
        key], a fetched page's tier key, a loaded page's id), in as many messages as they
        need, each saying whether more of them follow."""
        width = len(entries[0])
        room = (len(self.buffer) - HEADER) // width
        for first in range(0, len(entries), room):
            part = entries[first:first + room]
            more = first + room < len(entries)
            self.buffer[:5] = torch.tensor([command, len(part), pool, width, more])
            self.buffer[HEADER:HEADER + len(part) * width] = torch.tensor(part).view(-1)
            self._broadcast()

    def send_stop(self) -> None:
        self.buffer[0] = STOP
        self._broadcast()

    def receive(self) -> int:
        """Wait for rank 0's next message; returns its command (the message is `buffer`)."""
        self._broadcast()
        return int(self.buffer[0])

    def step(self) -> tuple[StepLayout, HostLengths, torch.Tensor, list[CheckpointRequest]]:
        """The step of a RUN message just received: layout, host lengths, packed metadata
        and state checkpoints."""
        head = self.buffer[:HEADER].tolist()
        layout = StepLayout(*head[1:6], states=bool(head[6]))
        b, has_seq_lens, num_checkpoints = layout.num_seqs, head[9], head[10]
        lengths = self.buffer[HEADER:HEADER + 2 * b + 1].tolist()
        host = HostLengths(lengths[:b + 1], lengths[b + 1:] if has_seq_lens else None,
                           head[7], head[8])
        start = HEADER + b + 1 + b * has_seq_lens
        saves = self.buffer[start + layout.size:start + layout.size + 3 * num_checkpoints]
        checkpoints = [CheckpointRequest(*saves[i:i + 3].tolist())
                       for i in range(0, len(saves), 3)]
        return layout, host, self.buffer[start:start + layout.size], checkpoints

    def entries(self) -> tuple[int, list[list[int]], bool]:
        """The mirrored pool and the entries of a COPY, STORE, FETCH or LOAD message just
        received, and whether more messages of the same entries follow."""
        n, pool, width, more = self.buffer[1:5].tolist()
        return pool, self.buffer[HEADER:HEADER + n * width].view(n, width).tolist(), bool(more)

    def _broadcast(self) -> None:
        dist.broadcast(self.buffer, src=0, group=self.group)


class NoPeers:
    """The peers a runner sends its steps to when it has none: an engine on one device, or a
    tensor-parallel worker (rank 0 sends the steps). Nothing to send or stop."""

    tp = ONE_RANK
    alive = True  # no other process to lose

    def start(self, spec: WorkerSpec, cache: KVCache) -> None:
        pass

    @contextmanager
    def step(self, layout: StepLayout, host: HostLengths, staged: torch.Tensor,
             checkpoints: list[CheckpointRequest]) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


class TensorParallelGroup:
    """Rank 0's side of a tensor-parallel engine: the worker processes, the process group,
    the step channel and what rank 0's pools did that the workers' must repeat, not sent
    yet: copies, and pages stored to or loaded from the tier, in order. Made before rank 0
    loads its part of the model (`tp` holds the group its collectives run on), it starts the
    workers, which join the group and wait; `start` sends them what to build and waits
    until they have; `step` wraps each forward; `close` stops everything."""

    def __init__(self, size: int, device: torch.device, timeout: float):
        self.device = device
        self.timeout = timeout
        self.failure: RankFailed | None = None
        self.channel: StepChannel | None = None
        self.closed = False
        self._pending: list[tuple[int, int, list[list[int]]]] = []  # (command, pool, entries)
        self._written: set[int] = set()  # the destinations of the last pending record's copies
        if dist.is_initialized():  # the one default group is another's, this engine's or not
            raise ValueError("torch.distributed is initialized already (another tensor-"
                             "parallel engine in this process?): an engine of several ranks "
                             "needs a process of its own, or close() the other first")
        self._directory = private_directory()  # the group's store, removed at close
        store = file_store(store_path(self._directory), size, startup_timeout(timeout))
        address = GroupAddress(store_path(self._directory), size, timeout, device.type)
        context = process_context()
        self.specs = context.Queue()  # what to build, one WorkerSpec per worker
        self.reports = context.Queue()  # (rank, None) when built, (rank, error) on failure
        self.workers = [context.Process(target=run_worker,
                                        args=(rank, address, self.specs, self.reports),
                                        daemon=True, name=f"kvpool-rank-{rank}")
                        for rank in range(1, size)]
        for worker in self.workers:
            worker.start()
        try:
            self._wait_connected(store)
            collectives, self.steps = join_group(0, address, store)
        except BaseException:
            self.close()
            raise
        self.tp = TensorParallel(0, size, collectives)

    def _wait_connected(self, store: dist.Store) -> None:
        """Wait until every worker has reached the store (it then joins the group at once),
        watching them meanwhile: one that fails or dies first raises RankFailed now, where
        the group's own wait would hang until its startup timeout."""
        keys = [connected_key(worker_rank) for worker_rank in range(1, len(self.workers) + 1)]
        deadline = time.monotonic() + startup_timeout(self.timeout).total_seconds()
        while not store.check(keys):
            try:
                rank, error = self.reports.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check_alive("while starting")
            else:
                raise RankFailed(f"tensor-parallel rank {rank} failed while starting: {error}")
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel workers did not start within "
                                 f"{startup_timeout(self.timeout).total_seconds():g} s")

    def start(self, spec: WorkerSpec, cache: KVCache) -> None:
        """Have every worker build `spec` and wait until each has. `cache` is rank 0's: the
        copies its pools make are sent to the workers before the next step."""
        for _ in self.workers:
            self.specs.put(spec)
        try:
            self._wait_ready()
        except BaseException:
            self.close()  # kills the workers: no channel yet, as they read none before ready
            raise
        self.channel = StepChannel(self.steps, spec)
        for index, pool in enumerate(mirrored_pools(cache)):
            pool.listeners.append(functools.partial(self._record_copies, index))
        if cache.tier is not None:  # one page group: pool 0
            cache.prefix_cache.evict_hooks.append(self._record_stores)
            cache.page_groups[0].fetch_listeners.append(self._record_fetches)
            cache.page_groups[0].load_listeners.append(self._record_loads)

    def _wait_ready(self) -> None:
        """Wait for every worker's report, for the startup timeout at most: a worker that
        fails or dies raises RankFailed, and so do the workers still building by then (alive
        but stuck: a hung read of the weights, a device that does not answer)."""
        waiting = set(range(1, self.tp.size))
        seconds = startup_timeout(self.timeout).total_seconds()
        deadline = time.monotonic() + seconds
        while waiting:
            if time.monotonic() > deadline:
                ranks = ", ".join(str(rank) for rank in sorted(waiting))
                raise RankFailed(f"tensor-parallel rank(s) {ranks} did not finish loading "
                                 f"within {seconds:g} s")
            try:
                rank, error = self.reports.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check_alive("while loading")
                continue
            if error is not None:
                raise RankFailed(f"tensor-parallel rank {rank} failed while loading: {error}")
            waiting.discard(rank)

    def _record_copies(self, pool: int, src: Sequence[int], dst: Sequence[int]) -> None:
        self._record(COPY, pool, [[s, d] for s, d in zip(src, dst, strict=True)])

    def _record_stores(self, pages: Sequence[int], keys: Callable[[], list[PageKey]]) -> None:
        """Pages of pool 0 evicted, and so stored to the tier, with their keys."""
        self._record(STORE, 0, [[page, *key_entry(key)]
                                for page, key in zip(pages, keys(), strict=True)])

    def _record_fetches(self, keys: Sequence[PageKey]) -> None:
        self._record(FETCH, 0, [key_entry(key) for key in keys])

    def _record_loads(self, pages: Sequence[int]) -> None:
        self._record(LOAD, 0, [[page] for page in pages])

    def _record(self, command: int, pool: int, entries: list[list[int]]) -> None:
        """Pend `entries`, in the last pending record when it is of the same command and
        pool and, for a COPY, when one copy of both gives what copying them in turn does:
        none of the new copies reads or writes a page (slot) the pending ones write. A
        chain (1->3, then 3->4) or two writes of one page stay records of their own, and so
        does each sequence's FETCH: one whose load failed is followed by no LOAD."""
        if self._pending and self._pending[-1][:2] == (command, pool) and command != FETCH and (
                command != COPY or self._written.isdisjoint(x for entry in entries
                                                            for x in entry)):
            self._pending[-1][2].extend(entries)
        else:
            self._pending.append((command, pool, entries))
            self._written = set()
        if command == COPY:
            self._written.update(dst for _, dst in entries)

    @contextmanager
    def step(self, layout: StepLayout, host: HostLengths, staged: torch.Tensor,
             checkpoints: list[CheckpointRequest]) -> Iterator[None]:
        """Send the step (copies first) to the workers, then run rank 0's forward in the
        block. A failure in either stops the group and raises RankFailed naming the rank; an
        interruption (Ctrl-C) stops it too, since the ranks may be out of step from then on (a
        collective half done), and every later step raises RankFailed at once."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise RuntimeError("this tensor-parallel engine is closed: its workers are gone")
        start = time.monotonic()
        try:
            self._check_alive("before a step")
            for command, pool, entries in self._pending:
                self.channel.send_entries(command, pool, entries)
            self._pending = []
            self.channel.send_step(layout, host, staged, checkpoints)
            yield
        except Exception as e:
            self.failure = self._blame(e, time.monotonic() - start)
            self.close()
            raise self.failure from e
        except BaseException as e:
            self.failure = RankFailed(f"a step was interrupted ({type(e).__name__}): the "
                                      f"tensor-parallel ranks may be out of step")
            self.close()
            raise

    def _check_alive(self, when: str) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise RankFailed(f"tensor-parallel rank {rank} (pid {worker.pid}) exited "
                                 f"with code {worker.exitcode} {when}")

    def _blame(self, error: Exception, seconds: float) -> RankFailed:
        """The RankFailed of a step that failed after `seconds`: a worker's own report, else
        a worker that died, else the workers that did not answer within the timeout, else
        rank 0's own error."""
        if isinstance(error, RankFailed):
            return error
        try:
            rank, report = self.reports.get(timeout=REPORT_SECONDS)
            return RankFailed(f"tensor-parallel rank {rank} failed: {report}")
        except queue.Empty:
            pass
        try:
            self._check_alive("during a step")
        except RankFailed as died:
            return died
        if seconds >= self.timeout:
            ranks = ", ".join(str(rank) for rank in range(1, self.tp.size))
            return RankFailed(f"tensor-parallel rank(s) {ranks} alive but a collective got no "
                              f"answer within {self.timeout:g} s: {error}")
        return RankFailed(f"tensor-parallel rank 0 failed: {type(error).__name__}: {error}")

    @property
    def alive(self) -> bool:
        """Whether every rank can still step: False once one failed (`failure`) or a worker
        process exited, and after close()."""
        return self.failure is None and not self.closed and all(
            worker.is_alive() for worker in self.workers)

    def close(self) -> None:
        """Stop the workers (a STOP message, then a kill for any that does not exit within
        JOIN_SECONDS) and the process group, and remove its store. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        stopping = self.failure is None and self.channel is not None and all(
            worker.is_alive() for worker in self.workers)
        if stopping:
            try:
                self.channel.send_stop()
            except RuntimeError:  # a worker stopped reading: it is killed below
                stopping = False
        for worker in self.workers:
            worker.join(JOIN_SECONDS if stopping else 0)
            if worker.is_alive():
                worker.kill()
                worker.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._directory.cleanup()


class MirroredPool(NamedTuple):
    """A pool whose copies every rank repeats: rank 0 records them through `listeners` (called
    with (src, dst) after each copy), a worker repeats them with `copy(src, dst)`."""

    listeners: list[Callable[[Sequence[int], Sequence[int]], None]]
    copy: Callable[[Sequence[int], Sequence[int]], None]


def mirrored_pools(cache: KVCache) -> list[MirroredPool]:
    """The pools of `cache` whose copies every rank repeats, in the order the COPY messages
    number them: each page group's KV pool, then a hybrid's state pool."""
    pools = [MirroredPool(pool.copy_listeners, pool.copy_pages) for pool in cache.kv_pools.pools]
    if cache.states is not None:
        pools.append(MirroredPool(cache.states.copy_listeners, cache.states.copy_slots))
    return pools


def max_checkpoints(spec: WorkerSpec) -> int:
    """The most state checkpoints one step saves: one per checkpoint slot (none without)."""
    return spec.states.num_checkpoint_slots if spec.states is not None else 0


def make_peers(config: EngineConfig, device: torch.device) -> NoPeers | TensorParallelGroup:
    """The peers of an engine of `config` whose rank 0 runs on `device` (not started)."""
    if config.tensor_parallel_size == 1:
        return NoPeers()
    return TensorParallelGroup(config.tensor_parallel_size, device,
                               config.tensor_parallel_timeout)


def check_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """ValueError unless an engine of `config` can split its model across its ranks: a host
    tier or none (each rank keeps its share of every page in a tier of its own, and must find
    it whenever rank 0 finds its own), and on CUDA a device per rank, rank r on cuda:r."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if config.tier_option not in (None, "host_tier_memory"):
        raise ValueError(f"tensor_parallel_size={size} keeps a host tier only "
                         f"(host_tier_memory): every rank's tier must hold the pages rank "
                         f"0's does, which a disk or Redis tier does not promise; this engine "
                         f"would have {config.tier_option}")
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"tensor_parallel_size={size} puts rank r on cuda:r: rank 0 runs "
                             f"on cuda:0, not {device}")
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, this "
                             f"machine has {torch.cuda.device_count()}")


def process_context() -> multiprocessing.context.BaseContext:
    """The context kvpool starts its processes in (the workers of an engine of several ranks,
    the server's engine processes): forkserver, or spawn where the platform has none. The
    forkserver's process, started at the first process kvpool starts, imports WORKER_MODULES
    once and forks every later process from itself, so each starts with them imported and
    exits without tearing an interpreter down (spawn paid seconds for each). It runs no torch
    op and never touches CUDA, so it has no OpenMP threads or CUDA context for a fork to
    break; it serves every later start and exits with this process, and what it forks sees
    the environment of the moment it started. Its preload list is set here: a program that
    started the forkserver before gets processes that import what they need themselves."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(WORKER_MODULES)
    return context


def connected_key(rank: int) -> str:
    """The store key a worker sets once it has reached rank 0's store."""
    return f"kvpool/connected/{rank}"


def startup_timeout(timeout: float) -> datetime.timedelta:
    """How long the ranks wait for each other to join the group: the collectives' timeout,
    and at least STARTUP_SECONDS for the workers to start (the forkserver's imports, at the
    first engine)."""
    return datetime.timedelta(seconds=max(timeout, STARTUP_SECONDS))


def join_group(rank: int, address: GroupAddress,
               store: dist.Store) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Join the process group as `rank`; returns its two groups: the model's collectives
    (NCCL on CUDA, gloo on the CPU) and the step messages (gloo); gloo is rendezvous.GLOO,
    on the loopback interface. Both fail after the address's timeout, except a worker's wait
    for its next step message, which has no practical limit (the engine may idle); rank 0's
    sending of it has the timeout, so a worker that stops reading fails the step instead of
    hanging it."""
    backend = "nccl" if address.device_type == "cuda" else GLOO
    timeout = datetime.timedelta(seconds=address.timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=address.size,
                            timeout=startup_timeout(address.timeout))
    collectives = dist.new_group(backend=backend, timeout=timeout)
    return collectives, dist.new_group(backend=GLOO,
                                       timeout=timeout if rank == 0 else IDLE_TIMEOUT)


def run_worker(rank: int, address: GroupAddress, specs, reports) -> None:
    """A worker process: join the group, build what rank 0 sends (`specs`), report ready,
    then run rank 0's steps until STOP. An error is reported (with where it was raised) and
    ends the process with code 1."""
    # Ctrl-C at a terminal reaches every process of its group: rank 0 stops the workers on
    # its own interrupt, and a worker exits when rank 0 is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        limit_threads()
        device = torch.device("cpu")
        if address.device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        store = file_store(address.store, address.size, startup_timeout(address.timeout))
        store.set(connected_key(rank), "1")
        collectives, steps = join_group(rank, address, store)
        spec = receive_spec(specs)
        runner = build_runner(TensorParallel(rank, address.size, collectives), spec, device)
        reports.put((rank, None))
        serve(runner, StepChannel(steps, spec))
    except BaseException as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        reports.put((rank, f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def receive_spec(specs) -> WorkerSpec:
    """The WorkerSpec rank 0 sends once it has built its own part; RuntimeError if rank 0
    exits first."""
    while True:
        try:
            return specs.get(timeout=1.0)
        except queue.Empty:
            if not multiprocessing.parent_process().is_alive():
                raise RuntimeError("rank 0 exited before saying what to build") from None


def build_runner(tp: TensorParallel, spec: WorkerSpec, device: torch.device) -> ModelRunner:
    """This rank's part of the model, its pools, tier and workspace, and their runner."""
    loaded = load_model(spec.model, dtype=spec.dtype, device=device, tp=tp,
                        max_model_len=spec.max_model_len)
    tier = HostTier(spec.host_tier_pages) if spec.host_tier_pages else None
    # A worker's prefix cache indexes nothing: it is there for the tier, which needs one.
    cache = KVCache(spec.layout, spec.num_pages, device=device, kv_scales=spec.kv_scales,
                    states=spec.states, prefix_caching=tier is not None, tier=tier,
                    model_fingerprint=weights_fingerprint(loaded.model) if tier else "")
    workspace = Workspace(spec.workspace_bytes, device=device)
    return ModelRunner(loaded.model, cache, workspace, max_step=spec.max_step, peers=NoPeers())


def serve(runner: ModelRunner, channel: StepChannel) -> None:
    """Run rank 0's messages until STOP: copies into this rank's pools (the messages of one
    pending record as one copy, as rank 0's pool made them), pages stored to and loaded from
    its tier (each loaded page the next one fetched), steps through its runner."""
    with torch.inference_mode():
        pools = mirrored_pools(runner.cache)
        copies: list[list[int]] = []  # the entries of a COPY record, its messages so far
        fetched: list[torch.Tensor] = []  # this rank's share of pages rank 0 fetched, to load
        more_fetched = False  # the last message was a FETCH whose record goes on
        while (command := channel.receive()) != STOP:
            if command == RUN:
                runner.forward(*channel.step())
                continue
            pool, entries, more = channel.entries()
            continued, more_fetched = more_fetched, command == FETCH and more
            if command == COPY:
                copies += entries
                if not more:
                    pools[pool].copy([src for src, _ in copies], [dst for _, dst in copies])
                    copies = []
            elif command == STORE:
                store_entries(runner.cache.tier, runner.cache.pool, entries)
            elif command == FETCH:  # a record's first message drops what a failed load left
                fetched = (fetched if continued else []) + fetch_pages(runner.cache.tier, entries)
            else:
                loaded, fetched = fetched[:len(entries)], fetched[len(entries):]
                runner.cache.pool.write_pages([page for page, in entries],
                                              torch.stack(loaded, dim=2))


def key_entry(key: PageKey) -> list[int]:
    """A tier key as message entries: chain key and parent key (KEY_WORDS int64s each),
    token ids."""
    return [*_KEY_CODEC.unpack(key.chain_key), *_KEY_CODEC.unpack(key.parent_key),
            *key.token_ids]


def entry_key(entry: list[int]) -> PageKey:
    """The tier key of message entries made by `key_entry`."""
    return PageKey(_KEY_CODEC.pack(*entry[:KEY_WORDS]),
                   _KEY_CODEC.pack(*entry[KEY_WORDS:2 * KEY_WORDS]),
                   tuple(entry[2 * KEY_WORDS:]))


def store_entries(tier: Tier, pool: KVPool, entries: list[list[int]]) -> None:
    """Store this rank's share of the pages rank 0 evicted to its tier (entries: page, key),
    under the same keys, into this rank's tier (a page it cannot keep is dropped, as there)."""
    store_pages(tier, pool, [page for page, *_ in entries],
                [entry_key(key) for _, *key in entries])


def fetch_pages(tier: Tier, entries: list[list[int]]) -> list[torch.Tensor]:
    """This rank's share of the pages rank 0 fetched from its tier (entries: keys), in the
    same order of tier operations, so both tiers keep the same pages. RuntimeError if this
    rank's tier lost one: the ranks would compute with different prefixes, so the engine
    stops (RankFailed)."""
    fetched = [tier.get(entry_key(key)) for key in entries]
    if any(data is None for data in fetched):
        raise RuntimeError(f"this rank's tier holds {sum(d is not None for d in fetched)} of "
                           f"the {len(entries)} pages rank 0 fetched from its own")
    return fetched
