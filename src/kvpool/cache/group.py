"""The interface every group type offers the coordinator: one layer group's memory managed by
one rule, driven the same way whatever the rule (check a call's plan, then act on it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import KVPoolError


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache. Pages: free + cached + used == num_pages; the pool's reserved
    pages (the padding page) are counted apart, in none of them."""

    num_pages: int
    num_free_pages: int  # on the allocator's free list
    num_cached_pages: int  # no sequence holds them; the prefix cache keeps them: evictable
    num_used_pages: int  # held by at least one live sequence
    num_sequences: int
    num_tokens: int  # filled slots in used pages (a shared slot counts once)
    prefix_query_tokens: int  # cumulative tokens looked up in the prefix cache
    prefix_hit_tokens: int  # cumulative tokens served from it
    num_evicted_pages: int
    num_cow_copies: int
    page_size: int
    num_tier_loads: int = 0  # cumulative pages loaded back from the tier
    num_tier_stores: int = 0  # cumulative evicted pages the tier took (all but failed writes)
    num_reserved_pages: int = 0  # set aside by the pool beyond num_pages: never a sequence's

    @property
    def kv_utilization(self) -> float:
        """Filled fraction of the slots in used pages (internal fragmentation is 1 - this)."""
        slots = self.num_used_pages * self.page_size
        return self.num_tokens / slots if slots else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the prefix cache."""
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else 0.0


@dataclass(slots=True)
class Plan:
    """What a call would take from one group: `need` new units of its memory (pages, or
    state slots), the `shared` pages it would hold besides (a prefix hit), the tokens of a
    new sequence it would serve (`hit`), and the group's own notes."""

    need: int
    hit: int = 0
    shared: Sequence[int] = ()
    data: Any = None


class GroupManager(ABC):
    """One layer group's memory under one rule. `plan_*` calls change nothing; the
    coordinator checks every group's plan (`room`) before any group acts on its plan."""

    name: str  # for messages: "full attention", "window 512", "mamba state"

    @abstractmethod
    def plan_add(self, token_ids: bytes | None, n: int, salt: bytes, limit: int) -> Plan:
        """A new sequence of `n` tokens (ids packed, or unknown) under `salt`, served at most
        `limit` tokens (what the groups planned before this one serve)."""

    @abstractmethod
    def add(self, seq_id: Hashable, n: int, salt: bytes, plan: Plan) -> int:
        """Create the sequence as planned; returns the tokens this group served it."""

    @abstractmethod
    def plan_append(self, seq_id: Hashable, n: int, copied: dict[int, int]) -> Plan:
        """Growing the sequence by `n` tokens, after the batch's earlier sequences whose
        copies of shared pages `copied` counts (this one's are added)."""

    @abstractmethod
    def append(self, seq_id: Hashable, n: int, known: bool, plan: Plan,
               new: list[int]) -> list[int]:
        """Grow the sequence as planned, with `new` freshly allocated units (`allocate`);
        `known`: whether the new tokens' ids are known (else it caches the sequence no
        further). Returns the new tokens' slots (none in a state group)."""

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """`n` fresh units for `append` (after `room` said yes)."""

    @abstractmethod
    def room(self, plan: Plan, spare_pages: int = 0) -> bool:
        """Whether the group can carry out `plan` now, leaving `spare_pages` pages available."""

    @abstractmethod
    def shortage(self, plan: Plan) -> KVPoolError:
        """The error naming the numbers when `room(plan)` is False."""

    @abstractmethod
    def plan_fork(self, parent_id: Hashable) -> Plan:
        """Forking the sequence."""

    @abstractmethod
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing (or copying) what the parent holds."""

    @abstractmethod
    def commit(self, seq_id: Hashable, token_ids: bytes | bytearray | None, salt: bytes) -> None:
        """The sequence's tokens (ids `token_ids`, None: unknown) are computed."""

    @abstractmethod
    def free(self, seq_id: Hashable) -> None:
        """Give back what the sequence holds."""

    def admitted(self, n: int, entering: int) -> int:
        """Tokens of a new sequence of `n` entering with its first `entering` that this group
        must find room for at once: all of them, since it keeps every page."""
        return n

    @abstractmethod
    def check(self, num_tokens: dict[Hashable, int]) -> None:
        """The group's invariants, given every live sequence's token count."""
