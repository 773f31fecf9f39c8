"""GroupedCache: the cache of a model whose layers fall into several layer groups (full
attention and sliding windows: Gemma 3, Qwen with `layer_types`). Each group has a KVCache of
its own, with its own KVPool, allocator and prefix cache: the full group's pool holds whole
contexts, while a window group's KVCache holds only windowed layers, so it gives back the pages
that leave the window as a sequence grows. A sequence lives in every group at once, with the
same tokens; the cache offers KVCache's sequence API, so the scheduler drives it unchanged.

A prefix hit is as long as every group can serve: the shortest of the groups' matches (a window
group's tree keeps a sequence's pages only until its first drop, and each group evicts on its
own). A group whose match is longer shares its pages all the same, and the tokens between the
hit and the end of its match, computed again for the other groups' sake, write their K/V for
that group to the pool's reserved padding page (`slot_mapping` points there; no sequence holds
it), so shared pages are never rewritten."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

import torch

from kvpool.cache import CacheStats, KVCache, _batch_counts
from kvpool.errors import DuplicateSequence, OutOfPages, SequenceTooLong, UnknownSequence
from kvpool.grouped_pool import GroupedPool
from kvpool.layout import KVLayout, LayerGroup
from kvpool.tokens import pack_tokens


@dataclass(slots=True)
class _GroupedSequence:
    shared: tuple[int, ...]  # per group: tokens of its match, whose K/V is never rewritten


def group_layout(layout: KVLayout, group: LayerGroup) -> KVLayout:
    """The layout of one group's pool: the group's layers, windowed alike (or full)."""
    windows = (group.window,) * len(group.layers) if group.window is not None else ()
    return KVLayout(len(group.layers), layout.num_kv_heads, layout.head_dim, layout.dtype,
                    layout.page_size, layout.kind, windows)


def group_name(group: LayerGroup) -> str:
    """"full attention" or "window 512", for messages and tables."""
    return "full attention" if group.window is None else f"window {group.window:,}"


class GroupedCache:
    """One KVCache per layer group of `layout` (at least two groups), group g with
    `num_pages[g]` pages, every pool on `device` (keyword-only, no default). Every mutating
    call checks every group first and then acts in each: a call that raises has changed
    nothing.
    Queries that name pages, slots or page tables take the group (0, the first of
    `layout.groups`: full attention when the model has it)."""

    def __init__(self, layout: KVLayout, num_pages: Sequence[int], *,
                 device: str | torch.device, policy: str = "lifo", prefix_caching: bool = False,
                 max_tokens_per_seq: int | None = None, scrub_on_free: bool = False,
                 kv_scales=None):
        groups = layout.groups
        if len(groups) < 2:
            raise ValueError(f"a GroupedCache needs a layout of at least two layer groups, "
                             f"got {len(groups)}: use KVCache")
        if len(num_pages) != len(groups):
            raise ValueError(f"num_pages gives {len(num_pages)} pool sizes for "
                             f"{len(groups)} layer groups")
        self.layout = layout
        self.layer_groups = groups
        self.groups = tuple(
            KVCache(group_layout(layout, group), n, device=device, policy=policy,
                    prefix_caching=prefix_caching, max_tokens_per_seq=max_tokens_per_seq,
                    scrub_on_free=scrub_on_free, kv_scales=kv_scales)
            for group, n in zip(groups, num_pages, strict=True))
        self.pool = GroupedPool(layout, tuple(cache.pool for cache in self.groups))
        self.max_tokens_per_seq = max_tokens_per_seq
        self.prefix_caching = prefix_caching
        self._seqs: dict[Hashable, _GroupedSequence] = {}
        self._query_tokens = self._hit_tokens = 0

    # ---- sequences ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Create a sequence in every group. Returns the tokens the prefix cache served: the
        shortest of the groups' matches (whole pages, never the last token), under
        `cache_salt` (see KVCache.add_sequence)."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists")
        needs = [cache.pages_to_add(token_ids, num_tokens=num_tokens,  # validates the ids
                                    cache_salt=cache_salt)
                 for cache in self.groups]
        n = len(token_ids) if token_ids is not None else num_tokens or 0
        self._check_length(seq_id, n)
        for g, need in enumerate(needs):
            self._check_room(g, need)
        shared = tuple(cache.add_sequence(seq_id, token_ids, num_tokens=num_tokens,
                                          cache_salt=cache_salt)
                       for cache in self.groups)
        self._seqs[seq_id] = _GroupedSequence(shared)
        hit = min(shared)
        if token_ids is not None and self.prefix_caching:
            self._query_tokens += n
            self._hit_tokens += hit
        return hit

    def append(self, seq_id: Hashable, num_tokens: int | None = None, *,
               token_ids: Sequence[int] | None = None) -> tuple[list[int], ...]:
        """Grow the sequence in every group by `num_tokens` (default 1, or `len(token_ids)`);
        returns the new tokens' slots, one list per group. Window groups give back the pages
        that left the window."""
        self._get(seq_id)
        if token_ids is not None:
            pack_tokens(list(token_ids))  # TypeError or ValueError before anything changes
            n = len(token_ids)
        else:
            n = 1 if num_tokens is None else num_tokens
        self._check_length(seq_id, self.num_tokens(seq_id) + n)
        for g, cache in enumerate(self.groups):
            self._check_room(g, cache.pages_to_append(seq_id, n))
        return tuple(cache.append(seq_id, num_tokens, token_ids=token_ids)
                     for cache in self.groups)

    def append_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | None = None,
                     *, token_ids: Sequence[Sequence[int]] | None = None) -> tuple[list[int], ...]:
        """Grow many sequences in every group in one call (KVCache.append_batch in each);
        returns the new tokens' slots, sequence after sequence, one list per group. Grows
        every sequence in every group or, raising, changes nothing."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._get(seq_id)
        if len(set(seq_ids)) < len(seq_ids):
            raise ValueError("append_batch lists a sequence more than once")
        counts, _ = _batch_counts(len(seq_ids), num_tokens, token_ids)
        for seq_id, n in zip(seq_ids, counts, strict=True):
            self._check_length(seq_id, self.num_tokens(seq_id) + n)
        for g, cache in enumerate(self.groups):
            self._check_room(g, _batch_need(cache, seq_ids, counts))
        return tuple(cache.append_batch(seq_ids, num_tokens, token_ids=token_ids)
                     for cache in self.groups)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing every page of `parent_id` in every group."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(f"sequence {child_id!r} already exists")
        for cache in self.groups:
            cache.fork(parent_id, child_id)
        self._seqs[child_id] = _GroupedSequence(parent.shared)

    def commit(self, seq_id: Hashable) -> None:
        """The K/V of every token the sequence holds is written, in every group: its full
        pages become matchable in each group's prefix cache."""
        self._get(seq_id)
        for cache in self.groups:
            cache.commit(seq_id)

    def set_last_token(self, seq_id: Hashable, token_id: int) -> None:
        """Record the id of the sequence's last token in every group
        (KVCache.set_last_token)."""
        self._get(seq_id)
        for cache in self.groups:
            cache.set_last_token(seq_id, token_id)

    def free_sequence(self, seq_id: Hashable) -> None:
        """Give back the sequence's references in every group."""
        self._get(seq_id)
        for cache in self.groups:
            cache.free_sequence(seq_id)
        del self._seqs[seq_id]

    # ---- queries -----------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds (in every group)."""
        self._get(seq_id)
        return self.groups[0].num_tokens(seq_id)

    def pages(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """The sequence's page table in `group` (a copy; HOLE where a window group gave a
        page back)."""
        self._get(seq_id)
        return self.groups[group].pages(seq_id)

    def slots(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """The slot of each of the sequence's tokens in `group` (HOLE where given back)."""
        self._get(seq_id)
        return self.groups[group].slots(seq_id)

    def sequences(self) -> list[Hashable]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def page_tables(self, seq_ids: Sequence[Hashable], *, group: int = 0) -> torch.Tensor:
        """Page tables `[batch, max_pages]` int32 of `group`'s pool, on the host
        (KVCache.page_tables)."""
        return self.groups[group].page_tables(seq_ids)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int], *, group: int = 0) -> torch.Tensor:
        """Slots int64 on the host of tokens [starts[i], ends[i]) of each sequence in `group`'s
        pool; the tokens of the group's match that are computed again (a shorter hit
        elsewhere) write to the group pool's reserved padding page instead of the shared pages."""
        slots = self.groups[group].slot_mapping(seq_ids, starts, ends)
        padding = self.groups[group].pool.padding_slot
        offset = 0
        for seq_id, start, end in zip(seq_ids, starts, ends, strict=True):
            shared = self._get(seq_id).shared[group]
            if start < shared:
                slots[offset:offset + min(end, shared) - start] = padding
            offset += end - start
        return slots

    @property
    def frees_out_of_window(self) -> bool:
        """Whether a group gives pages back as sequences grow (so the scheduler takes a
        prompt's pages chunk by chunk)."""
        return any(cache.frees_out_of_window for cache in self.groups)

    def prefix_hit(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Tokens `add_sequence(seq_id, token_ids)` would be served: the shortest of the
        groups' matches. Changes nothing."""
        return min(cache.prefix_hit(token_ids, cache_salt=cache_salt) for cache in self.groups)

    def can_add(self, token_ids: Sequence[int], *, spare_pages: int = 0,
                entering: int | None = None, cache_salt: str | None = None) -> bool:
        """Whether `add_sequence` would succeed leaving `spare_pages` available in every
        group; with `entering` (see KVCache.can_add), a window group asks room for the first
        `entering` tokens, a full group for all of them. Changes nothing."""
        return all(cache.can_add(token_ids, spare_pages=spare_pages, entering=entering,
                                 cache_salt=cache_salt)
                   for cache in self.groups)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether `append(seq_id, num_tokens)` would succeed in every group."""
        return all(cache.can_append(seq_id, num_tokens) for cache in self.groups)

    def check_fits(self, num_tokens: int) -> None:
        """Raise OutOfPages, naming the group, unless one sequence of `num_tokens` tokens
        fits alone in every group's pool."""
        for group, cache in zip(self.layer_groups, self.groups, strict=True):
            try:
                cache.check_fits(num_tokens)
            except OutOfPages as e:
                raise OutOfPages(f"{group_name(group)} pool: {e}") from None

    @property
    def page_size(self) -> int:
        """Tokens per page (every group's)."""
        return self.layout.page_size

    @property
    def device(self) -> torch.device:
        """Where the pools live."""
        return self.groups[0].device

    @property
    def prefix_cache(self):
        """Group 0's prefix cache (None when prefix caching is off)."""
        return self.groups[0].prefix_cache

    @property
    def num_pages(self) -> int:
        """Pages of all the groups' pools."""
        return sum(cache.num_pages for cache in self.groups)

    @property
    def num_free_pages(self) -> int:
        """Free pages of all the groups."""
        return sum(cache.num_free_pages for cache in self.groups)

    @property
    def num_cached_pages(self) -> int:
        """Cached (evictable) pages of all the groups."""
        return sum(cache.num_cached_pages for cache in self.groups)

    @property
    def num_available_pages(self) -> int:
        """Free and cached pages of all the groups."""
        return self.num_free_pages + self.num_cached_pages

    def group_stats(self) -> tuple[CacheStats, ...]:
        """Each group's KVCache stats, in group order."""
        return tuple(cache.stats() for cache in self.groups)

    def stats(self) -> CacheStats:
        """The groups' counters summed (pages of every pool; tokens and copies counted in each
        group), with the prefix hits as served: the shortest match of every group."""
        each = self.group_stats()
        summed = {f.name: sum(getattr(s, f.name) for s in each) for f in fields(CacheStats)}
        summed.update(num_sequences=len(self._seqs), page_size=self.page_size,
                      prefix_query_tokens=self._query_tokens, prefix_hit_tokens=self._hit_tokens)
        return CacheStats(**summed)

    def check(self) -> None:
        """Each group's invariants, plus: every group holds the same sequences, each with the
        same number of tokens; a
        sequence's shared tokens in each group are whole pages of its tokens."""
        for cache in self.groups:
            cache.check()
        for g, cache in enumerate(self.groups):
            assert cache.sequences() == list(self._seqs), (
                f"group {g} holds sequences {cache.sequences()}, the cache {list(self._seqs)}")
        for seq_id, seq in self._seqs.items():
            counts = [cache.num_tokens(seq_id) for cache in self.groups]
            assert len(set(counts)) == 1, f"sequence {seq_id!r} holds {counts} tokens by group"
            for g, shared in enumerate(seq.shared):
                assert shared % self.page_size == 0 and shared <= counts[0], (
                    f"sequence {seq_id!r} shares {shared} tokens in group {g} of {counts[0]}")

    # ---- internals ---------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _GroupedSequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return seq

    def _check_room(self, g: int, need: int) -> None:
        """Raise OutOfPages unless group g can give `need` pages."""
        cache = self.groups[g]
        if need > cache.num_available_pages:
            raise OutOfPages(f"{group_name(self.layer_groups[g])} pool: need {need} pages, "
                             f"{cache.num_free_pages} free, {cache.num_cached_pages} evictable")

    def _check_length(self, seq_id: Hashable, n: int) -> None:
        limit = self.max_tokens_per_seq
        if limit is not None and n > limit:
            raise SequenceTooLong(f"sequence {seq_id!r} would hold {n} tokens, "
                                  f"over the limit of {limit}")


def _batch_need(cache: KVCache, seq_ids: list[Hashable], counts: list[int]) -> int:
    """Pages `cache.append_batch(seq_ids, counts)` takes: each sequence's `pages_to_append`,
    less the copies it saves where several of the batch share one partial last page (it
    copies that page only while another holder keeps the original)."""
    need = 0
    sharing: Counter[int] = Counter()
    refcounts = cache.allocator.refcounts
    for seq_id, n in zip(seq_ids, counts, strict=True):
        need += cache.pages_to_append(seq_id, n)
        last = cache.pages(seq_id)[-1] if n and cache.num_tokens(seq_id) % cache.page_size \
            else None
        if last is not None and refcounts[last] > 1:
            sharing[last] += 1
    for page, k in sharing.items():
        need -= k - min(k, refcounts[page] - 1)
    return need
