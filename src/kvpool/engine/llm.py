"""LLM: the user-facing engine. `generate` runs a batch of prompts to completion; the
step API (`add_request`, `step`, `abort`, `has_unfinished`) lets a server drive it."""

from __future__ import annotations

import functools
import gc
import math
import threading
import time
import weakref
from collections import abc
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from kvpool.cache import KVCache, StateSpec
from kvpool.devices import made_current
from kvpool.engine.config import EngineConfig, engine_device
from kvpool.engine.graphs import CUDAGraphRunner, replays_graphs
from kvpool.engine.handoff import PrefilledKV, check_prefilled, read_prefilled
from kvpool.engine.overlap import LaunchedStep
from kvpool.engine.parallel import WorkerSpec, check_tensor_parallel, make_peers
from kvpool.engine.params import SamplingParams
from kvpool.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    Sequence,
    SequenceStatus,
)
from kvpool.engine.runner import ModelRunner, StepLayout
from kvpool.engine.sampling import SampledLogprobs, Sampler, token_logprobs
from kvpool.engine.scheduler import ScheduledBatch, Scheduler
from kvpool.engine.stats import EngineStats, StepRecord
from kvpool.engine.tiers import make_tier, tier_counters, weights_fingerprint
from kvpool.errors import (
    EngineStateError,
    InvalidPrompt,
    KVPoolError,
    OutOfPages,
    SequenceTooLong,
    StepFailed,
    check_int,
)
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import RESERVED_SLOTS, MambaLayout
from kvpool.memory.workspace import Workspace
from kvpool.models import check_splits, load_config, load_model
from kvpool.models.config import ModelConfig
from kvpool.planning.group_plan import split_budget
from kvpool.threads import limit_threads

Prompt = str | abc.Sequence[int]  # text (needs a tokenizer) or token ids


class LLM:
    """A model, its paged KV cache and a continuous-batching scheduler.

    `model` is a Hugging Face checkpoint folder or "tiny"; `options` are EngineConfig's
    (page_size, num_pages, memory_fraction, kv_cache_memory, prefix_caching, max_num_seqs,
    max_num_batched_tokens, max_model_len, dtype, kv_cache_dtype, kv_scales, device, seed,
    enforce_eager, overlap). `on_step` is called with a StepRecord after every step. `cache` is
    the KVCache over the model's layer groups: for a hybrid model (Bamba) with a state group, a
    state slot per seat (max_num_seqs) and, with prefix caching, mamba_checkpoint_slots for
    checkpoints, all taken from the cache's budget. A model mixing full-attention and
    sliding-window layers (Gemma 3, Qwen with layer_types) gets a full and a window group:
    the bytes of `num_pages` pages of every layer (planned or given) split between their
    pools (kvpool.planning.group_plan); `free_out_of_window=False` keeps one pool and every page.
    On CUDA every model's decode steps replay CUDA graphs unless `enforce_eager` (or
    `tensor_parallel_size` > 1, which runs eagerly for now, or attention on the torch path:
    triton not installed, fp8 pages before sm_89), and the host schedules each step
    while the device runs the one before (overlap scheduling, kvpool.engine.overlap) unless
    `overlap=False` (or `tensor_parallel_size` > 1); the outputs are the same either way.
    One tier (`host_tier_memory`, `disk_tier`, or `redis_tier`: see EngineConfig) keeps the
    prefix pages the pool evicts, named by the layout and a fingerprint of the weights;
    engines of one model sharing a Redis server share their prefixes. Plain and windowed
    models only: the hybrid and grouped caches refuse a tier. `sleep()` frees the cache (and
    moves the weights to the host at level 2) until `wake()` (one rank only);
    `hold_request`, `resume_request` and `read_prefilled` hand a prompt's KV between two
    engines (kvpool.engine.disaggregated).
    With `tensor_parallel_size` N the model is split across N ranks: this process and N-1
    workers it spawns (kvpool.engine.parallel), each holding its share of every pool (a full
    and a window pool, a hybrid's state slots); `close()` (or leaving a `with` block, or the
    interpreter's exit) stops them. Then the tier may be a host tier only, one per rank.

    Threads: one thread steps (`step` or `generate`); `add_request`, `abort`, `fail_request`,
    `hold_request`, `resume_request`, `read_prefilled`, `stats`, `check`, `sleep` and `wake`
    are safe from another thread and from `on_step`. Each waits for the step in progress (not
    its own, from `on_step`), and a step waits for the calls that came before it, no others:
    neither does a stepping loop hold off a call, nor do calls back to back from any number
    of threads hold off the steps (see `_cut_in`). A Ctrl-C in one of them fails that call
    alone. `step` returns its requests as its step left them, and a request that `abort` or
    `fail_request` finished comes back finished from that call alone, never from a step.
    """

    def __init__(self, model: str | Path, *,
                 on_step: abc.Callable[[StepRecord], None] | None = None, **options):
        self.config = EngineConfig(**options)
        limit_threads()
        device = engine_device(self.config.device)
        mc = load_config(model)
        self.max_model_len = self.config.resolve_max_model_len(mc)
        # Planned before loading, from the config: the memory read then still holds the
        # weights' room, and the plan counts them once.
        mamba = mc.mamba_layout(dtype=self.config.dtype,
                                tensor_parallel_size=self.config.tensor_parallel_size)
        slots = self.config.mamba_checkpoint_slots
        if slots is not None and not (mamba and self.config.prefix_caching):
            why = "prefix_caching is off" if mamba else f"{mc.architecture} has no Mamba layers"
            raise ValueError(f"mamba_checkpoint_slots={slots} hold a hybrid model's prefix "
                             f"checkpoints, but {why}")
        # One state slot per seat: the scheduler never runs more than max_num_seqs sequences.
        num_slots = self.config.max_num_seqs
        num_checkpoints = 0
        if self.config.prefix_caching:
            num_checkpoints = self.config.mamba_checkpoint_slots or num_slots
        state_bytes = (num_slots + num_checkpoints + RESERVED_SLOTS) * mamba.bytes_per_slot \
            if mamba else 0
        layout = self.config.kv_layout(mc)
        if self.config.tier_option and (mamba or (len(layout.groups) > 1
                                                  and self.config.free_out_of_window)):
            kind = "hybrid (Mamba)" if mamba else "grouped (full and sliding-window)"
            raise ValueError(f"{self.config.tier_option}: tiers serve models of one full or "
                             f"windowed pool; this {kind} cache takes none yet")
        check_tensor_parallel(self.config, device)
        check_splits(mc, self.config.tensor_parallel_size)
        num_pages = self.config.plan_num_pages(mc, device, self.max_model_len,
                                               state_bytes=state_bytes)
        self.peers = make_peers(self.config, device)  # spawns the workers: they join and wait
        weakref.finalize(self, self.peers.close)  # at the latest when the interpreter exits
        try:  # a failure from here on stops the workers at once, whoever holds the error
            self._build(model, mc, layout, device, num_pages, mamba, num_slots, num_checkpoints)
        except BaseException:
            self.peers.close()
            raise
        device = self._device
        self.sampler = Sampler(self.config.seed)
        # Overlap scheduling (kvpool.engine.overlap) pays where the device runs apart from
        # the host; on the CPU the forward runs in this thread, so there is nothing to hide.
        self.overlap = self.config.overlap
        if self.overlap is None:
            self.overlap = device.type == "cuda" and self.config.tensor_parallel_size == 1
        self._in_flight: LaunchedStep | None = None  # launched, not finished (overlap)
        self.on_step = on_step
        self._step_record: StepRecord | None = None  # for on_step, at the end of the step
        # Requests a step advanced whose on_step raised: the next step returns them too.
        self._undelivered: list[Request] = []
        self._requests: dict[str, Request] = {}  # unfinished, by id
        # One step, abort or add at a time; re-entrant so that on_step may abort.
        self._lock = threading.RLock()
        # Turns between the steps and the calls from other threads (see _cut_in): each step
        # and call holds a lock of its own, its turn, from when it comes until it is done.
        self._arrivals = threading.Lock()  # held to come: to join or read the two below
        self._step_turn = threading.RLock()  # that of the step that came last
        self._call_turns: set[threading.RLock] = set()  # those of the calls waiting or running
        self._stepping = threading.RLock()  # steps from several threads come one at a time
        self._generating = False
        self._next_request_id = 0
        self._num_steps = self._num_prompt_tokens = self._num_generated_tokens = 0
        self._elapsed = 0.0
        self._first_step_time: float | None = None
        self._sleep_level = 0  # 0 awake; else the level of sleep()

    # ---- batch API ---------------------------------------------------------------------

    def _build(self, model: str | Path, mc: ModelConfig, layout: KVLayout,
               device: torch.device, num_pages: int, mamba: MambaLayout | None, num_slots: int,
               num_checkpoints: int) -> None:
        """Load this rank's part of the model and build the cache, scheduler, workspace and
        runner; then have the workers build theirs."""
        loaded = load_model(model, dtype=self.config.dtype, device=device, tp=self.peers.tp,
                            max_model_len=self.max_model_len)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.model_config = mc
        device = next(self.model.parameters()).device  # with its index: cuda:0, not cuda
        self._device = device
        pages: int | tuple[int, ...] = num_pages
        if len(layout.groups) > 1 and self.config.free_out_of_window and not mamba:
            pages = tuple(pool.num_pages for pool in split_budget(
                layout, num_pages * layout.bytes_per_page,
                max_num_seqs=self.config.max_num_seqs, prefill_tokens=self.max_model_len))
        states = None
        if mamba:
            # Checkpoints at the mixer's chunk boundaries that end a page, and every 256 or
            # so tokens of output.
            interval = math.lcm(mc.mamba.chunk_size, layout.page_size)
            states = StateSpec(mamba, num_slots, num_checkpoints, interval,
                               interval * -(-256 // interval))
        tier = make_tier(self.config, layout.bytes_per_page)
        fingerprint = weights_fingerprint(self.model) if tier is not None else ""
        # Kept to build the cache anew on wake(): a fresh pool, an empty prefix cache.
        self._make_cache = functools.partial(
            KVCache, layout, pages, device=device, prefix_caching=self.config.prefix_caching,
            max_tokens_per_seq=self.max_model_len,
            max_tokens_per_step=self.config.max_num_batched_tokens,
            kv_scales=self.config.kv_scales,
            free_out_of_window=self.config.free_out_of_window, tier=tier,
            model_fingerprint=fingerprint, states=states)
        self.cache = self._make_cache()
        smallest_pool = min(pool.num_pages for pool in self.cache.kv_pools.pools)
        eos = {*mc.eos_token_ids, *(self.tokenizer.eos_token_ids if self.tokenizer else ())}
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len, watermark_pages=max(1, smallest_pool // 100),
            eos_token_ids=eos)
        # Page tables are sized by the longest sequence the pool can hold, not by a context
        # of max_position_embeddings tokens that it never could.
        longest = self.config.longest_sequence(layout, self.max_model_len, self.cache.num_pages)
        workspace_bytes = self.config.workspace_bytes(mc, layout, longest)
        self.workspace = Workspace(workspace_bytes, device=device)
        seqs, width = self.config.max_num_seqs, -(-longest // layout.page_size)
        # a graph bucket of max_num_seqs rows is that many tokens, whatever the token budget
        max_step = StepLayout(seqs, max(self.config.max_num_batched_tokens, seqs), width, seqs)
        self._max_step, self._longest = max_step, longest
        self._build_runner()
        self.peers.start(WorkerSpec(str(model), self.config.dtype, layout,
                                    pages,
                                    self.config.kv_scales, workspace_bytes,
                                    self.runner.max_step, states,
                                    tier.capacity_pages if tier is not None else 0,
                                    self.max_model_len), self.cache)

    def generate(self, prompts: Prompt | abc.Sequence[Prompt],
                 sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (texts or token id lists; one prompt alone too) to completion and
        return one RequestOutput per prompt, in order. `sampling_params`: one for all, or
        one per prompt. A request that could never fit (SequenceTooLong, OutOfPages) is
        not run: its output has `error` set and finish_reason "error"; the others run.
        Bad arguments raise before anything is queued. generate serves only its own
        requests: it raises RuntimeError while requests of `add_request` are unfinished,
        and `add_request` is refused while it runs. A request aborted meanwhile (from
        `on_step` or another thread) finishes with "abort"; if generate itself raises (or
        is interrupted), its unfinished requests are aborted first."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        with self._lock:
            self._check_idle()
            requests = [self._new_request(p, sp, None)
                        for p, sp in zip(prompts, params, strict=True)]
            for request in requests:
                try:
                    self.scheduler.check_fits(request)
                except (SequenceTooLong, OutOfPages) as e:
                    request.error = e
            pending = [r for r in requests if r.error is None]
            for request in pending:
                self._add(request)
            self._generating = True
        try:
            self._run_to_completion(pending, len(requests), use_tqdm)
        except BaseException:
            for request in pending:
                self.abort(request.request_id)
            raise
        finally:
            self._generating = False
            self._undelivered = []  # generate's own requests: its return gives them
        return [self._output(r) for r in requests]

    def _run_to_completion(self, pending: list[Request], total: int, use_tqdm: bool) -> None:
        """Step until every request of `pending` has finished (or was aborted)."""
        with tqdm(total=total, initial=total - len(pending), unit="req", desc="generate",
                  disable=not use_tqdm) as bar:
            while pending:
                self._step(self._step_locked)
                unfinished = [r for r in pending if not r.finished]
                if use_tqdm and len(unfinished) < len(pending):
                    bar.update(len(pending) - len(unfinished))
                    if self._elapsed:  # zero when the only requests were aborted at once
                        rate = self._num_generated_tokens / self._elapsed
                        bar.set_postfix_str(f"{rate:.0f} tok/s")
                pending = unfinished

    def _check_idle(self) -> None:
        """generate runs alone: no step-API request may be waiting or running."""
        if self._generating:
            raise RuntimeError("generate() is running; it serves only its own requests")
        if self._requests:
            raise RuntimeError(f"generate() serves only its own requests, and "
                               f"{len(self._requests)} request(s) of add_request are "
                               f"unfinished: step them to completion or abort them first")

    # ---- step API ----------------------------------------------------------------------

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, cache_salt: str | None = None) -> str:
        """Queue a prompt; returns its request id. Raises SequenceTooLong or OutOfPages
        (with the numbers) if it could never fit, ValueError for a bad prompt or an id in use
        (TypeError for an id that is not a str). With a
        `cache_salt`, the prompt shares cached prefix pages only with prompts of the same
        salt (neither reads nor reveals those of others)."""
        with self._cut_in():
            self._refuse_while_generating("add_request")
            request = self._checked_request(prompt, sampling_params, request_id, cache_salt)
            self._add(request)
            return request.request_id

    def _refuse_while_generating(self, call: str) -> None:
        """generate serves only its own requests: no other may be queued while it runs."""
        if self._generating:
            raise RuntimeError(f"{call}() while generate() runs: generate serves only its own "
                               f"requests")

    def step(self) -> list[RequestOutput]:
        """Run one step (one forward); returns the requests that got new tokens, or failed
        in it (finish reason "error": only they; the others go on), as they stood when the
        step ended. If `on_step` raised in the step before, its requests come back from this
        one too; a request that `abort` or `fail_request` handed out meanwhile does not."""
        return self._step(self._step_outputs)

    def _step_outputs(self) -> list[RequestOutput]:
        """step()'s step, under the lock (where generate cannot begin meanwhile): the outputs
        of the requests that advanced, built before another thread's abort can change them."""
        if self._generating:
            raise RuntimeError("step() while generate() runs: generate steps the engine itself")
        return [self._output(r) for r in self._step_locked()]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel an unfinished request: its samples finish with "abort" and their pages
        come back at once. Returns its final output (no step returns it after); None for an
        unknown or finished id. Safe from `on_step` and from another thread (it waits for
        the step in progress)."""
        with self._cut_in():
            request = self._requests.pop(request_id, None)
            if request is None:
                return None
            self.scheduler.abort(request)
            return self._final_output(request)

    def _final_output(self, request: Request) -> RequestOutput:
        """The output of a request abort or fail_request just finished, which hands it out:
        dropped from those a step whose on_step raised kept for the next step (or that the
        step whose on_step calls this returns), so no step hands it out again."""
        self._undelivered = [r for r in self._undelivered if r is not request]
        return self._output(request)

    def close(self) -> None:
        """Stop a tensor-parallel engine's workers and its process group; it runs no step
        after it (nothing to do on one device). Safe to call twice."""
        self.peers.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def check(self) -> None:
        """The engine's invariants: the cache's, the scheduler's, and its unfinished requests
        exactly those with a sample waiting or running and those held (`hold_request`: no
        sample yet). AssertionError naming what breaks; EngineStateError while asleep.
        O(tokens + pages): for tests and debugging."""
        with self._cut_in():
            self._check_awake()
            self.cache.check()
            self.scheduler.check()
            queued = {seq.request.request_id
                      for seq in [*self.scheduler.waiting, *self.scheduler.running]}
            held = {rid for rid, request in self._requests.items() if not request.seqs}
            assert queued | held == set(self._requests) and not queued & held, (
                f"requests with a queued sample {sorted(queued)}, held {sorted(held)}, "
                f"unfinished {sorted(self._requests)}")

    def _num_sequences(self) -> tuple[int, int]:
        """Running and waiting sequences: every sample of a request, forked or not, and the
        samples of a held request (`hold_request`) waiting."""
        num_running, num_waiting = self.scheduler.num_seats()
        held = sum(r.params.n for r in self._requests.values() if not r.seqs)
        return num_running, num_waiting + held

    def stats(self) -> EngineStats:
        """The engine's counters and the pool's pages now (EngineStateError while asleep:
        there is no pool). Safe from another thread (it waits for the step in progress)."""
        with self._cut_in():
            self._check_awake()
            return self._stats()

    @property
    def alive(self) -> bool:
        """Whether the engine can still step: False once a tensor-parallel rank died or
        failed (every step would raise RankFailed). Reads no device."""
        return self.peers.alive

    def stats_by_side(self) -> dict[str | None, EngineStats]:
        """`stats()` of each engine this object runs, by its side of a disaggregated pair
        (DisaggregatedLLM: "prefill" and "decode"); one engine's under None."""
        return {None: self.stats()}

    def _stats(self) -> EngineStats:
        cs = self.cache.stats()
        num_running, num_waiting = self._num_sequences()
        return EngineStats(
            num_running=num_running, num_waiting=num_waiting,
            num_used_pages=cs.num_used_pages, num_cached_pages=cs.num_cached_pages,
            num_free_pages=cs.num_free_pages, kv_utilization=cs.kv_utilization,
            prefix_hit_rate=cs.prefix_hit_rate, prefix_query_tokens=cs.prefix_query_tokens,
            prefix_hit_tokens=cs.prefix_hit_tokens, num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps, num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens, elapsed=self._elapsed,
            workspace_bytes=self.workspace.nbytes, workspace_peak_bytes=self.workspace.peak,
            num_cuda_graphs=len(self.graphs.graphs) if self.graphs else 0,
            cuda_graph_bytes=self.config.cuda_graph_bytes(self.model_config, self.model.dtype)
            if self.graphs else 0,
            num_graph_steps=self.graphs.num_replays if self.graphs else 0,
            **tier_counters(self.cache))

    # ---- sleep and wake ----------------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        """True between sleep() and wake()."""
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Give the KV cache's memory back: the pool (and a hybrid's state slots) is freed
        and the prefix cache dropped; with a tier, its cached pages move to the tier first.
        Level 2 also moves the weights to the host. CUDA graphs go too (they replay the old
        pool's addresses). Refused with EngineStateError while requests are unfinished (abort
        or finish them first) or when asleep already; nothing changes then."""
        check_int("sleep level (1: the KV cache, 2: and the weights)", level, 1, 2)
        if self.config.tensor_parallel_size > 1:
            raise EngineStateError("sleep() frees rank 0's cache only: not supported with "
                                   f"tensor_parallel_size {self.config.tensor_parallel_size}")
        with self._cut_in():
            if self.sleeping:
                raise EngineStateError(f"the engine is asleep already (level "
                                       f"{self._sleep_level}); wake() it first")
            if self._requests or self.scheduler.has_unfinished():
                raise EngineStateError(f"sleep() with {len(self._requests)} request(s) "
                                       f"unfinished: finish or abort them first")
            if self.cache.prefix_cache is not None:
                self.cache.prefix_cache.clear()  # a tier takes the pages it evicts
            self._release(level)
            self._sleep_level = level

    def wake(self) -> None:
        """Undo sleep(): the weights back on the device, a new pool with an empty prefix
        cache (pages in a tier load back as before), CUDA graphs captured again.
        EngineStateError when awake; a wake that fails (the device out of memory) leaves the
        engine asleep as it was, holding no pool, and raises."""
        with self._cut_in():
            if not self.sleeping:
                raise EngineStateError("wake() while awake: only a sleeping engine wakes")
            try:
                if self._sleep_level == 2:
                    self.model.to(self._device)
                self.cache = self.scheduler.cache = self._make_cache()
                self._build_runner()
            except BaseException:  # (the device out of memory) asleep as before the call
                self._release(self._sleep_level)
                raise
            self._sleep_level = 0

    def _release(self, level: int) -> None:
        """Drop the cache, its runner and CUDA graphs (if built), and at level 2 move the
        weights to the host; their device memory goes back to the device."""
        pools = [] if self.cache is None else [weakref.ref(p.kv) for p in self.cache.kv_pools.pools]
        self.cache = self.scheduler.cache = self.runner = self.graphs = None
        if any(pool() is not None for pool in pools):
            gc.collect()  # a cache with an eviction hook (a tier) is a reference cycle
        if level == 2:
            self.model.to("cpu")
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_awake(self) -> None:
        if self.sleeping:
            raise EngineStateError(f"the engine is asleep (level {self._sleep_level}): "
                                   f"wake() it first")

    def _build_runner(self) -> None:
        """The runner over the cache; on one CUDA device its prefill kernels compiled by a
        warm-up, and (unless enforce_eager) the decode steps' CUDA graphs, captured now."""
        self.runner = ModelRunner(self.model, self.cache, self.workspace,
                                  max_step=self._max_step, peers=self.peers)
        self.graphs = None  # decode steps replay CUDA graphs on CUDA unless enforce_eager
        one_gpu = self._device.type == "cuda" and self.config.tensor_parallel_size == 1
        with made_current(self._device):
            if one_gpu:  # the shortest prefill and the longest chunk a step holds
                longest = min(self.config.max_num_batched_tokens, self._longest)
                self.runner.warm_up(sorted({min(2, longest), longest}))
            if one_gpu and not self.config.enforce_eager and replays_graphs(
                    self._device, self.cache.layout.dtype):
                self.graphs = CUDAGraphRunner(self.runner, self.config.max_num_seqs,
                                              self._longest)
                self.graphs.capture()

    # ---- prefill elsewhere (kvpool.engine.disaggregated) -------------------------------

    def hold_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                     request_id: str | None = None, *,
                     cache_salt: str | None = None) -> tuple[str, list[int]]:
        """Take a request whose prompt another engine prefills: checked as add_request
        checks it, unfinished (abort and fail_request work), but queued only once
        `resume_request` brings its KV. Returns its id and the prompt's token ids."""
        with self._cut_in():
            self._refuse_while_generating("hold_request")
            request = self._checked_request(prompt, sampling_params, request_id, cache_salt)
            self._requests[request.request_id] = request
            return request.request_id, list(request.prompt_token_ids)

    @property
    def takes_prefilled(self) -> bool:
        """Whether `resume_request` takes KV computed elsewhere (and `read_prefilled` reads
        any prompt's KV whole): the cache has one pool (a hybrid's state slots beside it),
        keeps every page of a sequence, and is on one rank (the workers of a tensor-parallel
        engine would not get their share of it). EngineStateError while asleep."""
        self._check_awake()
        return [group.window for group in self.cache.page_groups] == [None] \
            and self.config.tensor_parallel_size == 1

    def resume_request(self, request_id: str, prefilled: PrefilledKV | None) -> None:
        """Queue a held request; `prefilled` is the KV of its first prompt tokens (None:
        computed here). Admitted, it starts past them (or past its own prefix hit, pages and
        state kept, where that covers more); preempted, it recomputes them."""
        if prefilled is not None and not self.takes_prefilled:
            raise ValueError("KV computed elsewhere needs a cache of one pool that keeps every "
                             "page, on one rank; this engine's (a full and a window pool, "
                             "pages given back out of the window, or tensor_parallel_size "
                             f"{self.config.tensor_parallel_size}) takes none")
        with self._cut_in():
            self._refuse_while_generating("resume_request")
            request = self._requests.get(request_id)
            if request is None or request.seqs:
                raise ValueError(f"request {request_id!r} is not held (unknown, finished, or "
                                 f"queued already)")
            if prefilled is not None:
                check_prefilled(self.cache, prefilled, len(request.prompt_token_ids))
            request.prefilled = prefilled
            self.scheduler.add_request(request)

    def fail_request(self, request_id: str, error: KVPoolError) -> RequestOutput | None:
        """Finish an unfinished request with "error" (`error` says why); its pages come back.
        Returns its final output; None for an unknown or finished id. TypeError, changing
        nothing, for an `error` that is not a KVPoolError."""
        if not isinstance(error, KVPoolError):
            raise TypeError(f"error must be a KVPoolError saying why the request failed, got "
                            f"{type(error).__name__} {error!r}")
        with self._cut_in():
            request = self._requests.pop(request_id, None)
            if request is None:
                return None
            self.scheduler.fail(request, error)
            return self._final_output(request)

    def read_prefilled(self, request_id: str) -> PrefilledKV:
        """A copy of the KV of the computed tokens of a request's first sample (after the
        step that prefilled its prompt: every prompt token), and a hybrid's state after them:
        what another engine continues from. KeyError for an id that is not running;
        EngineStateError with overlap scheduling, where the next step may already be running
        (build the engine with overlap=False), and unless the engine `takes_prefilled`: a
        cache of several pools, or one giving pages back out of a sliding window, would hand
        over part of the KV (build it with free_out_of_window=False)."""
        if self.overlap:
            raise EngineStateError("read_prefilled needs an engine built with overlap=False: "
                                   "with overlap the step after the prompt may be running")
        if not self.takes_prefilled:
            raise EngineStateError(
                "read_prefilled needs a cache of one pool that keeps every page, on one rank: "
                "this engine's (a full and a window pool, pages given back out of the window, "
                "or several ranks) would hand over part of the KV; build it with "
                "free_out_of_window=False (and tensor_parallel_size=1)")
        with self._cut_in():
            request = self._requests.get(request_id)
            if request is None or not request.seqs or \
                    request.seqs[0].status is not SequenceStatus.RUNNING:
                raise KeyError(f"request {request_id!r} is not running")
            seq = request.seqs[0]
            return read_prefilled(self.cache, seq.seq_id, seq.num_computed_tokens,
                                  with_state=self.runner.has_states)

    # ---- internals ---------------------------------------------------------------------

    def _step(self, run: abc.Callable[[], list]) -> list:
        """Take a step's turn (see _cut_in), then `run` the step under the lock
        (`_step_locked`, or step()'s `_step_outputs`) and return what it returns."""
        turn = threading.RLock()
        with self._stepping, turn:
            with self._arrivals:
                self._step_turn = turn
                calls = list(self._call_turns)
            for call in calls:  # the calls that came before this step go first
                _wait_for(call)
            # One inference mode for the whole step; buffers a step writes in place were
            # allocated at setup, outside it.
            with self._lock, torch.inference_mode(), made_current(self._device):
                self._check_awake()  # here, under the lock: another thread may sleep() meanwhile
                return run()

    @contextmanager
    def _cut_in(self) -> abc.Iterator[None]:
        """Hold the engine for a call made outside the stepping loop (or from on_step).
        The lock alone is not fair: a thread stepping in a loop takes it back at once, and an
        abort from another thread could wait out the whole generation. So calls and steps
        take turns in the order they come (`_arrivals` orders them): a step waits for the
        calls that came before it (`_step`), and a call for the step that came before it.
        Calls back to back, from any number of threads, delay a step but never hold it off.
        A turn is an RLock, passed at once by its own thread (a call from on_step passes its
        step's; a step of a second stepping thread waits for `_stepping` before it comes, so
        such a call never waits for it), and `with` gives it back however the call or step
        ends: a Ctrl-C anywhere in one holds up no other, as nothing is counted that an
        interrupt could leave uncounted. (One that lands
        in contextlib's own code as the call takes or gives back the lock leaves this
        generator suspended, holding both, until the interrupt's traceback is freed.)"""
        turn = threading.RLock()
        with turn:
            try:
                with self._arrivals:
                    self._call_turns.add(turn)
                    step = self._step_turn
                _wait_for(step)  # the step that came before this call goes first
                with self._lock:
                    yield
            finally:
                self._call_turns.discard(turn)

    def _step_locked(self) -> list[Request]:
        """Launch a step and finish one: without overlap the same step; with it, the step
        launched by the call before (kvpool.engine.overlap), so that the device runs this
        call's step while the host reads the last one's tokens."""
        start = time.perf_counter()
        if self._first_step_time is None:
            self._first_step_time = start
        batch = self.scheduler.schedule()
        self._forget(batch.failed)
        self._undelivered += batch.failed  # handed out by a later call if what follows raises
        previous = self._in_flight
        # A hybrid's forward runs the batch through its Mamba layers, updating their state
        # slots in place: until `_launch` records the batch, no step could compute those
        # tokens again. So if anything raises in between (the forward half way, or with
        # overlap the last step's finish) its requests fail; a plain model's rewrite the
        # same K/V next step.
        with self._failing_if_interrupted(batch.seqs) if self.runner.has_states \
                else nullcontext():
            logits = self._forward(batch, previous) if batch.seqs else None
            self._in_flight = None
            # handed out by a later call if what follows raises
            self._undelivered += self._finish(previous, start) if previous else []
            launched, failed = self._launch(batch, logits) if batch.seqs else (None, [])
        self._forget(failed)
        if launched is not None and not self.overlap:
            self._undelivered += self._finish(launched, start)
            launched = None
        self._in_flight = launched
        self._undelivered += failed
        self._report()  # last: an on_step that raises finds every step recorded
        advanced, self._undelivered = self._undelivered, []  # less what on_step aborted
        return list(dict.fromkeys(advanced))

    def _forward(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> torch.Tensor:
        """Queue the batch's forward; returns its logits. Placeholder input ids take the
        tokens `previous` samples."""
        last_tokens = previous.tokens if previous else None
        # A graph replay runs no Python, so no layer could take its fp8 scales there.
        use_graphs = self.graphs is not None and self.runner.kv.scales_ready
        bucket = self.graphs.bucket(batch) if use_graphs else None
        if bucket:
            return self.graphs.run(batch, bucket, last_tokens)
        return self.runner.run(batch, last_tokens)

    def _launch(self, batch: ScheduledBatch, logits: torch.Tensor
                ) -> tuple[LaunchedStep | None, list[Request]]:
        """Record the batch as computed and queue the sampling of its tokens. Returns the
        step (None when every sequence of the batch finished while it ran: nothing of it is
        kept) and the requests whose sampling raised, finished with "error" now."""
        with self._failing_if_interrupted(batch.seqs):
            seqs, logit_rows = self.scheduler.update(batch)
            if all(seq.finished for seq in batch.seqs):
                return None, []
            # forked samples read their parent's row; a sequence that finished reads none
            if logit_rows != list(range(len(logits))):
                logits = logits[_on_device(logit_rows, logits.device)]
            seqs, tokens, finite, logprobs, failed = self._sample_each_request(logits, seqs)
            self.scheduler.add_placeholders(seqs)
            return LaunchedStep.sampled(batch, seqs, tokens, finite, logprobs), failed

    def _finish(self, step: LaunchedStep, start: float) -> list[Request]:
        """Read the step's tokens on the host, give each sequence its token (and logprobs)
        and finish those that stop; returns the requests that advanced."""
        with self._failing_if_interrupted(step.seqs):
            token_ids, finite, entries = step.host.wait()
            failed = self._fail_non_finite(step.seqs, finite)
            if entries is not None:
                for seq, entry in zip(step.seqs, entries, strict=True):
                    if entry is not None and not seq.finished:
                        seq.logprobs.append(entry)
            # a sequence aborted or failed while the step ran drops its token
            num_kept = sum(not seq.finished for seq in step.seqs)
            requests = failed + self.scheduler.postprocess(step.seqs, token_ids)
        self._forget([request for request in requests if request.finished])
        self._count(step.batch, num_kept, start)
        return requests

    @contextmanager
    def _failing_if_interrupted(self, seqs: list[Sequence]) -> abc.Iterator[None]:
        """Fail the unfinished requests of `seqs` if the block raises anyway (a Ctrl-C, or a
        fault past the per-request handling) and re-raise: their step is half recorded, a
        state no later step could continue from, so they end with "error" and give their
        pages back, and the engine goes on with the others."""
        try:
            yield
        except BaseException as e:
            requests = list(dict.fromkeys(s.request for s in seqs if not s.request.finished))
            for request in requests:
                self.scheduler.fail(request, StepFailed(
                    f"request {request.request_id!r} failed: its step was interrupted by "
                    f"{type(e).__name__}: {e}"))
            self._forget(requests)
            raise

    def _fail_non_finite(self, seqs: list[Sequence], finite: list[bool]) -> list[Request]:
        """Fail the requests of `seqs` whose row of logits held NaN or infinity (an overflow
        of the model's dtype, bad weights): their token is noise. Returns them."""
        failed = []
        for seq, ok in zip(seqs, finite, strict=True):
            if not ok and not seq.finished:
                self.scheduler.fail(seq.request, StepFailed(
                    f"request {seq.request.request_id!r} failed: the model's logits for its "
                    f"token at position {seq.num_tokens - 1} hold NaN or infinity (an "
                    f"overflow of the model's dtype, or weights gone bad)"))
                failed.append(seq.request)
        return failed

    def _forget(self, finished: list[Request]) -> None:
        """Drop finished requests from the unfinished ones."""
        for request in finished:
            del self._requests[request.request_id]

    def _sample_each_request(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """Sample a token for each of `seqs` (row i of `logits`) on the device, with the
        logprobs asked for. When that raises, each request's rows are sampled alone: a
        request whose sampling fails finishes with "error" (its pages come back), the others
        keep their tokens, the same as in the whole batch (a row's draw never depends on the
        other rows), so nobody's step is lost and the engine goes on."""
        try:
            tokens, failed = self._sample(logits, seqs), []
        except Exception:  # some request's rows raised: find whose, below
            rows, tokens, failed = self._sample_requests_alone(logits, seqs)
            seqs = [seqs[row] for row in rows]
            logits = logits[_on_device(rows, logits.device)]
        logprobs = token_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
        return Sampled(seqs, tokens, logits.isfinite().all(dim=-1), logprobs, failed)

    def _sample_requests_alone(self, logits: torch.Tensor, seqs: list[Sequence]
                               ) -> tuple[list[int], torch.Tensor, list[Request]]:
        """`_sample_each_request` one request at a time: a request whose rows raise is failed
        (StepFailed naming the cause), the others sample as they would have in the batch.
        Returns (the rows that sampled, their tokens, the requests that failed)."""
        rows_of: dict[Request, list[int]] = {}
        for row, seq in enumerate(seqs):
            rows_of.setdefault(seq.request, []).append(row)
        kept: list[int] = []
        tokens: list[torch.Tensor] = []
        failed: list[Request] = []
        for request, rows in rows_of.items():
            try:
                tokens.append(self._sample(logits[_on_device(rows, logits.device)],
                                           [seqs[row] for row in rows]))
            except Exception as e:
                self.scheduler.fail(request, StepFailed(
                    f"request {request.request_id!r} failed while sampling: "
                    f"{type(e).__name__}: {e}"))
                failed.append(request)
            else:
                kept += rows
        sampled = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long,
                                                               device=logits.device)
        return kept, sampled, failed

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The token of each of `seqs` from its row of `logits`, on the device; changes
        nothing."""
        streams = [s.index if s.params.seed is not None else s.seq_id for s in seqs]
        return self.sampler(logits, [s.params for s in seqs], streams,
                            [s.num_tokens for s in seqs])

    def _count(self, batch: ScheduledBatch, num_sampled: int, start: float) -> None:
        end = time.perf_counter()
        self._num_steps += 1
        self._num_prompt_tokens += batch.num_tokens - batch.num_decode_tokens
        self._num_generated_tokens += num_sampled
        self._elapsed += end - start
        if self.on_step is None:
            return
        free, cached = self.cache.num_free_pages, self.cache.num_cached_pages
        num_running, num_waiting = self._num_sequences()
        self._step_record = StepRecord(
            step=self._num_steps - 1, time=end - self._first_step_time, duration=end - start,
            num_running=num_running, num_waiting=num_waiting,
            num_batched_tokens=batch.num_tokens, num_decode_tokens=batch.num_decode_tokens,
            num_used_pages=self.cache.num_pages - free - cached,
            num_cached_pages=cached, num_free_pages=free,
            num_preemptions=self.scheduler.num_preemptions)

    def _report(self) -> None:
        """Give on_step the record of the step finished last, if any."""
        record, self._step_record = self._step_record, None
        if record is not None:
            self.on_step(record)

    def _checked_request(self, prompt: Prompt, params: SamplingParams | None,
                         request_id: str | None, cache_salt: str | None) -> Request:
        """A Request for add_request, checked to fit (not queued yet)."""
        request = self._new_request(prompt, params or SamplingParams(), request_id)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, "
                            f"got {type(cache_salt).__name__}")
        request.cache_salt = cache_salt
        self.scheduler.check_fits(request)
        return request

    def _new_request(self, prompt: Prompt, params: SamplingParams,
                     request_id: str | None) -> Request:
        """Validate and tokenize a prompt into a Request (not queued yet)."""
        self._check_awake()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            while str(self._next_request_id) in self._requests:
                self._next_request_id += 1
            request_id = str(self._next_request_id)
            self._next_request_id += 1
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        elif request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return Request(request_id, *self._tokenize(prompt), params)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPrompt("this model has no tokenizer.json: pass prompts as token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, abc.Iterable):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidPrompt(f"a prompt must be a str or a list of token ids, "
                                f"got {type(prompt).__name__} {prompt!r}")
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise InvalidPrompt("a prompt must hold at least one token")
        bad = [t for t in token_ids if not (_is_token(t) and t < vocab)]
        if bad:
            raise InvalidPrompt(f"prompt token ids must be ints in [0, {vocab}), got {bad[0]!r}")
        return text, token_ids

    def _add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request

    def _output(self, request: Request) -> RequestOutput:
        """The request's state as a RequestOutput (text decoded when there is a tokenizer)."""
        outputs = [self._completion(seq) for seq in request.seqs]
        reason = "error" if request.error else "abort" if request.aborted else None
        asked = request.params.logprobs is not None
        outputs += [CompletionOutput(i, [], "", reason, [] if asked else None)
                    for i in range(len(outputs), request.params.n)]  # samples not forked yet
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             outputs, request.finished, request.error,
                             request.num_cached_tokens or 0, request.scheduled_time)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        """A sample's output. Its text, while it runs, is what the sequence's text stream has
        decoded (new tokens only: a step costs time linear in them); once finished, the full
        decode of its tokens, less a stop token."""
        token_ids = seq.output_token_ids
        context = seq.request.prompt_token_ids[-1]  # the text reads on from the prompt's
        if self.tokenizer is None:
            text = ""
        elif seq.finished:
            text = self.tokenizer.decode(token_ids[:-1] if seq.finish_reason == "stop"
                                         else token_ids, context=context)
        else:
            if seq.text_stream is None:
                seq.text_stream = self.tokenizer.stream(context=context)
            text = seq.text_stream.text(token_ids)
        logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
        return CompletionOutput(seq.index, token_ids, text, seq.finish_reason, logprobs)


def _on_device(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on `device`, copied without waiting for the device's queued work (a
    step's forward may still run there)."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def _is_one_prompt(prompts: object) -> bool:
    """Whether `generate` was given one prompt: a text, or a list of token ids (items that
    are neither texts nor lists: a bad id is that prompt's error, not a batch)."""
    return isinstance(prompts, str) or (
        isinstance(prompts, abc.Sequence) and len(prompts) > 0
        and not any(isinstance(p, (str, abc.Iterable)) for p in prompts))


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _per_prompt(params: SamplingParams | abc.Sequence[SamplingParams] | None,
                num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from None (defaults), one for all, or a list."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
    return params


class Sampled(NamedTuple):
    """What a step's sampling gave: `tokens[i]` (on the device) for `seqs[i]`, whether row
    i's logits were finite (on the device), the logprobs asked for, and the requests whose
    sampling raised."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    finite: torch.Tensor
    logprobs: SampledLogprobs | None
    failed: list[Request]


def _wait_for(turn: threading.RLock) -> None:
    """Return once the holder of `turn` (a step's or a call's) is done with it: take it and
    give it back at once (at once too for this thread's own turn, an RLock)."""
    with turn:
        return
