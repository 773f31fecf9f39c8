"""HybridCache: the cache of a hybrid model. A sequence holds its KV pages (for the attention
layers, in a KVCache it composes) and one state slot (for the Mamba layers, in a MambaPool)
together: created, forked and freed as one. It offers KVCache's sequence API, so the
scheduler and the runner drive it unchanged.

With prefix caching, the KV prefix cache shares pages as for any model, and StateCheckpoints
keeps the Mamba state after some cached prefixes: within a prompt at the last multiple of
`checkpoint_interval` tokens each prefill chunk reaches, and after it at every multiple of
`track_interval` tokens. A new sequence's hit is the
deepest checkpoint no longer than its KV match; the checkpoint is copied into the sequence's
own slot (copy-on-write: a state is written at every token, so it is never shared). The
sequence shares every page of its KV match all the same: the tokens between the hit and the
end of the KV match are computed again for the Mamba layers' sake, but their K/V, which the
shared pages hold already, is written to the pool's reserved padding page (`slot_mapping`
points there)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvpool.cache import CacheStats, KVCache
from kvpool.errors import DuplicateSequence, OutOfStateSlots, UnknownSequence, check_int
from kvpool.layout import KVLayout
from kvpool.state_checkpoints import StateCheckpoints
from kvpool.state_pool import CheckpointRequest, MambaLayout, MambaPool, StateBatch, StateStats
from kvpool.tokens import TOKEN_BYTES, pack_tokens


@dataclass(slots=True)
class _HybridSequence:
    slot: int
    num_prompt_tokens: int  # tokens at creation: checkpoints every checkpoint_interval
    token_ids: bytearray | None  # packed; None when unknown (no checkpoints)
    num_shared: int  # tokens of the KV match: their K/V is in shared pages, never rewritten
    pending: list[tuple[int, int]] = field(default_factory=list)  # (tokens, reserved slot)


class HybridCache:
    """`num_pages` KV pages of `layout`, and state slots of `mamba_layout`: `num_state_slots`
    for sequences (each live sequence holds one) plus `num_checkpoint_slots` for the prefix
    cache's checkpoints, all on `device` (keyword-only, no default). Every mutating call checks
    first and then acts: a call that raises has changed nothing. Recomputed tokens of a KV
    match write to the pool's reserved padding page, which no sequence holds."""

    def __init__(self, layout: KVLayout, num_pages: int, mamba_layout: MambaLayout,
                 num_state_slots: int, *, device: str | torch.device, policy: str = "lifo",
                 prefix_caching: bool = False, num_checkpoint_slots: int = 0,
                 checkpoint_interval: int = 64, track_interval: int = 256,
                 max_tokens_per_seq: int | None = None, scrub_on_free: bool = False,
                 kv_scales=None):
        check_int("num_state_slots", num_state_slots, 1)
        check_int("num_checkpoint_slots", num_checkpoint_slots, 1 if prefix_caching else 0)
        check_int("checkpoint_interval", checkpoint_interval, 1)
        check_int("track_interval", track_interval, 1)
        if checkpoint_interval % layout.page_size or track_interval % checkpoint_interval:
            raise ValueError(f"checkpoint_interval {checkpoint_interval} must be a multiple of "
                             f"page_size {layout.page_size}, and track_interval "
                             f"{track_interval} a multiple of it")
        self.kv = KVCache(layout, num_pages, device=device, policy=policy,
                          prefix_caching=prefix_caching, max_tokens_per_seq=max_tokens_per_seq,
                          scrub_on_free=scrub_on_free, kv_scales=kv_scales)
        self.num_sequence_slots = num_state_slots
        self.states = MambaPool(mamba_layout, num_state_slots + num_checkpoint_slots,
                                device=self.kv.device)
        # Without prefix caching, capacity 0: never a checkpoint, never a hit.
        self.checkpoints = StateCheckpoints(
            self.states, num_checkpoint_slots if prefix_caching else 0, checkpoint_interval)
        self.track_interval = track_interval
        self._seqs: dict[Hashable, _HybridSequence] = {}
        self._query_tokens = self._hit_tokens = 0
        self._num_evicted_pages = 0  # the KV evictions already swept for orphan checkpoints

    # ---- sequences: pages and a state slot together --------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Create a sequence with its pages (sharing its KV match) and a state slot. Returns
        the tokens served from the prefix cache: the deepest checkpoint within the KV match
        (0 without one), whose state the sequence's slot now holds. Raises OutOfStateSlots
        or KVCache's errors, having changed nothing. A sequence with a `cache_salt` shares
        KV pages only with its salt's (KVCache.add_sequence) and neither uses nor makes
        checkpoints, which are keyed by content alone: it is served no tokens."""
        self._check_new(seq_id)
        ids = None if token_ids is None else pack_tokens(token_ids)
        hit, checkpoint = (self._match(ids, len(token_ids))
                           if ids is not None and cache_salt is None else (0, None))
        shared = self.kv.add_sequence(seq_id, token_ids, num_tokens=num_tokens,
                                      cache_salt=cache_salt)
        slot = self.states.allocate()
        if checkpoint is not None:
            self.states.copy(checkpoint, slot)
            self.checkpoints.touch(ids[:hit * TOKEN_BYTES])
        self._seqs[seq_id] = _HybridSequence(
            slot, self.kv.num_tokens(seq_id),
            None if ids is None or cache_salt is not None else bytearray(ids), shared)
        if ids is not None and self.kv.prefix_cache is not None:
            self._query_tokens += len(token_ids)
            self._hit_tokens += hit
        self._drop_orphans()
        return hit

    def append(self, seq_id: Hashable, num_tokens: int | None = None, *,
               token_ids: Sequence[int] | None = None) -> list[int]:
        """Grow the sequence's pages (its state slot is updated in place by the model)."""
        seq = self._get(seq_id)
        slots = self.kv.append(seq_id, num_tokens, token_ids=token_ids)
        self._extend(seq, token_ids)
        self._drop_orphans()
        return slots

    def append_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | None = None,
                     *, token_ids: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Grow many sequences' pages in one call, as `KVCache.append_batch`: all or, raising,
        none."""
        seqs = [self._get(seq_id) for seq_id in seq_ids]
        slots = self.kv.append_batch(seq_ids, num_tokens, token_ids=token_ids)
        for i, seq in enumerate(seqs):
            self._extend(seq, None if token_ids is None else token_ids[i])
        self._drop_orphans()
        return slots

    @staticmethod
    def _extend(seq: _HybridSequence, token_ids: Sequence[int] | None) -> None:
        """Record the ids of tokens appended to `seq` (None: unknown, no more checkpoints)."""
        if seq.token_ids is not None:
            if token_ids is None:
                seq.token_ids = None
            else:
                seq.token_ids += pack_tokens(token_ids)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing the parent's pages, with a copy of its state in a slot of
        its own."""
        parent = self._get(parent_id)
        self._check_new(child_id)
        self.kv.fork(parent_id, child_id)
        child = self.states.allocate()
        self.states.copy(parent.slot, child)
        token_ids = None if parent.token_ids is None else bytearray(parent.token_ids)
        self._seqs[child_id] = _HybridSequence(child, parent.num_prompt_tokens, token_ids,
                                               parent.num_shared)

    def commit(self, seq_id: Hashable) -> None:
        """Declare the sequence's KV written: its full pages become matchable, and so do the
        checkpoints computed for it whose pages are now in the prefix cache."""
        seq = self._get(seq_id)
        self.kv.commit(seq_id)
        for length, slot in seq.pending:
            prefix = None if seq.token_ids is None else bytes(
                seq.token_ids[:length * TOKEN_BYTES])
            if prefix is not None and self._kv_cached(prefix):
                self.checkpoints.add(prefix, slot)
            else:  # tokens unknown, or another copy of the prefix holds the pages
                self.checkpoints.release(slot)
        seq.pending = []

    def set_last_token(self, seq_id: Hashable, token_id: int) -> None:
        """Record the id of the sequence's last token, appended before it was known
        (KVCache.set_last_token), for its pages and its checkpoints."""
        seq = self._get(seq_id)
        self.kv.set_last_token(seq_id, token_id)
        if seq.token_ids is not None:
            seq.token_ids[-TOKEN_BYTES:] = pack_tokens([token_id])

    def free_sequence(self, seq_id: Hashable) -> None:
        """Give back the sequence's pages, its state slot and its uncommitted checkpoints."""
        seq = self._get(seq_id)
        self.kv.free_sequence(seq_id)
        for _, slot in seq.pending:
            self.checkpoints.release(slot)
        self.states.free(seq.slot)
        del self._seqs[seq_id]

    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` cached KV pages (least recently used first) and the
        checkpoints that needed them; returns the pages evicted."""
        pages = self.kv.allocator.evict(num_pages)
        self._drop_orphans()
        return len(pages)

    def evict_checkpoints(self, n: int) -> int:
        """Evict up to `n` checkpoints (least recently used first); their prefixes' KV pages
        stay (tombstones). Returns how many went."""
        return self.checkpoints.evict(n)

    # ---- state slots -------------------------------------------------------------------

    def state_slot(self, seq_id: Hashable) -> int:
        """The sequence's state slot."""
        return self._get(seq_id).slot

    def state_batch(self, seq_ids: Sequence[Hashable], starts: Sequence[int] | None = None,
                    ends: Sequence[int] | None = None) -> StateBatch:
        """The state slots of a step's sequences, in order, for the model. With the step's
        token ranges [starts[i], ends[i]) and prefix caching, also the checkpoints to save
        (a reserved slot each, added to the prefix cache at the sequence's next commit).
        Everything is checked before a slot is reserved: ValueError, changing nothing, for
        ranges that are not one per sequence within the tokens it holds."""
        slots = torch.tensor([self.state_slot(s) for s in seq_ids], dtype=torch.int64,
                             device=self.device)
        self._check_ranges(seq_ids, starts, ends)
        requests = []
        if starts is not None and self.checkpoints.capacity:
            for index, (seq_id, start, end) in enumerate(zip(seq_ids, starts, ends,
                                                             strict=True)):
                requests += self._checkpoint_requests(index, seq_id, start, end)
        return StateBatch(self.states, slots, requests)

    @property
    def num_free_state_slots(self) -> int:
        """State slots on the free list."""
        return self.states.num_free

    def state_stats(self) -> StateStats:
        """The state pool's counters."""
        return self.states.stats()

    # ---- KVCache's queries -------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        """The KV layout (attention layers only)."""
        return self.kv.layout

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv.page_size

    @property
    def pool(self):
        """The KVPool of the attention layers."""
        return self.kv.pool

    @property
    def allocator(self):
        """The page allocator."""
        return self.kv.allocator

    @property
    def prefix_cache(self):
        """The KV prefix cache (None when off)."""
        return self.kv.prefix_cache

    @property
    def device(self) -> torch.device:
        """Where the pools live."""
        return self.kv.device

    @property
    def num_pages(self) -> int:
        """Pages in the KV pool."""
        return self.kv.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list."""
        return self.kv.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages only the prefix cache holds."""
        return self.kv.num_cached_pages

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get."""
        return self.kv.num_available_pages

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds."""
        return self.kv.num_tokens(seq_id)

    def pages(self, seq_id: Hashable) -> list[int]:
        """The sequence's page table (a copy)."""
        return self.kv.pages(seq_id)

    def slots(self, seq_id: Hashable) -> list[int]:
        """The KV slot of each of the sequence's tokens."""
        return self.kv.slots(seq_id)

    def sequences(self) -> list[Hashable]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def pages_to_add(self, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Available pages `add_sequence` would consume. Changes nothing."""
        return self.kv.pages_to_add(token_ids, num_tokens=num_tokens, cache_salt=cache_salt)

    def pages_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Pages `append` would take."""
        return self.kv.pages_to_append(seq_id, num_tokens)

    @property
    def frees_out_of_window(self) -> bool:
        """False: a hybrid model's KV pages are kept for the whole context."""
        return False

    def can_add(self, token_ids: Sequence[int], *, spare_pages: int = 0,
                entering: int | None = None, cache_salt: str | None = None) -> bool:
        """Whether the KV cache could add the sequence leaving `spare_pages` available (a
        state slot is checked by `add_sequence`); `entering` as for KVCache."""
        return self.kv.can_add(token_ids, spare_pages=spare_pages, entering=entering,
                               cache_salt=cache_salt)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether `append` would succeed."""
        return self.kv.can_append(seq_id, num_tokens)

    def check_fits(self, num_tokens: int) -> None:
        """Raise OutOfPages unless one sequence of `num_tokens` tokens fits, alone."""
        self.kv.check_fits(num_tokens)

    def page_tables(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Page tables `[batch, max_pages]` int32 on the host (KVCache.page_tables)."""
        return self.kv.page_tables(seq_ids)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int]) -> torch.Tensor:
        """KV slots int64 on the host of tokens [starts[i], ends[i]) of each sequence; the
        tokens of a sequence's KV match (computed again after a shallower checkpoint hit)
        write to the pool's reserved padding page instead of the shared pages."""
        slots = self.kv.slot_mapping(seq_ids, starts, ends)
        offset = 0
        for seq_id, start, end in zip(seq_ids, starts, ends, strict=True):
            shared = self._get(seq_id).num_shared
            if start < shared:
                slots[offset:offset + min(end, shared) - start] = self.kv.pool.padding_slot
            offset += end - start
        return slots

    def stats(self) -> CacheStats:
        """The KV cache's counters, with the prefix hits as served: up to checkpoints
        (`state_stats` has the state pool's)."""
        return replace(self.kv.stats(), prefix_query_tokens=self._query_tokens,
                       prefix_hit_tokens=self._hit_tokens)

    def check(self) -> None:
        """KVCache's, MambaPool's and StateCheckpoints' invariants, plus: the live sequences
        are the same in both caches, at most num_state_slots of them; each state slot is
        counted once (held by one sequence, one checkpoint or one reservation); every
        checkpoint's prefix has its KV pages in the prefix cache."""
        self.kv.check()
        self.states.check()
        self.checkpoints.check()
        with_pages = self.kv.sequences()
        assert list(self._seqs) == with_pages, (
            f"sequences with state slots {list(self._seqs)} differ from those with pages "
            f"{with_pages}")
        assert len(self._seqs) <= self.num_sequence_slots, (
            f"{len(self._seqs)} sequences for {self.num_sequence_slots} state slots")
        held = [seq.slot for seq in self._seqs.values()] + self.checkpoints.held_slots()
        assert len(set(held)) == len(held), f"a state slot is counted twice: {sorted(held)}"
        reserved = {slot for seq in self._seqs.values() for _, slot in seq.pending}
        assert reserved <= set(self.checkpoints.held_slots()), (
            f"pending checkpoint slots {reserved} are not reserved")
        for slot in range(self.states.num_slots):
            want = int(slot in held)
            assert self.states.refcount(slot) == want, (
                f"state slot {slot} has reference count {self.states.refcount(slot)}, "
                f"expected {want}")
        for prefix in self.checkpoints.prefixes():
            assert self._kv_cached(prefix), (
                f"checkpoint after {len(prefix) // TOKEN_BYTES} tokens has no KV pages")

    # ---- internals ---------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _HybridSequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return seq

    def _check_new(self, seq_id: Hashable) -> None:
        """Raise before acting: the id is new and a sequence's state slot is free."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists")
        if len(self._seqs) == self.num_sequence_slots:
            raise OutOfStateSlots(f"need 1 state slot, 0 free of {self.num_sequence_slots} "
                                  f"(each of {len(self._seqs)} sequences holds one)")

    def _match(self, ids: bytes, n: int) -> tuple[int, int | None]:
        """(hit tokens, checkpoint slot): the deepest checkpoint within the KV match of a
        sequence of `n` tokens (whole pages, never the last token). Changes nothing."""
        cache = self.kv.prefix_cache
        if cache is None or not len(self.checkpoints):
            return 0, None
        kv_pages = len(cache.match(ids, (n - 1) // self.page_size).pages)
        return self.checkpoints.deepest(ids, kv_pages * self.page_size)

    def _check_ranges(self, seq_ids: Sequence[Hashable], starts: Sequence[int] | None,
                      ends: Sequence[int] | None) -> None:
        """Raise ValueError unless `starts` and `ends` are both None, or give each sequence
        a range 0 <= start <= end <= the tokens it holds."""
        if starts is None and ends is None:
            return
        if starts is None or ends is None or not len(starts) == len(ends) == len(seq_ids):
            shown = [None if r is None else len(r) for r in (starts, ends)]
            raise ValueError(f"starts and ends must each give one token index per sequence "
                             f"({len(seq_ids)}), got lengths {shown[0]} and {shown[1]}")
        for seq_id, start, end in zip(seq_ids, starts, ends, strict=True):
            num_tokens = self.num_tokens(seq_id)
            if not (isinstance(start, int) and isinstance(end, int)
                    and 0 <= start <= end <= num_tokens):
                raise ValueError(f"sequence {seq_id!r} holds {num_tokens} tokens: its range "
                                 f"must be 0 <= start <= end <= {num_tokens}, got [{start}, "
                                 f"{end})")

    def _checkpoint_requests(self, index: int, seq_id: Hashable, start: int,
                             end: int) -> list[CheckpointRequest]:
        """Checkpoints to save while computing tokens [start, end) of a sequence, not saved
        yet, while slots last: in the prompt, at the last checkpoint_interval multiple the
        chunk reaches (where a later chunk or prompt would resume); after it, at every
        track_interval multiple."""
        seq = self._get(seq_id)
        if seq.token_ids is None:
            return []
        prompt_end = min(end, seq.num_prompt_tokens)
        last = prompt_end // self.checkpoints.interval * self.checkpoints.interval
        lengths = [last] if last > start else []
        track = self.track_interval
        lengths += range((max(start, seq.num_prompt_tokens) // track + 1) * track, end + 1, track)
        requests = []
        for length in lengths:
            if self.checkpoints.has(bytes(seq.token_ids[:length * TOKEN_BYTES])):
                continue
            slot = self.checkpoints.reserve()
            if slot is None:
                break
            seq.pending.append((length, slot))
            requests.append(CheckpointRequest(index, length, slot))
        return requests

    def _kv_cached(self, prefix: bytes) -> bool:
        """Does the KV prefix cache hold every page of this packed prefix?"""
        num_pages = len(prefix) // TOKEN_BYTES // self.page_size
        return len(self.kv.prefix_cache.match(prefix, num_pages).pages) == num_pages

    def _drop_orphans(self) -> None:
        """After KV pages were evicted, drop the checkpoints whose prefix lost a page (a
        state is of no use without the KV before it)."""
        evicted = self.kv.allocator.stats().num_evicted
        if evicted == self._num_evicted_pages:
            return
        self._num_evicted_pages = evicted
        self.checkpoints.drop([p for p in self.checkpoints.prefixes() if not self._kv_cached(p)])
