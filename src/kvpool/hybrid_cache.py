"""HybridCache: the cache of a hybrid model. A sequence holds its KV pages (for the attention
layers, in a KVCache it composes) and one state slot (for the Mamba layers, in a MambaPool)
together: created, forked and freed as one.

It offers KVCache's sequence API, so the scheduler and the runner drive it unchanged.
Prefix caching is not offered: a prefix hit would need the Mamba state after the hit, which
only a state checkpoint can give, and those are not kept yet."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvpool.cache import CacheStats, KVCache
from kvpool.errors import DuplicateSequence, OutOfStateSlots, UnknownSequence
from kvpool.layout import KVLayout
from kvpool.state_pool import MambaLayout, MambaPool, StateBatch, StateStats


class HybridCache:
    """`num_pages` KV pages of `layout` and `num_state_slots` state slots of `mamba_layout`,
    on one device; each live sequence holds pages and exactly one slot. Every mutating call
    checks first and then acts: a call that raises has changed nothing."""

    def __init__(self, layout: KVLayout, num_pages: int, mamba_layout: MambaLayout,
                 num_state_slots: int, *, device=None, policy: str = "lifo",
                 max_tokens_per_seq: int | None = None, scrub_on_free: bool = False):
        self.kv = KVCache(layout, num_pages, device=device, policy=policy,
                          max_tokens_per_seq=max_tokens_per_seq, scrub_on_free=scrub_on_free)
        self.states = MambaPool(mamba_layout, num_state_slots, device=self.kv.device)
        self._slots: dict[Hashable, int] = {}

    # ---- sequences: pages and a state slot together --------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None) -> int:
        """Create a sequence with its pages and a state slot; returns 0 (no prefix hits).
        Raises OutOfStateSlots, or KVCache's errors, having changed nothing."""
        self._check_free_slot(seq_id)
        served = self.kv.add_sequence(seq_id, token_ids, num_tokens=num_tokens)
        self._slots[seq_id] = self.states.allocate()
        return served

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing the parent's pages, with a copy of its state in a slot of
        its own (a state is written at every token, so it is never shared)."""
        parent = self.state_slot(parent_id)
        self._check_free_slot(child_id)
        self.kv.fork(parent_id, child_id)
        child = self.states.allocate()
        self.states.copy(parent, child)
        self._slots[child_id] = child

    def free_sequence(self, seq_id: Hashable) -> None:
        """Give back the sequence's pages and its state slot."""
        slot = self.state_slot(seq_id)
        self.kv.free_sequence(seq_id)
        self.states.free(slot)
        del self._slots[seq_id]

    def append(self, seq_id: Hashable, num_tokens: int | None = None, *,
               token_ids: Sequence[int] | None = None) -> list[int]:
        """Grow the sequence's pages (its state slot is updated in place by the model)."""
        return self.kv.append(seq_id, num_tokens, token_ids=token_ids)

    def commit(self, seq_id: Hashable) -> None:
        """Declare the sequence's KV written (no prefix caching: nothing to share)."""
        self.kv.commit(seq_id)

    # ---- state slots -------------------------------------------------------------------

    def state_slot(self, seq_id: Hashable) -> int:
        """The sequence's state slot."""
        slot = self._slots.get(seq_id)
        if slot is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return slot

    def state_batch(self, seq_ids: Sequence[Hashable]) -> StateBatch:
        """The state slots of a step's sequences, in order, for the model."""
        slots = torch.tensor([self.state_slot(s) for s in seq_ids], dtype=torch.int64,
                             device=self.device)
        return StateBatch(self.states, slots)

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
    def prefix_cache(self) -> None:
        """Always None: hybrid prefix caching is not offered (see the module)."""
        return None

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
        """Always 0 without prefix caching."""
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
        return self.kv.sequences()

    def pages_to_add(self, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None) -> int:
        """Pages `add_sequence` would take."""
        return self.kv.pages_to_add(token_ids, num_tokens=num_tokens)

    def pages_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Pages `append` would take."""
        return self.kv.pages_to_append(seq_id, num_tokens)

    def page_tables(self, seq_ids: Sequence[Hashable], *, device=None) -> torch.Tensor:
        """Page tables `[batch, max_pages]` int32."""
        return self.kv.page_tables(seq_ids, device=device)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int], *, device=None) -> torch.Tensor:
        """KV slots int64 of tokens [starts[i], ends[i]) of each sequence, concatenated."""
        return self.kv.slot_mapping(seq_ids, starts, ends, device=device)

    def stats(self) -> CacheStats:
        """The KV cache's counters (`state_stats` has the state pool's)."""
        return self.kv.stats()

    def check(self) -> None:
        """KVCache's and MambaPool's invariants, plus: the live sequences are the same in
        both, each holds one slot, no slot is held twice, and every held slot is a live
        sequence's (reference count 1)."""
        self.kv.check()
        self.states.check()
        assert list(self._slots) == self.kv.sequences(), (
            f"sequences with state slots {list(self._slots)} differ from those with pages "
            f"{self.kv.sequences()}")
        held = list(self._slots.values())
        assert len(set(held)) == len(held), f"a state slot is held twice: {self._slots}"
        for slot in range(self.states.num_slots):
            want = 1 if slot in held else 0
            assert self.states.refcount(slot) == want, (
                f"state slot {slot} has reference count {self.states.refcount(slot)}, "
                f"expected {want}")

    def _check_free_slot(self, seq_id: Hashable) -> None:
        """Raise before acting: the id is new and a state slot is free."""
        if seq_id in self._slots:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists")
        if not self.states.num_free:
            raise OutOfStateSlots(f"need 1 state slot, 0 free of {self.states.num_slots} "
                                  f"({len(self._slots)} sequences hold one each)")
