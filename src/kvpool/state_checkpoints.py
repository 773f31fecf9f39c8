"""StateCheckpoints: the prefix cache's index of state checkpoints for a hybrid model.

A checkpoint is a state slot holding the Mamba state after the last token of a cached token
prefix (packed ids as the key). Checkpoints sit only at multiples of `interval` tokens, so a
prompt's deepest one is found by looking up those lengths from the longest down. They are
evicted least recently used first, apart from the KV pages, which have their own LRU order in
the KV prefix cache: a prefix whose KV pages stay but whose checkpoint went is a tombstone, and
a match backs off past it to a shallower checkpoint."""

from __future__ import annotations

from collections import OrderedDict

from kvpool.errors import check_int
from kvpool.state_pool import MambaPool
from kvpool.tokens import TOKEN_BYTES


class StateCheckpoints:
    """Checkpoints keyed by packed token prefix, each holding one reference to its slot in
    `states`; at most `capacity` slots at once, counting the slots `reserve` hands out for
    checkpoints not yet added."""

    def __init__(self, states: MambaPool, capacity: int, interval: int):
        check_int("capacity", capacity, 0)
        check_int("interval", interval, 1)
        self.states = states
        self.capacity = capacity
        self.interval = interval
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._reserved: set[int] = set()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def lengths(self) -> list[int]:
        """Token lengths of the checkpointed prefixes, least recently used first."""
        return [len(key) // TOKEN_BYTES for key in self._slots]

    def deepest(self, token_ids: bytes, max_tokens: int) -> tuple[int, int | None]:
        """(length, slot) of the longest checkpointed prefix of `token_ids` (packed) no longer
        than `max_tokens`; (0, None) if none. Changes nothing (see `touch`)."""
        for length in range(max_tokens // self.interval * self.interval, 0, -self.interval):
            slot = self._slots.get(token_ids[:length * TOKEN_BYTES])
            if slot is not None:
                return length, slot
        return 0, None

    def touch(self, prefix: bytes) -> None:
        """Mark the checkpoint of `prefix` most recently used (a hit)."""
        self._slots.move_to_end(prefix)

    def has(self, prefix: bytes) -> bool:
        """Is there a checkpoint after exactly this packed prefix?"""
        return prefix in self._slots

    def reserve(self) -> int | None:
        """A slot for a checkpoint about to be computed, evicting the least recently used
        checkpoint when the capacity is reached; None when every slot of the capacity is
        reserved already (the checkpoint is skipped). The pool holds `capacity` slots
        beyond those of the sequences, so a slot within the capacity is always free."""
        if len(self._reserved) >= self.capacity:
            return None
        if len(self._slots) + len(self._reserved) >= self.capacity:
            self.evict(1)
        slot = self.states.allocate()
        self._reserved.add(slot)
        return slot

    def add(self, prefix: bytes, slot: int) -> None:
        """Index a reserved slot, now holding the state after `prefix`, as its checkpoint;
        a prefix checkpointed already keeps its slot and this one is released."""
        self._reserved.remove(slot)
        if prefix in self._slots:
            self.states.free(slot)
            return
        self._slots[prefix] = slot

    def release(self, slot: int) -> None:
        """Give back a reserved slot that will not become a checkpoint."""
        self._reserved.remove(slot)
        self.states.free(slot)

    def evict(self, n: int) -> int:
        """Drop up to `n` least recently used checkpoints; returns how many went."""
        gone = 0
        while gone < n and self._slots:
            _, slot = self._slots.popitem(last=False)
            self.states.free(slot)
            gone += 1
        self.num_evicted += gone
        return gone

    def drop(self, prefixes: list[bytes]) -> None:
        """Drop the checkpoints of these prefixes (their KV pages are gone)."""
        for prefix in prefixes:
            self.states.free(self._slots.pop(prefix))
        self.num_evicted += len(prefixes)

    def prefixes(self) -> list[bytes]:
        """The checkpointed prefixes, least recently used first."""
        return list(self._slots)

    def held_slots(self) -> list[int]:
        """Slots held by checkpoints and reservations."""
        return [*self._slots.values(), *self._reserved]

    def check(self) -> None:
        """Each checkpoint and reservation holds a distinct slot with one reference, at
        most `capacity` of them, at interval multiples; AssertionError naming what broke."""
        held = self.held_slots()
        assert len(set(held)) == len(held), f"a checkpoint slot is held twice: {held}"
        assert len(held) <= self.capacity, (
            f"{len(held)} checkpoint slots held, capacity {self.capacity}")
        for prefix, slot in self._slots.items():
            length = len(prefix) // TOKEN_BYTES
            assert length and length % self.interval == 0, (
                f"checkpoint after {length} tokens is not at a multiple of {self.interval}")
            assert self.states.refcount(slot) == 1, (
                f"checkpoint slot {slot} has reference count {self.states.refcount(slot)}")
