"""Scheduler: continuous batching over the paged KV cache, with chunked prefill, prefix
reuse, forking of parallel samples and preemption by recompute.

State is two deques of sequences: `waiting` (no pages) and `running` (pages in the cache,
in admission order). Every step decodes the running sequences, continues their prefills,
and admits waiting ones while seats, pages and the token budget allow; it never calls the
model. Order is first come, first served: when the token budget runs out, the newest
running sequences wait a step. A running sequence that cannot get a page preempts the most
recently admitted one, which frees its pages and is recomputed later from its tokens
(prompt and output kept). A prompt's pages are taken whole at admission, so that its
prefill never preempts; when the cache gives pages back as sequences grow (every layer
windowed), they are taken chunk by chunk instead, so that a long prompt never holds more
than its window and one chunk. A sequence is committed to the prefix cache whenever every
token the cache holds for it is computed: after a prompt's last chunk (or after each chunk,
when taken chunk by chunk), and after every decode.

A step's sampled tokens may stay on the device while the next step is scheduled (overlap
scheduling): each sampling sequence then ends in a placeholder, a negative id naming its row
of the step's sampled tokens (`placeholder`), until `postprocess` puts the token in its place.
A sequence whose placeholder is its max_tokens-th output token is not scheduled again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from contextlib import suppress
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool.cache import SequenceCache
from kvpool.engine.handoff import write_prefilled
from kvpool.engine.request import Request, Sequence, SequenceStatus
from kvpool.engine.sampling import stop_reason
from kvpool.errors import KVPoolError, OutOfPages, SequenceTooLong, StepFailed, UnknownSequence


def placeholder(row: int) -> int:
    """The id a sequence holds for the token it samples from row `row` of a step's sampled
    tokens, until that token reaches the host: -1 - row (token ids are never negative)."""
    return -1 - row


@dataclass(slots=True)
class ScheduledBatch:
    """The work of one step: sequence i computes its tokens [starts[i], ends[i]).
    `sampled[i]`: that chunk ends the sequence's tokens, so its last logits pick a token."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    num_decode_tokens: int = 0  # tokens of sequences that grew by their last sampled token
    failed: list[Request] = field(default_factory=list)  # failed being admitted: finished

    def add(self, seq: Sequence, num_new_tokens: int, *, decode: bool) -> None:
        """Schedule the next `num_new_tokens` uncomputed tokens of `seq`."""
        start = seq.num_computed_tokens
        self.seqs.append(seq)
        self.starts.append(start)
        self.ends.append(start + num_new_tokens)
        self.sampled.append(start + num_new_tokens == seq.num_tokens)
        self.num_decode_tokens += num_new_tokens if decode else 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the step's forward."""
        return sum(self.ends) - sum(self.starts)


class Samples(NamedTuple):
    """The sequences that sample a token after a step, and for each the row of the step's
    logits it reads (the samples forked from a prompt just prefilled share its row)."""

    seqs: list[Sequence]
    logit_rows: list[int]


class Scheduler:
    """Decides, step by step, which tokens of which sequences the model computes, and
    keeps the cache's sequences in step with them.

    `max_num_seqs` caps running sequences (a request not yet forked counts its n samples),
    `max_num_batched_tokens` the tokens of one forward; admission leaves
    `watermark_pages` available so that running decodes do not preempt at once.
    """

    def __init__(self, cache: SequenceCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, watermark_pages: int, eos_token_ids: Collection[int]):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_pages = watermark_pages
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._next_seq_id = 0

    # ---- requests ----------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raise SequenceTooLong or OutOfPages if a sample of the request could never run,
        even alone (`check_length`). More samples than max_num_seqs raise ValueError."""
        if request.params.n > self.max_num_seqs:
            raise ValueError(f"n={request.params.n} samples exceed max_num_seqs "
                             f"{self.max_num_seqs}")
        self.check_length(len(request.prompt_token_ids), request.params.max_tokens)

    def check_length(self, num_prompt: int, max_tokens: int) -> None:
        """Raise SequenceTooLong or OutOfPages if a sequence of a prompt of `num_prompt`
        tokens and `max_tokens` generated could never run, even alone: its last token's KV
        is never needed, so it holds num_prompt + max_tokens - 1 tokens at most."""
        total = num_prompt + max_tokens
        if total > self.max_model_len:
            raise SequenceTooLong(
                f"prompt of {num_prompt} tokens + max_tokens {max_tokens} = {total} tokens, "
                f"over max_model_len {self.max_model_len}")
        try:
            self.cache.check_fits(total - 1)
        except OutOfPages as e:
            raise OutOfPages(f"prompt of {num_prompt} tokens + max_tokens {max_tokens}: "
                             f"{e}") from None

    def add_request(self, request: Request) -> None:
        """Queue the request's first sequence (its other samples fork from it later, with
        the ids reserved for them now, so that a sample's id never depends on when its
        prompt was prefilled). Call `check_fits` first."""
        self.waiting.append(self._new_sequence(request, list(request.prompt_token_ids)))
        self._next_seq_id += request.params.n - 1

    def abort(self, request: Request) -> None:
        """Finish every unfinished sample of the request with "abort"; pages come back now."""
        request.aborted = True
        self._end(request, "abort")

    def fail(self, request: Request, error: KVPoolError) -> None:
        """Finish every unfinished sample of the request with "error" (`error` says why);
        pages come back now. The other requests are not touched."""
        request.error = error
        self._end(request, "error")

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens: running sequences first (decodes and prefill chunks,
        preempting the newest when pages run out), then waiting ones in order."""
        batch = ScheduledBatch()
        try:
            budget = self._schedule_running_at_once(batch)
        except OutOfPages:
            budget = self._schedule_running_one_by_one(batch)
        # counted only when someone waits: a decode step with nobody waiting pays nothing
        seats = sum(self._seats(s) for s in self.running) if self.waiting else 0
        while self.waiting and budget and seats + self._seats(self.waiting[0]) <= self.max_num_seqs:
            seq = self.waiting[0]
            if self._reached_max_tokens(seq):  # preempted just now; it finishes on its token
                break
            salt = seq.request.cache_salt
            entering = self.cache.tokens_to_admit(seq.token_ids, budget, cache_salt=salt)
            if self.running and not self.cache.can_add(seq.token_ids, entering=entering,
                                                       spare_pages=self.watermark_pages,
                                                       cache_salt=salt):
                break
            # added before it leaves the queue: a Ctrl-C anywhere until it runs leaves it
            # waiting, holding nothing, not lost; a fault of its own admission (a device
            # fault copying its state, or the KV another engine handed over) fails it alone
            try:
                hit = self.cache.add_sequence(seq.seq_id, seq.token_ids, entering=entering,
                                              cache_salt=salt)
                seq.num_computed_tokens = hit
                if seq.request.prefilled is not None:  # past the hit: not counted as cached
                    self._load_prefilled(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.waiting.popleft()
            except Exception as e:
                self._unadmit(seq)
                self.fail(seq.request, StepFailed(
                    f"request {seq.request.request_id!r} failed: its admission raised "
                    f"{type(e).__name__}: {e}"))
                batch.failed.append(seq.request)
                continue
            except BaseException:
                self._unadmit(seq)
                raise
            seats += self._seats(seq)
            if seq.request.scheduled_time is None:
                seq.request.num_cached_tokens = hit
                seq.request.scheduled_time = time.perf_counter()
            num_new = min(entering - seq.num_computed_tokens, budget)
            batch.add(seq, num_new, decode=False)
            budget -= num_new
        return batch

    def _schedule_running_at_once(self, batch: ScheduledBatch) -> int:
        """Schedule the running sequences in order while the token budget lasts, growing
        them in the cache with one call. Raises OutOfPages, having changed nothing, when
        the pages run out. Returns the budget left."""
        budget = self.max_num_batched_tokens
        seqs, ends, grow_ids, grow_tokens = [], [], [], []
        for seq in self.running:
            if not budget:
                break
            if self._reached_max_tokens(seq):
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            end = seq.num_computed_tokens + num_new
            seqs.append(seq)
            ends.append(end)
            budget -= num_new
            missing = self._missing(seq, end)
            if missing:
                grow_ids.append(seq.seq_id)
                grow_tokens.append(missing)
        self.cache.append_batch(grow_ids, token_ids=grow_tokens)
        for seq, end in zip(seqs, ends, strict=True):
            num_new = end - seq.num_computed_tokens
            batch.add(seq, num_new, decode=self._is_decode(seq, num_new))
        return budget

    def _schedule_running_one_by_one(self, batch: ScheduledBatch) -> int:
        """Schedule the running sequences in order while the token budget lasts; one that
        cannot grow preempts the newest (itself, if it is the newest left). Returns the
        budget left."""
        budget = self.max_num_batched_tokens
        before = list(self.running)
        queue, self.running = self.running, deque()
        try:
            while queue and budget:
                seq = queue.popleft()
                if self._reached_max_tokens(seq):
                    self.running.append(seq)
                    continue
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                end = seq.num_computed_tokens + num_new
                while not self._can_grow(seq, end):
                    self._preempt(queue.pop() if queue else seq)
                    if seq.status is SequenceStatus.WAITING:
                        break
                else:
                    self._grow(seq, end)
                    batch.add(seq, num_new, decode=self._is_decode(seq, num_new))
                    self.running.append(seq)
                    budget -= num_new
        except BaseException:  # a Ctrl-C half way: `queue` held sequences no queue holds
            self._requeue(before)
            raise
        self.running.extend(queue)
        return budget

    def update(self, batch: ScheduledBatch) -> Samples:
        """After the forward: record the computed tokens, commit them to the cache once it
        holds no token still to compute, and fork the samples of prompts just prefilled.
        Returns who samples now, from which rows. A sequence that finished while the step
        ran (stopped on the previous step's token, or aborted) is skipped: its token is
        dropped."""
        seqs, rows = [], []
        row = -1
        for seq, end, sampled in zip(batch.seqs, batch.ends, batch.sampled, strict=True):
            row += sampled
            if seq.finished:
                continue
            seq.num_computed_tokens = end
            if end == self.cache.num_tokens(seq.seq_id):
                self.cache.commit(seq.seq_id)
            if sampled:
                seqs.append(seq)
                rows.append(row)
                if not seq.request.forked:
                    children = self._fork(seq)
                    seqs += children
                    rows += [row] * len(children)
        return Samples(seqs, rows)

    def add_placeholders(self, seqs: list[Sequence]) -> None:
        """Each of `seqs` samples a token this step, from the sampled tokens' row of its
        index: it holds `placeholder(row)` for it until `postprocess`."""
        for row, seq in enumerate(seqs):
            seq.token_ids.append(placeholder(row))

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Request]:
        """Put each sequence's sampled token in place of its placeholder (in the cache too,
        where the next step took it in already) and finish those that stop. A sequence that
        finished meanwhile (aborted) is skipped. Returns the requests that advanced, in
        order."""
        advanced = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            if seq.finished:
                continue
            advanced.append(seq)
            seq.token_ids[-1] = token_id
            if seq.status is SequenceStatus.RUNNING and \
                    self.cache.num_tokens(seq.seq_id) == seq.num_tokens:
                self.cache.set_last_token(seq.seq_id, token_id)
            num_output = seq.num_tokens - len(seq.request.prompt_token_ids)
            reason = stop_reason(token_id, num_output, seq.params, self.eos_token_ids)
            if reason is not None:
                self._finish(seq, reason)
        return list(dict.fromkeys(seq.request for seq in advanced))

    def check(self) -> None:
        """The queues, their sequences and the cache agree: a waiting sequence is WAITING with
        nothing computed and no cache sequence; a running one RUNNING, its cache sequence
        holding its computed tokens and at most its tokens; the running ones take at most
        `max_num_seqs` seats; only a last token may be a placeholder. AssertionError naming
        the first sequence that breaks one. O(tokens): for tests and debugging."""
        queued = [*self.waiting, *self.running]
        ids = [seq.seq_id for seq in queued]
        assert len(set(ids)) == len(ids), f"a sequence is queued twice: {sorted(ids)}"
        running = {seq.seq_id for seq in self.running}
        in_cache = set(self.cache.sequences())
        assert in_cache == running, (f"the cache holds sequences {sorted(in_cache)}, the "
                                     f"running ones are {sorted(running)}")
        for seq in queued:
            sid = seq.seq_id
            assert seq.request.seqs[seq.index] is seq, (
                f"sequence {sid} is not sample {seq.index} of its request")
            assert sid < self._next_seq_id, (
                f"sequence {sid} has an id not handed out yet (next: {self._next_seq_id})")
            assert min(seq.token_ids[:-1], default=0) >= 0, (
                f"sequence {sid} has a placeholder before its last token")
            status = SequenceStatus.RUNNING if sid in running else SequenceStatus.WAITING
            assert seq.status is status, f"sequence {sid} is queued {status}, marked {seq.status}"
            held = self.cache.num_tokens(sid) if sid in running else 0
            assert seq.num_computed_tokens <= held <= seq.num_tokens, (
                f"{seq.status.value} sequence {sid}: {seq.num_computed_tokens} tokens computed, "
                f"{held} in the cache, {seq.num_tokens} in all")
        seats = sum(self._seats(seq) for seq in self.running)
        assert seats <= self.max_num_seqs, (
            f"running sequences take {seats} seats, over max_num_seqs {self.max_num_seqs}")

    # ---- check / act -------------------------------------------------------------------

    def _missing(self, seq: Sequence, end: int) -> list[int]:
        """The sequence's tokens up to `end` that the cache does not hold yet: its last
        sampled token, or its next prompt chunk when pages are taken chunk by chunk."""
        return seq.token_ids[self.cache.num_tokens(seq.seq_id):end]

    def _can_grow(self, seq: Sequence, end: int) -> bool:
        """Can the cache hold the sequence's tokens up to `end`?"""
        missing = self._missing(seq, end)
        return not missing or self.cache.can_append(seq.seq_id, len(missing))

    def _grow(self, seq: Sequence, end: int) -> None:
        """Append the sequence's tokens up to `end` that the cache does not hold yet."""
        missing = self._missing(seq, end)
        if missing:
            self.cache.append(seq.seq_id, token_ids=missing)

    def _load_prefilled(self, seq: Sequence) -> None:
        """Write the KV another engine computed for the first prompt tokens of a sequence
        just admitted into its pages past its prefix hit, and start it past them. Used once:
        a preempted sequence recomputes."""
        kv, seq.request.prefilled = seq.request.prefilled, None
        if kv.num_tokens > seq.num_computed_tokens:  # else its hit holds as much, state too
            write_prefilled(self.cache, seq.seq_id, kv)
            seq.num_computed_tokens = kv.num_tokens

    @staticmethod
    def _reached_max_tokens(seq: Sequence) -> bool:
        """Has the sequence sampled its last token (max_tokens), still a placeholder? Then
        it finishes on it, whatever it is."""
        return seq.num_tokens - len(seq.request.prompt_token_ids) >= seq.params.max_tokens

    @staticmethod
    def _is_decode(seq: Sequence, num_new: int) -> bool:
        """Does the step compute just the token the sequence sampled last?"""
        return (num_new == 1 and seq.num_computed_tokens == seq.num_tokens - 1
                and seq.num_computed_tokens >= len(seq.request.prompt_token_ids))

    def _unadmit(self, seq: Sequence) -> None:
        """Undo the admission of the first waiting sequence, cut short (a load that raised,
        a Ctrl-C): it waits first in line again, holding nothing in the cache."""
        self._free_if_held(seq)
        if self.running and self.running[-1] is seq:
            self.running.pop()
        if not (self.waiting and self.waiting[0] is seq):
            self.waiting.appendleft(seq)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0

    def _free_if_held(self, seq: Sequence) -> None:
        """Give back the sequence's pages if the cache holds it (a waiting one it does not)."""
        with suppress(UnknownSequence):
            self.cache.free_sequence(seq.seq_id)

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Put back `seqs`, the running sequences of a preemption loop cut short, as the
        cache holds them: running (in their order) if it does, else preempted, first in the
        waiting queue."""
        held = set(self.cache.sequences())
        preempted = [seq for seq in seqs if seq.seq_id not in held]
        for seq in preempted:
            seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.running = deque(seq for seq in seqs if seq.seq_id in held)
        self.waiting = deque([*preempted, *(s for s in self.waiting if s not in preempted)])

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages and put it at the front of the queue, to recompute."""
        self.cache.free_sequence(seq.seq_id)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- sequences ---------------------------------------------------------------------

    def num_seats(self) -> tuple[int, int]:
        """Running and waiting sequences, the samples of a request not yet forked counted
        (each will take a running slot)."""
        return sum(map(self._seats, self.running)), sum(map(self._seats, self.waiting))

    def _seats(self, seq: Sequence) -> int:
        """Running slots the sequence takes: its request's n until the samples are forked."""
        return 1 if seq.request.forked else seq.params.n

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create the request's other samples, sharing the parent's pages, after it."""
        children = []
        for _ in range(1, parent.params.n):
            child = self._new_sequence(parent.request, list(parent.token_ids),
                                       parent.seq_id + len(parent.request.seqs))
            self.cache.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            self.running.append(child)
            children.append(child)
        return children

    def _new_sequence(self, request: Request, token_ids: list[int],
                      seq_id: int | None = None) -> Sequence:
        """A new sample of the request: its first with the next free id, or a fork with the
        id reserved for it."""
        if seq_id is None:
            seq_id = self._next_seq_id
            self._next_seq_id += 1
        seq = Sequence(seq_id, request, len(request.seqs), token_ids)
        request.seqs.append(seq)
        return seq

    def _finish(self, seq: Sequence, reason: str) -> None:
        """A sequence is done: its pages go back (committed ones stay cached) and it leaves
        its queue. A token it was still sampling is dropped. One that a Ctrl-C left half
        made (a sample being forked: in no queue, maybe not in the cache) finishes too."""
        self._free_if_held(seq)
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        if seq in queue:
            queue.remove(seq)
        if seq.token_ids[-1] < 0:
            seq.token_ids.pop()
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _end(self, request: Request, reason: str) -> None:
        """Finish every unfinished sample of the request with `reason`; pages come back."""
        for seq in request.seqs:
            if not seq.finished:
                self._finish(seq, reason)
