"""The Mamba state group: one state slot per live sequence in a MambaPool and, with prefix
caching, checkpoints: slots holding the state after a prefix whose KV pages the full-attention
group's prefix cache holds. A prompt is checkpointed at the last `checkpoint_interval`
multiple each prefill chunk reaches, the output every `track_interval` tokens. Checkpoints are
evicted least recently used first, apart from the KV pages (which leaves tombstones), and each
goes with the KV page its prefix ends on (the prefix cache's eviction hook): a state is of no
use without the KV before it. A hit is the deepest checkpoint within what the page groups
serve, copied into the sequence's own slot. Salted sequences neither use nor make checkpoints,
which are keyed by content alone."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.cache.group import GroupManager, Plan
from kvpool.cache.pages import FullAttention
from kvpool.cache.tokens import TOKEN_BYTES
from kvpool.errors import OutOfStateSlots
from kvpool.memory.state_pool import CheckpointRequest, MambaLayout, MambaPool, StateBatch
from kvpool.numeric import check_int64


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A hybrid model's state group: `num_slots` state slots of `layout`, one per live
    sequence, and `num_checkpoint_slots` for checkpoints, taken every `checkpoint_interval`
    tokens of a prompt (a page size multiple) and `track_interval` tokens after it (a
    checkpoint_interval multiple)."""

    layout: MambaLayout
    num_slots: int
    num_checkpoint_slots: int = 0
    checkpoint_interval: int = 64
    track_interval: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.layout, MambaLayout):
            raise TypeError(f"layout must be a MambaLayout, got {type(self.layout).__name__}")
        check_int64("num_state_slots", self.num_slots, 1)
        check_int64("num_checkpoint_slots", self.num_checkpoint_slots, 0)
        check_int64("checkpoint_interval", self.checkpoint_interval, 1)
        check_int64("track_interval", self.track_interval, 1)


class StateCheckpoints:
    """Checkpoints keyed by packed token prefix, at multiples of `interval` tokens, each
    holding its slot in `states` and known by the KV page its prefix ends on; at most
    `capacity` slots, counting those `reserve` hands out for checkpoints not yet added."""

    def __init__(self, states: MambaPool, capacity: int, interval: int):
        self.states = states
        self.capacity = capacity
        self.interval = interval
        # prefix -> (slot, the KV page it ends on), least recently used first
        self._slots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._ending_on: dict[int, bytes] = {}  # KV page -> the prefix checkpointed there
        self._reserved: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def lengths(self) -> list[int]:
        """Token lengths of the checkpointed prefixes, least recently used first."""
        return [len(key) // TOKEN_BYTES for key in self._slots]

    def deepest(self, token_ids: bytes, max_tokens: int) -> tuple[int, int | None]:
        """(length, slot) of the longest checkpointed prefix of `token_ids` (packed) within
        `max_tokens`, looked up from the longest interval multiple down; (0, None) if none."""
        for length in range(max_tokens // self.interval * self.interval, 0, -self.interval):
            found = self._slots.get(token_ids[:length * TOKEN_BYTES])
            if found is not None:
                return length, found[0]
        return 0, None

    def __contains__(self, prefix: bytes) -> bool:
        return prefix in self._slots

    def touch(self, prefix: bytes) -> None:
        """Mark the checkpoint of `prefix` most recently used (a hit)."""
        self._slots.move_to_end(prefix)

    def reserve(self) -> int | None:
        """A slot for a checkpoint about to be computed, evicting the least recently used
        checkpoint at capacity; None when every slot is reserved already (skip it)."""
        if len(self._reserved) >= self.capacity:
            return None
        if len(self._slots) + len(self._reserved) >= self.capacity:
            self.evict(1)
        slot = self.states.allocate()
        self._reserved.add(slot)
        return slot

    def add(self, prefix: bytes, slot: int, end_page: int) -> None:
        """Index a reserved slot, now holding the state after `prefix`, whose last KV page is
        `end_page`, as its checkpoint (or release it, if the prefix has one)."""
        if prefix in self._slots:
            self.release(slot)
            return
        self._reserved.remove(slot)
        self._slots[prefix] = (slot, end_page)
        self._ending_on[end_page] = prefix

    def release(self, slot: int) -> None:
        """Give back a reserved slot that will not become a checkpoint."""
        self._reserved.remove(slot)
        self.states.free(slot)

    def evict(self, n: int) -> int:
        """Drop up to `n` least recently used checkpoints; returns how many went."""
        gone = min(n, len(self._slots))
        for _ in range(gone):
            slot, end_page = self._slots.popitem(last=False)[1]
            del self._ending_on[end_page]
            self.states.free(slot)
        return gone

    def drop_ending_on(self, pages: list[int]) -> None:
        """Drop the checkpoints whose prefix ends on one of these KV pages (evicted)."""
        for page in pages:
            prefix = self._ending_on.pop(page, None)
            if prefix is not None:
                self.states.free(self._slots.pop(prefix)[0])

    def held_slots(self) -> list[int]:
        """Slots held by checkpoints and reservations."""
        return [*(slot for slot, _ in self._slots.values()), *self._reserved]

    def check(self, end_page: Callable[[bytes], int | None]) -> None:
        """At most `capacity` slots, and checkpoints at interval multiples, each known by the
        page its prefix ends on in the KV prefix cache (`end_page`; None: not all cached);
        AssertionError naming what broke (MambaState checks the slots' holders)."""
        held = self.held_slots()
        assert len(held) <= self.capacity, (
            f"{len(held)} checkpoint slots held, capacity {self.capacity}")
        for prefix, (_, page) in self._slots.items():
            length = len(prefix) // TOKEN_BYTES
            assert length and length % self.interval == 0, (
                f"checkpoint after {length} tokens is not at a multiple of {self.interval}")
            assert end_page(prefix) == page and self._ending_on.get(page) == prefix, (
                f"checkpoint after {length} tokens: its KV ends on page {end_page(prefix)} "
                f"(None: not all cached), it is known by page {page}")
        assert len(self._ending_on) == len(self._slots), (
            f"{len(self._ending_on)} pages name checkpoints, {len(self._slots)} are held")


@dataclass(slots=True)
class _StateSlot:
    slot: int
    num_prompt_tokens: int  # tokens at creation: checkpoints every checkpoint_interval
    checkpointing: bool  # False: a salted sequence, or one of unknown tokens
    pending: list[tuple[int, int]] = field(default_factory=list)  # (tokens, reserved slot)


class MambaState(GroupManager):
    """The state slots of `spec` on `device` beside the full-attention page group `kv`, whose
    prefix cache decides which checkpoints are servable."""

    name = "mamba state"

    def __init__(self, spec: StateSpec, kv: FullAttention, *, device: str | torch.device):
        caching = kv.prefix_cache is not None
        check_int64("num_checkpoint_slots", spec.num_checkpoint_slots, int(caching))
        if spec.checkpoint_interval % kv.page_size or \
                spec.track_interval % spec.checkpoint_interval:
            raise ValueError(f"checkpoint_interval {spec.checkpoint_interval} must be a "
                             f"multiple of page_size {kv.page_size}, and track_interval "
                             f"{spec.track_interval} a multiple of it")
        self.kv = kv
        self.num_sequence_slots = spec.num_slots
        self.track_interval = spec.track_interval
        self.states = MambaPool(spec.layout, spec.num_slots + spec.num_checkpoint_slots,
                                device=device)
        # capacity 0 without prefix caching: never a checkpoint, never a hit
        self.checkpoints = StateCheckpoints(self.states, spec.num_checkpoint_slots * caching,
                                            spec.checkpoint_interval)
        self._seqs: dict[Hashable, _StateSlot] = {}
        if caching:  # a checkpoint goes with the KV page its prefix ends on
            kv.prefix_cache.evict_hooks.append(
                lambda pages, keys: self.checkpoints.drop_ending_on(pages))

    def plan_add(self, token_ids: bytes | None, n: int, salt: bytes, limit: int) -> Plan:
        """A slot, and the deepest checkpoint within `limit` tokens (the KV groups' hit)."""
        if token_ids is None or salt or not len(self.checkpoints):
            return Plan(1, data=(None, token_ids))
        hit, slot = self.checkpoints.deepest(token_ids, limit)
        return Plan(1, hit, data=(slot, token_ids))

    def add(self, seq_id: Hashable, n: int, salt: bytes, plan: Plan) -> int:
        checkpoint, ids = plan.data
        slot = self.states.allocate()
        if checkpoint is not None:
            try:
                self.states.copy(checkpoint, slot)
            except BaseException:  # a fault of the device: the slot goes back
                self.states.free(slot)
                raise
            self.checkpoints.touch(ids[:plan.hit * TOKEN_BYTES])
        self._seqs[seq_id] = _StateSlot(slot, n, ids is not None and not salt)
        return plan.hit

    def plan_append(self, seq_id: Hashable, n: int, copied: dict[int, int]) -> Plan:
        """Nothing: the state is updated in place."""
        return Plan(0)

    def append(self, seq_id: Hashable, n: int, known: bool, plan: Plan,
               new: list[int]) -> list[int]:
        if not known:
            self._seqs[seq_id].checkpointing = False
        return []

    def allocate(self, n: int) -> list[int]:
        return []

    def room(self, plan: Plan, spare_pages: int = 0) -> bool:
        """Whether a new sequence would find its slot (pages to spare do not apply)."""
        return len(self._seqs) + plan.need <= self.num_sequence_slots

    def shortage(self, plan: Plan) -> OutOfStateSlots:
        return OutOfStateSlots(f"need 1 state slot, 0 free of {self.num_sequence_slots} "
                               f"(each of {len(self._seqs)} sequences holds one)")

    def plan_fork(self, parent_id: Hashable) -> Plan:
        """A slot of the child's own, for a copy of the parent's state."""
        return Plan(1)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        parent = self._seqs[parent_id]
        child = self.states.allocate()
        self.states.copy(parent.slot, child)
        self._seqs[child_id] = _StateSlot(child, parent.num_prompt_tokens, parent.checkpointing)

    def commit(self, seq_id: Hashable, token_ids: bytes | bytearray | None, salt: bytes) -> None:
        """The checkpoints computed for the sequence whose pages are now in the prefix cache
        become matchable; the others are released."""
        seq = self._seqs[seq_id]
        for length, slot in seq.pending:
            prefix = bytes(token_ids[:length * TOKEN_BYTES]) if seq.checkpointing else None
            end_page = None if prefix is None else self._kv_end_page(prefix)
            if end_page is not None:
                self.checkpoints.add(prefix, slot, end_page)
            else:  # tokens unknown, or another copy of the prefix holds the pages
                self.checkpoints.release(slot)
        seq.pending = []

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id)
        for _, slot in seq.pending:
            self.checkpoints.release(slot)
        self.states.free(seq.slot)

    def slot(self, seq_id: Hashable) -> int:
        """The sequence's state slot."""
        return self._seqs[seq_id].slot

    def state_batch(self, seq_ids: Sequence[Hashable],
                    token_ids: Sequence[bytes | bytearray | None], starts: Sequence[int] | None,
                    ends: Sequence[int] | None) -> StateBatch:
        """The slots of a step's sequences and the checkpoints to save during the step."""
        slots = torch.tensor([self._seqs[s].slot for s in seq_ids], dtype=torch.int64,
                             device=self.states.device)
        requests = []
        if starts is not None and self.checkpoints.capacity:
            for index, (seq_id, ids, start, end) in enumerate(zip(seq_ids, token_ids, starts,
                                                                  ends, strict=True)):
                requests += self._checkpoint_requests(index, seq_id, ids, start, end)
        return StateBatch(self.states, slots, requests)

    def check(self, num_tokens: dict[Hashable, int]) -> None:
        """MambaPool's and the checkpoints' invariants, plus: the live sequences are the
        cache's, within num_sequence_slots; each slot has one holder (a sequence, checkpoint or
        reservation); the reservations are the live sequences' pending checkpoints; every
        checkpoint's prefix has its KV pages in the prefix cache."""
        self.states.check()
        self.checkpoints.check(self._kv_end_page)
        assert list(self._seqs) == list(num_tokens), (
            f"sequences with state slots {list(self._seqs)} differ from the cache's "
            f"{list(num_tokens)}")
        assert len(self._seqs) <= self.num_sequence_slots, (
            f"{len(self._seqs)} sequences for {self.num_sequence_slots} state slots")
        held = [seq.slot for seq in self._seqs.values()] + self.checkpoints.held_slots()
        assert len(set(held)) == len(held), f"a state slot is counted twice: {sorted(held)}"
        pending = sorted(slot for seq in self._seqs.values() for _, slot in seq.pending)
        reserved = sorted(self.checkpoints._reserved)
        assert pending == reserved, (
            f"pending checkpoint slots {pending} differ from the reserved ones {reserved}: "
            f"each reservation is one live sequence's pending checkpoint")
        for slot in range(self.states.num_slots):
            want = int(slot in held)
            assert self.states.refcount(slot) == want, (
                f"state slot {slot} has reference count {self.states.refcount(slot)}, "
                f"expected {want}")

    def _checkpoint_requests(self, index: int, seq_id: Hashable,
                             token_ids: bytes | bytearray | None, start: int,
                             end: int) -> list[CheckpointRequest]:
        """Checkpoints not saved yet to save while computing tokens [start, end), at the
        multiples the module names, while slots last."""
        seq = self._seqs[seq_id]
        if not seq.checkpointing or token_ids is None:
            return []
        interval, track = self.checkpoints.interval, self.track_interval
        last = min(end, seq.num_prompt_tokens) // interval * interval
        lengths = [last] if last > start else []
        lengths += range((max(start, seq.num_prompt_tokens) // track + 1) * track, end + 1, track)
        requests = []
        for length in lengths:
            if bytes(token_ids[:length * TOKEN_BYTES]) in self.checkpoints:
                continue
            slot = self.checkpoints.reserve()
            if slot is None:
                break
            seq.pending.append((length, slot))
            requests.append(CheckpointRequest(index, length, slot))
        return requests

    def _kv_end_page(self, prefix: bytes) -> int | None:
        """The KV page this packed prefix ends on in the prefix cache; None unless the cache
        holds every page of it."""
        num_pages = len(prefix) // TOKEN_BYTES // self.kv.page_size
        pages = self.kv.prefix_cache.match(prefix, num_pages).pages
        return pages[-1] if len(pages) == num_pages else None
