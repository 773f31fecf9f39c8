"""Probes the server tests run in the engine process (RunningServer.on_engine): they must
pickle, so they are functions of a module, and this one imports only kvpool, so that the
engine process, which imports it to unpickle them, does not load the test's HTTP clients."""

from __future__ import annotations

import contextlib

from kvpool.engine import LLM
from kvpool.errors import EngineDied


def has_unfinished(llm: LLM) -> bool:
    return llm.has_unfinished()


def check_cache(llm: LLM) -> None:
    llm.check()


def cache_stats(llm: LLM):
    return llm.cache.stats()


def used_pages(llm: LLM) -> int:
    return llm.cache.stats().num_used_pages


def num_steps(llm: LLM) -> int:
    return llm.stats().num_steps


def overlapping(llm: LLM) -> bool:
    return llm.overlap


def fail_next_forward(llm: LLM) -> None:
    """Make the engine's next forward (eager, or a CUDA graph's replay) raise
    RuntimeError("injected"), once."""
    def forward_once(batch, previous):
        del llm._forward  # back to the real method
        raise RuntimeError("injected")
    llm._forward = forward_once


class PoisonedSampler:
    """The engine's sampler, except that it raises for any batch holding a request of
    `max_tokens` 7 (the engine then samples each request alone, and only that one fails)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, logits, params, streams, positions):
        if any(p.max_tokens == 7 for p in params):
            raise RuntimeError("injected")
        return self.sampler(logits, params, streams, positions)


def poison_sampling(llm: LLM) -> None:
    """Requests of max_tokens 7 fail in their first step from now on."""
    llm.sampler = PoisonedSampler(llm.sampler)


def heal_sampling(llm: LLM) -> None:
    """Undo `poison_sampling`."""
    llm.sampler = llm.sampler.sampler


def exit_engine(llm: LLM) -> None:
    """End the engine process at once, as a crash would, before it answers."""
    import os

    os._exit(3)


def unpicklable_result(llm: LLM):
    """A result that does not pickle (a local function)."""
    def result():
        return llm
    return result


def fail_an_update_after_a_finish(llm: LLM) -> None:
    """Make the scheduler's update of a step's batch raise RuntimeError("injected") once, in
    the first step that finished a request before it (with overlap: the last step's tokens,
    read before this step's batch is recorded)."""
    scheduler, finish, update = llm.scheduler, llm._finish, llm.scheduler.update
    armed = []

    def finishing(step, start):
        requests = finish(step, start)
        if any(request.finished for request in requests):
            armed.append(True)
            del llm._finish  # back to the real method
        return requests

    def updating(batch):
        if armed:
            del scheduler.update
            raise RuntimeError("injected")
        return update(batch)
    llm._finish, scheduler.update = finishing, updating


def raise_in_the_next_on_step(llm: LLM) -> None:
    """Make the engine's on_step raise RuntimeError("injected") after its next step, once."""
    def on_step(record):
        llm.on_step = None
        raise RuntimeError("injected")
    llm.on_step = on_step


def hang_in_the_next_forward(entered: str, llm: LLM) -> None:
    """Make the engine's next forward never return (a device or a collective that hangs),
    in a process that ignores SIGTERM; it writes the file `entered` once inside."""
    import pathlib
    import signal
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def forward(batch, previous):
        pathlib.Path(entered).touch()
        threading.Event().wait()
    llm._forward = forward


def prefill_pid(llm) -> int:
    """The process id of a DisaggregatedLLM's prefill side."""
    return llm._process.pid


def worker_pid(llm) -> int:
    """The process id of a tensor-parallel engine's first worker (rank 1)."""
    return llm.peers.workers[0].pid


def notice_the_prefill_side_exited(llm) -> None:
    """Wait until a DisaggregatedLLM's prefill process has exited, and have the pair see it
    (as a step would), without raising."""
    llm._process.wait()
    with contextlib.suppress(EngineDied):
        llm.prefill_stats()
