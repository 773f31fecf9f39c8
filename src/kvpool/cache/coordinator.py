"""KVCache, the coordinator: the one cache object the engine talks to. It maps each sequence
to its memory in every layer group of a model, each group managed by one group type: a plain
model has one page group (full attention, or a sliding window when every layer is windowed),
Gemma 3 a full and a window group, Bamba a full and a Mamba state group. A prefix hit is the
longest prefix every group can serve. Every mutating call plans with every group and checks
each plan first, then acts: a call that raises has changed nothing."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

import torch

from kvpool.cache.group import CacheStats, GroupManager, Plan
from kvpool.cache.pages import FullAttention, SlidingWindow
from kvpool.cache.prefix_cache import salt_key
from kvpool.cache.state import MambaState, StateSpec
from kvpool.cache.tiers import Tier
from kvpool.cache.tokens import TOKEN_BYTES, pack_tokens
from kvpool.errors import (
    DuplicateSequence,
    KVPoolError,
    OutOfPages,
    SequenceTooLong,
    UnknownSequence,
    check_int,
)
from kvpool.memory.fp8 import is_fp8
from kvpool.memory.grouped_pool import GroupedPool
from kvpool.memory.layout import KVLayout, LayerGroup
from kvpool.memory.pool import layer_scales
from kvpool.memory.state_pool import MambaPool, StateBatch
from kvpool.numeric import check_int64


@dataclass(slots=True)
class _Sequence:
    num_tokens: int
    # every token's id, packed: the prompt's bytes, a bytearray once they change; None:
    # unknown, or not cached
    token_ids: bytes | bytearray | None
    salt: bytes  # the prefix cache's root of its cache salt (salt_key)


def group_layout(layout: KVLayout, group: LayerGroup) -> KVLayout:
    """The layout of one group's pool: the group's layers, windowed alike (or full)."""
    windows = (group.window,) * len(group.layers) if group.window is not None else ()
    return KVLayout(len(group.layers), layout.num_kv_heads, layout.head_dim, layout.dtype,
                    layout.page_size, layout.kind, windows)


class KVCache:
    """The page groups of `layout` and, with `states`, a Mamba state group, all on `device`;
    host bookkeeping (the page tables and slot mappings it builds are host tensors). Not
    thread-safe: call it from one thread (as the engine's loop does) or under a lock.

    `num_pages` an int: one pool holds every layer; its group keeps every page (full
    attention), or, when every layer of `layout` is windowed and `free_out_of_window`, gives
    back the pages that leave the largest window. `num_pages` a sequence: one pool per layer
    group of `layout` (`layout.groups`, full attention first), `num_pages[g]` pages each, its
    window groups giving pages back (so `free_out_of_window` must stay True). A caller that
    grows each sequence by at most `max_tokens_per_step` tokens a call past its prefix hit (as
    the engine's chunked prefill does) says so, and a window group then fits sequences longer
    than its pool (`check_fits`).
    `states` (a StateSpec) adds a hybrid model's state slots and checkpoints beside the first
    page group.

    With a `tier` (one page group only), evicted prefix pages move there, and a later prompt
    continuing their prefix loads them back instead of recomputing. The tier is bound to the
    cache's namespace: its layout, `model_fingerprint` (a string naming the model and its
    weights) and the `kv_scales` of fp8 pages (as KVPool takes them; with a tier they must be
    given, since a stored page reads back right only under the scales it was written with)."""

    def __init__(self, layout: KVLayout, num_pages: int | Sequence[int], *,
                 device: str | torch.device, policy: str = "lifo", prefix_caching: bool = False,
                 reserve: int = 0, max_tokens_per_seq: int | None = None,
                 max_tokens_per_step: int | None = None, scrub_on_free: bool = False,
                 tier: Tier | None = None,
                 model_fingerprint: str = "", kv_scales=None, free_out_of_window: bool = True,
                 states: StateSpec | None = None):
        for name, value in (("max_tokens_per_seq", max_tokens_per_seq),
                            ("max_tokens_per_step", max_tokens_per_step)):
            if value is not None:
                check_int64(name, value, 1)
        for name, value, kind in (("tier", tier, Tier), ("states", states, StateSpec)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__} or None, got "
                                f"{type(value).__name__}")
        if tier is not None and not prefix_caching:
            raise ValueError("a tier holds evicted prefix pages: it needs prefix_caching=True")
        if not isinstance(model_fingerprint, str):
            raise TypeError(f"model_fingerprint must be a str, "
                            f"got {type(model_fingerprint).__name__}")
        if tier is not None and is_fp8(layout.dtype) and kv_scales is None:
            raise ValueError("fp8 pages in a tier need kv_scales given: scales taken from a "
                             "cache's first prefill would differ between caches sharing it")
        if tier is not None and (states is not None or not isinstance(num_pages, int)):
            raise ValueError("a tier serves a cache of one page group; this one has "
                             "several layer groups")
        options = dict(device=device, policy=policy, prefix_caching=prefix_caching,
                       reserve=reserve, scrub_on_free=scrub_on_free, tier=tier,
                       model_fingerprint=model_fingerprint, kv_scales=kv_scales)
        self.layout = layout
        self.page_size = layout.page_size
        self.page_groups = _page_groups(layout, num_pages, free_out_of_window,
                                        max_tokens_per_step, options)
        self.state = None if states is None else MambaState(states, self.page_groups[0],
                                                             device=device)
        self.groups: tuple[GroupManager, ...] = self.page_groups if self.state is None \
            else (*self.page_groups, self.state)
        self.kv_pools = GroupedPool(layout, tuple(g.pool for g in self.page_groups))
        first = self.page_groups[0]
        self.pool, self.allocator, self.prefix_cache = first.pool, first.allocator, \
            first.prefix_cache
        self.tier, self.namespace = tier, first.namespace
        self.max_tokens_per_seq = max_tokens_per_seq
        self._seqs: dict[Hashable, _Sequence] = {}
        self._query_tokens = self._hit_tokens = 0

    # ---- sequences ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, entering: int | None = None,
                     cache_salt: str | None = None) -> int:
        """Create a sequence holding `token_ids` (or `num_tokens` unknown tokens) in every
        group. Returns how many leading tokens the prefix cache served (whole pages, never
        the last token, as far as every group can serve); their KV is already in the pools
        (loaded from the tier for pages past the device's match), and a state group's slot
        holds the state after them. With `entering` (see `tokens_to_admit`), it holds only
        the first `entering` tokens, the rest to be appended chunk by chunk; the whole
        prompt counts as looked up in the prefix cache's statistics. A `cache_salt` shares
        pages only with sequences of the same salt (in the pool and in the tier)."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists")
        n, ids = _tokens(token_ids, num_tokens)
        if self.max_tokens_per_seq is not None:
            self._check_length(seq_id, n)
        looked_up = n
        if entering is not None:
            n = check_int("entering", entering, 0, n)
            ids = None if ids is None else ids[:n * TOKEN_BYTES]
        salt = b"" if cache_salt is None else salt_key(cache_salt)
        plans = self._plan_add(ids, n, salt)
        for group, plan in plans:
            if not group.room(plan):
                raise self._shortage(group, plan)
        hit = n
        try:
            for group, plan in plans:
                served = group.add(seq_id, n, salt, plan)
                if served < hit:
                    hit = served
        except BaseException:  # a fault of the device: the groups that took it give it back
            for taken, _ in plans:
                if taken is group:  # the one that raised, having given back what it took
                    break
                taken.free(seq_id)
            raise
        if ids is None or self.prefix_cache is None:  # nothing shares by content
            self._seqs[seq_id] = _Sequence(n, None, salt)
        else:
            self._query_tokens += looked_up
            self._hit_tokens += hit
            self._seqs[seq_id] = _Sequence(n, ids, salt)
        return hit

    def append(self, seq_id: Hashable, num_tokens: int | None = None, *,
               token_ids: Sequence[int] | None = None) -> list[int]:
        """Grow a sequence by `num_tokens` (default 1, or `len(token_ids)`); returns the new
        tokens' slots in the first page group. A shared partial last page is copied first
        (copy-on-write); window groups give back the pages that left the window."""
        seq = self._get(seq_id)
        n, packed = _tokens(token_ids, num_tokens, default=1)
        self._check_length(seq_id, seq.num_tokens + n)
        return self._grow([seq_id], [seq], [n], [packed]) if n else []

    def append_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | None = None,
                     *, token_ids: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Grow many sequences in one call: sequence `seq_ids[i]` by `num_tokens[i]` tokens
        (default 1 each: a decode step) or by `token_ids[i]`. Returns the new tokens' slots in
        the first page group, sequence after sequence. One allocation per group serves the
        batch, so the call grows every sequence or, raising, changes nothing."""
        seq_ids = list(seq_ids)
        seqs = [self._get(sid) for sid in seq_ids]
        if len(set(seq_ids)) < len(seqs):
            raise ValueError("append_batch lists a sequence more than once")
        counts, packed = _batch_counts(len(seqs), num_tokens, token_ids)
        if self.max_tokens_per_seq is not None:
            for sid, seq, n in zip(seq_ids, seqs, counts, strict=True):
                self._check_length(sid, seq.num_tokens + n)
        return self._grow(seq_ids, seqs, counts, packed)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing every page of `parent_id` (reference counts +1), with a
        copy of its state in a slot of its own."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(f"sequence {child_id!r} already exists")
        for group in self.groups:
            plan = group.plan_fork(parent_id)
            if not group.room(plan):
                raise self._shortage(group, plan)
        for group in self.groups:
            group.fork(parent_id, child_id)
        token_ids = None if parent.token_ids is None else bytearray(parent.token_ids)
        self._seqs[child_id] = _Sequence(parent.num_tokens, token_ids, parent.salt)

    def commit(self, seq_id: Hashable) -> None:
        """Declare the KV of every token the sequence holds written; with prefix caching its
        full pages become matchable by later sequences, and so do the state checkpoints
        computed for it."""
        seq = self._get(seq_id)
        for group in self.groups:
            group.commit(seq_id, seq.token_ids, seq.salt)

    def set_last_token(self, seq_id: Hashable, token_id: int) -> None:
        """Record the id of the sequence's last token, appended before it was known (overlap
        scheduling appends a step's sampled token while the device still samples it). Call
        it before the commit that covers that token."""
        seq = self._get(seq_id)
        packed = pack_tokens([token_id])
        if seq.num_tokens == 0:
            raise ValueError(f"sequence {seq_id!r} holds no token")
        if type(seq.token_ids) is bytes:
            seq.token_ids = bytearray(seq.token_ids)
        if seq.token_ids is not None:
            seq.token_ids[-TOKEN_BYTES:] = packed

    def free_sequence(self, seq_id: Hashable) -> None:
        """Give back the sequence's references and state slot. Its cached pages stay in the
        prefix cache (evictable once nobody else holds them)."""
        if self._seqs.pop(seq_id, None) is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        for group in self.groups:
            group.free(seq_id)

    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` cached pages of each page group (least recently used
        first), and the checkpoints that needed them; returns the pages evicted."""
        return sum(len(group.allocator.evict(num_pages)) for group in self.page_groups)

    # ---- room --------------------------------------------------------------------------

    def prefix_hit(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Tokens of `token_ids` the prefix cache would serve to `add_sequence` (pages a tier
        would load are not counted). Changes nothing."""
        n, ids = _prompt(token_ids)
        return self._hit(ids, n, salt_key(cache_salt))

    def tokens_to_admit(self, token_ids: Sequence[int], budget: int, *,
                        cache_salt: str | None = None) -> int:
        """How many leading tokens of a prompt a new sequence enters with when `budget` tokens
        can be computed now: all of them, unless a group gives pages back as the sequence
        grows; then its prefix hit and `budget` more, the rest taken chunk by chunk."""
        n, ids = _prompt(token_ids)
        check_int("budget", budget, 0)
        salt = salt_key(cache_salt)
        if min(group.admitted(n, 0) for group in self.groups) == n:
            return n
        hit = self._hit(ids, n, salt)
        return hit + min(n - hit, budget)

    def pages_to_add(self, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Available pages (of every page group) `add_sequence` would consume: new pages (tier
        hits included: they are loaded into new pages) plus the cached pages its prefix hit
        would take off the cached queue. Changes nothing."""
        n, ids = _tokens(token_ids, num_tokens)
        return sum(plan.need + group.num_unheld(plan.shared)
                   for group, plan in self._plan_add(ids, n, salt_key(cache_salt))
                   if group in self.page_groups)

    def pages_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Pages (of every page group) `append(seq_id, num_tokens)` would take, copy-on-write
        and the copies of a first drop out of the window included (not counting the pages it
        gives back)."""
        self._get(seq_id)
        n = check_int("num_tokens", num_tokens, 0)
        return sum(group.plan_append(seq_id, n, {}).need for group in self.page_groups)

    def can_add(self, token_ids: Sequence[int], *, spare_pages: int = 0,
                entering: int | None = None, cache_salt: str | None = None) -> bool:
        """Whether `add_sequence(seq_id, token_ids)` would succeed and leave `spare_pages`
        pages available in every page group. With `entering`, the sequence enters with its
        first `entering` tokens and takes the rest chunk by chunk: each group asks room for
        the tokens it holds at once (`GroupManager.admitted`). Changes nothing."""
        n, ids = _prompt(token_ids)
        check_int("spare_pages", spare_pages, 0)
        entering = n if entering is None else check_int("entering", entering, 0, n)
        salt, limit = salt_key(cache_salt), n
        if not self._within_limit(n):
            return False
        for group in self.groups:
            m = group.admitted(n, entering)
            plan = group.plan_add(ids[:m * TOKEN_BYTES], m, salt, limit)
            if not group.room(plan, spare_pages):
                return False
            limit = min(limit, plan.hit)
        return True

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether `append(seq_id, num_tokens)` would succeed. Changes nothing."""
        seq = self._get(seq_id)
        n = check_int("num_tokens", num_tokens, 0)
        return self._within_limit(seq.num_tokens + n) and all(
            group.room(group.plan_append(seq_id, n, {})) for group in self.groups)

    def check_fits(self, num_tokens: int) -> None:
        """Raise OutOfPages unless one sequence of `num_tokens` tokens fits alone in every
        page group's pool, less its `reserve` (a window group's: with the copies of its first
        drop; with `max_tokens_per_step`, whatever its length once its window and two steps
        fit)."""
        for group in self.page_groups:
            need, alloc = group.pages_alone(num_tokens), group.allocator
            if need > alloc.num_pages - alloc.reserve:
                reserved = f" ({alloc.reserve} reserved)" if alloc.reserve else ""
                raise self._named(group, OutOfPages(
                    f"{num_tokens} tokens need {need} pages of {self.page_size} tokens; "
                    f"the pool has {alloc.num_pages}{reserved}"))

    # ---- queries -----------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds."""
        return self._get(seq_id).num_tokens

    def pages(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """The sequence's page table in page group `group` (a copy; HOLE for pages given
        back out of the window)."""
        return self._page_group(group).pages(seq_id)

    def slots(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """The slot of each of the sequence's tokens in page group `group`; HOLE for tokens
        whose page went back out of the window."""
        return self._page_group(group).slots(seq_id)

    def sequences(self) -> list[Hashable]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def owners(self, page: int, group: int = 0) -> list[Hashable]:
        """Live sequences whose page table in `group` holds `page` (debugging, metrics)."""
        return self._page_group(group).owners(page)

    def page_tables(self, seq_ids: Sequence[Hashable], *, group: int = 0) -> torch.Tensor:
        """Page tables `[batch, max_pages]` int32 of page group `group`, on the host
        (bookkeeping: whoever hands them to a kernel moves them to the pool's device), rows
        padded with page id 0, which also stands for the pages given back out of the window."""
        return self._page_group(group).page_tables(seq_ids)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int], *, group: int = 0) -> torch.Tensor:
        """Slots int64 on the host of tokens [starts[i], ends[i]) of each sequence in page
        group `group`, concatenated; the tokens of the group's prefix match (computed again
        where another group served less) go to its pool's reserved padding slot."""
        return self._page_group(group).slot_mapping(seq_ids, starts, ends)

    @property
    def states(self) -> MambaPool | None:
        """The state group's MambaPool (None without a state group)."""
        return None if self.state is None else self.state.states

    def state_slot(self, seq_id: Hashable) -> int:
        """The sequence's state slot."""
        self._get(seq_id)
        return self._state_group().slot(seq_id)

    def state_batch(self, seq_ids: Sequence[Hashable], starts: Sequence[int] | None = None,
                    ends: Sequence[int] | None = None) -> StateBatch:
        """The state slots of a step's sequences, in order, for the model. With the step's
        token ranges [starts[i], ends[i]) and prefix caching, also the checkpoints to save
        (a reserved slot each, added to the prefix cache at the sequence's next commit).
        ValueError, changing nothing, for a sequence listed twice or ranges that are not one
        per sequence within the tokens it holds (TypeError for a bound that is not an int)."""
        state = self._state_group()
        seqs = [self._get(seq_id) for seq_id in seq_ids]
        if len(set(seq_ids)) < len(seqs):
            raise ValueError("state_batch lists a sequence more than once")
        _check_ranges(seq_ids, [seq.num_tokens for seq in seqs], starts, ends)
        return state.state_batch(seq_ids, [seq.token_ids for seq in seqs], starts, ends)

    @property
    def num_pages(self) -> int:
        """Pages in the page groups' pools."""
        return sum(group.allocator.num_pages for group in self.page_groups)

    @property
    def num_free_pages(self) -> int:
        """Pages on the free lists (O(1), unlike `stats()`)."""
        return sum(group.allocator.num_free for group in self.page_groups)

    @property
    def num_cached_pages(self) -> int:
        """Pages no sequence holds whose content a prefix cache keeps (O(1))."""
        return sum(group.allocator.num_cached for group in self.page_groups)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get: free ones plus cached ones no sequence holds."""
        return self.num_free_pages + self.num_cached_pages

    @property
    def device(self) -> torch.device:
        """Where the pools live."""
        return self.pool.device

    def group_stats(self) -> tuple[CacheStats, ...]:
        """Each page group's counters, in group order."""
        return tuple(group.stats(len(self._seqs), self._query_tokens)
                     for group in self.page_groups)

    def stats(self) -> CacheStats:
        """The page groups' counters summed (pages of every pool; tokens and copies counted
        in each group), with the prefix hits as served: what every group could serve."""
        each = self.group_stats()
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in fields(CacheStats)}
        summed.update(num_sequences=len(self._seqs), page_size=self.page_size,
                      prefix_query_tokens=self._query_tokens, prefix_hit_tokens=self._hit_tokens)
        return CacheStats(**summed)

    def check(self) -> None:
        """Every group's invariants over the same live sequences, each with its token count;
        every known sequence's packed ids as long as its tokens."""
        num_tokens = {sid: seq.num_tokens for sid, seq in self._seqs.items()}
        for group in self.groups:
            group.check(num_tokens)
        for sid, seq in self._seqs.items():
            assert seq.token_ids is None or len(seq.token_ids) == seq.num_tokens * TOKEN_BYTES, (
                f"sequence {sid!r}: {len(seq.token_ids)} bytes of ids, {seq.num_tokens} tokens")

    # ---- internals ---------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return seq

    def _page_group(self, group: int) -> FullAttention:
        """Page group `group`; TypeError or ValueError naming the groups there are."""
        return self.page_groups[check_int("group", group, 0, len(self.page_groups) - 1)]

    def _state_group(self) -> MambaState:
        """The state group; ValueError for a cache without one."""
        if self.state is None:
            raise ValueError("this cache has no state group: build it with states=StateSpec(...)")
        return self.state

    def _hit(self, ids: bytes, n: int, salt: bytes) -> int:
        """Tokens of a prompt of `n` tokens, packed `ids`, every group can serve."""
        return min([plan.hit for _, plan in self._plan_add(ids, n, salt)])

    def _plan_add(self, ids: bytes | None, n: int, salt: bytes
                  ) -> list[tuple[GroupManager, Plan]]:
        """Every group with its plan for a new sequence, each served at most what the groups
        before it serve."""
        plans, limit = [], n
        for group in self.groups:
            plan = group.plan_add(ids, n, salt, limit)
            if plan.hit < limit:
                limit = plan.hit
            plans.append((group, plan))
        return plans

    def _grow(self, seq_ids: list[Hashable], seqs: list[_Sequence], counts: list[int],
              packed: list[bytes | None]) -> list[int]:
        """Grow `seqs` by `counts` tokens (ids `packed`, None: unknown) in every group, each
        group's batch planned and checked before any group acts; returns the first page
        group's new slots."""
        plans = []
        for group in self.groups:
            copied: dict[int, int] = {}
            batch = [group.plan_append(sid, n, copied) for sid, n in zip(seq_ids, counts,
                                                                         strict=True)]
            total = Plan(sum([plan.need for plan in batch]))
            if not group.room(total):
                raise self._shortage(group, total)
            plans.append((group, batch, total.need))
        slots: list[int] = []
        for group, batch, need in plans:
            new = group.allocate(need)
            grown: list[int] = []
            taken = 0
            for sid, n, ids, plan in zip(seq_ids, counts, packed, batch, strict=True):
                if n:
                    grown += group.append(sid, n, ids is not None, plan,
                                          new[taken:taken + plan.need])
                    taken += plan.need
            if group is self.page_groups[0]:
                slots = grown
        for seq, n, ids in zip(seqs, counts, packed, strict=True):
            seq.num_tokens += n
            if seq.token_ids is not None and n:
                if ids is None:
                    seq.token_ids = None  # content unknown from here on
                elif type(seq.token_ids) is bytes:  # the prompt's: grown in a copy, once
                    seq.token_ids = bytearray(seq.token_ids) + ids
                else:
                    seq.token_ids += ids
        return slots

    def _shortage(self, group: GroupManager, plan: Plan) -> KVPoolError:
        return self._named(group, group.shortage(plan))

    def _named(self, group: GroupManager, error: KVPoolError) -> KVPoolError:
        """`error`, its message naming the group's pool when there are several groups."""
        if len(self.groups) == 1:
            return error
        return type(error)(f"{group.name} pool: {error}")

    def _within_limit(self, n: int) -> bool:
        return self.max_tokens_per_seq is None or n <= self.max_tokens_per_seq

    def _check_length(self, seq_id: Hashable, n: int) -> None:
        if not self._within_limit(n):
            raise SequenceTooLong(f"sequence {seq_id!r} would hold {n} tokens, "
                                  f"over the limit of {self.max_tokens_per_seq}")


def _page_groups(layout: KVLayout, num_pages: int | Sequence[int], free_out_of_window: bool,
                 max_tokens_per_step: int | None, options: dict) -> tuple[FullAttention, ...]:
    """The page groups of a KVCache (see its docstring)."""
    if isinstance(num_pages, int):
        windows = layout.layer_windows
        if free_out_of_window and windows and None not in windows:
            return (SlidingWindow(layout, num_pages, window=max(windows),
                                  max_tokens_per_step=max_tokens_per_step, **options),)
        return (FullAttention(layout, num_pages, **options),)
    if isinstance(num_pages, (str, bytes)) or not isinstance(num_pages, Sequence):
        raise TypeError(f"num_pages must be an int or a sequence of ints, "
                        f"got {type(num_pages).__name__} {num_pages!r}")
    groups = layout.groups
    if len(num_pages) != len(groups):
        raise ValueError(f"num_pages gives {len(num_pages)} pool sizes for "
                         f"{len(groups)} layer groups")
    if not free_out_of_window:
        raise ValueError(f"free_out_of_window=False keeps every page in one pool: give "
                         f"num_pages as one int, not the {len(num_pages)} sizes {num_pages!r} "
                         f"of pools that give pages back")
    per_layer = layer_scales(layout, options["kv_scales"])  # every layer's, checked
    made = []
    for group, n in zip(groups, num_pages, strict=True):
        scales = None if per_layer is None else [  # the group's layers', in its pool's form
            row if len(row) > 1 else row[0] for row in (per_layer[i] for i in group.layers)]
        own = {**options, "kv_scales": scales}
        made.append(FullAttention(group_layout(layout, group), n, **own) if group.window is None
                    else SlidingWindow(group_layout(layout, group), n, window=group.window,
                                       max_tokens_per_step=max_tokens_per_step, **own))
    return tuple(made)


def _tokens(token_ids: Sequence[int] | None, num_tokens: int | None,
            default: int = 0) -> tuple[int, bytes | None]:
    """The token count a call asks for, from `token_ids` or `num_tokens` (which must agree),
    and the ids packed (None when not given). `token_ids` is a sequence of ints or a 1-D
    integer array or tensor; TypeError or ValueError naming the first bad one."""
    if token_ids is None:
        if num_tokens is None:
            return default, None
        return check_int("num_tokens", num_tokens, 0), None
    if type(token_ids) is not list:  # a list, the common case, needs no further look
        if isinstance(token_ids, (str, bytes, bytearray)) or not (
                isinstance(token_ids, Sequence) or hasattr(token_ids, "tolist")):
            raise TypeError(f"token_ids must be a sequence of ints, "
                            f"got {type(token_ids).__name__}")
        if hasattr(token_ids, "tolist"):  # numpy, torch
            token_ids = token_ids.tolist()
            if not isinstance(token_ids, list):  # a 0-d array: one number, no sequence
                raise TypeError(f"token_ids must be a sequence of ints, got the number "
                                f"{token_ids!r}")
    if num_tokens is not None and check_int("num_tokens", num_tokens, 0) != len(token_ids):
        raise ValueError(f"num_tokens={num_tokens} disagrees with {len(token_ids)} token_ids")
    return len(token_ids), pack_tokens(token_ids)


def _prompt(token_ids: Sequence[int]) -> tuple[int, bytes]:
    """`_tokens` of a prompt, whose ids must be given."""
    if token_ids is None:
        raise TypeError("token_ids must be a sequence of ints, got None")
    return _tokens(token_ids, None)


def _batch_counts(batch: int, num_tokens: Sequence[int] | None,
                  token_ids: Sequence[Sequence[int]] | None
                  ) -> tuple[list[int], list[bytes | None]]:
    """Each sequence's token count (default 1) and packed ids (None where unknown) for a batch
    of `batch` sequences; ValueError or TypeError naming the first bad entry."""
    for name, given in (("num_tokens", num_tokens), ("token_ids", token_ids)):
        if given is not None and len(given) != batch:
            raise ValueError(f"{name} has {len(given)} entries for {batch} sequences")
    if token_ids is None:
        counts = [1] * batch if num_tokens is None else [
            check_int(f"num_tokens[{i}]", n, 0) for i, n in enumerate(num_tokens)]
        return counts, [None] * batch
    counted = [_tokens(ids, None if num_tokens is None else num_tokens[i])
               for i, ids in enumerate(token_ids)]
    return [n for n, _ in counted], [packed for _, packed in counted]


def _check_ranges(seq_ids: Sequence[Hashable], num_tokens: list[int],
                  starts: Sequence[int] | None, ends: Sequence[int] | None) -> None:
    """Raise ValueError unless `starts` and `ends` are both None, or give each sequence a
    range 0 <= start <= end <= the tokens it holds (TypeError for a bound not an int)."""
    if starts is None and ends is None:
        return
    if starts is None or ends is None or not len(starts) == len(ends) == len(seq_ids):
        shown = [None if r is None else len(r) for r in (starts, ends)]
        raise ValueError(f"starts and ends must each give one token index per sequence "
                         f"({len(seq_ids)}), got lengths {shown[0]} and {shown[1]}")
    for seq_id, n, start, end in zip(seq_ids, num_tokens, starts, ends, strict=True):
        if type(start) is not int or type(end) is not int:  # True is no token index
            raise TypeError(f"sequence {seq_id!r}: the start and end of its range must be "
                            f"ints, got {type(start).__name__} {start!r} and "
                            f"{type(end).__name__} {end!r}")
        if not 0 <= start <= end <= n:
            raise ValueError(f"sequence {seq_id!r} holds {n} tokens: its range must be "
                             f"0 <= start <= end <= {n}, got [{start}, {end})")
