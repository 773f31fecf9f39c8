"""Page groups: layer groups whose tokens' K/V (or MLA latents) live in pages of a KVPool.
`FullAttention` keeps every page of a sequence; `SlidingWindow` gives back the pages wholly
before the window of the sequence's next token. Each owns its pool, allocator and prefix
index; full attention may keep a tier that evicted prefix pages move to and load back from.

A sequence shares every page of its group's prefix match, even where the coordinator serves
a shorter hit (another group matched less): the tokens of the match are computed again for
the other groups' sake, and their K/V here goes to the pool's reserved padding page
(`slot_mapping` points there), so shared pages are never rewritten."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from kvpool.cache.group import CacheStats, GroupManager, Plan
from kvpool.cache.prefix_cache import NO_MATCH, NoPrefixCache, PrefixCache, PrefixMatch
from kvpool.cache.tiers import PageKey, Tier, page_namespace
from kvpool.cache.tokens import TOKEN_BYTES
from kvpool.errors import OutOfPages, UnknownSequence, check_int
from kvpool.memory.allocator import PageAllocator
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.numeric import int_tensor

HOLE = -1  # the page-table entry of a page given back after it fell out of the window
STORE_CHUNK_BYTES = 64 << 20  # evicted pages read at once on their way to a tier


@dataclass(slots=True)
class _PageTable:
    pages: list[int]  # logical page i -> page id
    num_tokens: int
    num_cached: int  # pages [0, num_cached) are the sequence's path in the prefix cache
    num_shared: int  # tokens of its prefix match: K/V in shared pages, never rewritten
    num_dropped: int = 0  # pages [0, num_dropped) fell out of the window: given back, HOLE
    caching: bool = True  # False once its pages can no longer join the prefix cache


class FullAttention(GroupManager):
    """`num_pages` pages of `layout` in a KVPool on `device`, a PageAllocator and (with
    `prefix_caching`) a PrefixCache; each sequence's page table holds every token's page.
    `tier`, `model_fingerprint` and `kv_scales` as KVCache takes them."""

    window: int | None = None  # tokens a new token attends to (None: the whole context)

    def __init__(self, layout: KVLayout, num_pages: int, *, device: str | torch.device,
                 policy: str = "lifo", prefix_caching: bool = False, reserve: int = 0,
                 scrub_on_free: bool = False, tier: Tier | None = None,
                 model_fingerprint: str = "", kv_scales=None, name: str = "full attention"):
        self.name = name
        self.layout = layout
        self.page_size = layout.page_size
        # the pool first: it checks num_pages and its bytes before the allocator builds its
        # lists of every page (2**31 pages of lists would exhaust the host)
        self.pool = KVPool(layout, num_pages, device=device, kv_scales=kv_scales)
        self.allocator = PageAllocator(num_pages, policy=policy, reserve=reserve,
                                       thread_safe=False)
        scales = None if self.pool.scales is None else self.pool.scales.tolist()
        self.namespace = page_namespace(layout, model_fingerprint, scales)
        if tier is not None:
            tier.bind(self.namespace, self.pool.kv[:, :, 0].shape, layout.dtype)
        self.tier = tier
        self.prefix_cache = PrefixCache(self.allocator, self.page_size) \
            if prefix_caching else None
        self._index = self.prefix_cache or NoPrefixCache()
        self.scrub_on_free = scrub_on_free
        if self.prefix_cache is not None and (tier is not None or scrub_on_free):
            self.prefix_cache.evict_hooks.append(self._evicted)
        # The tensor-parallel ranks repeat this group's tier loads (kvpool.engine.parallel):
        # fetch listeners are called with the keys fetched from the tier (before the
        # allocation that may store evicted pages to it), load listeners with the pages
        # they are then written into.
        self.fetch_listeners: list[Callable[[list[PageKey]], None]] = []
        self.load_listeners: list[Callable[[list[int]], None]] = []
        self._seqs: dict[Hashable, _PageTable] = {}
        self._hit_tokens = 0
        self._num_cow_copies = self._num_tier_loads = self._num_tier_stores = 0

    # ---- the group interface -----------------------------------------------------------

    def plan_add(self, token_ids: bytes | None, n: int, salt: bytes, limit: int) -> Plan:
        """Its own prefix match, whatever `limit`: shared all the same (see the module)."""
        match = NO_MATCH if token_ids is None else self._index.match(
            token_ids, self.hit_pages(n), salt)
        return Plan(-(-n // self.page_size) - len(match.pages),
                    len(match.pages) * self.page_size, match.pages, (match, token_ids))

    def add(self, seq_id: Hashable, n: int, salt: bytes, plan: Plan) -> int:
        """Raising (a fault of the device or a listener), it gives back every page it took."""
        need, (match, ids) = plan.need, plan.data
        pages = match.pages
        loaded = [] if self.tier is None or ids is None else self._fetch_from_tier(ids, n, match)
        if pages:
            self.allocator.hold(pages)
        matched = len(pages)
        try:
            pages = pages + self.allocator.allocate(need)
            if loaded and not self._load_from_tier(ids, pages, matched, loaded, salt):
                loaded = []  # a miss: its tokens are computed again
        except BaseException:
            self.allocator.drop(pages)  # the match's pages, and the new ones if allocated
            raise
        hit_pages = matched + len(loaded)
        hit = hit_pages * self.page_size
        if ids is not None and self.prefix_cache is not None:
            self._hit_tokens += hit
        self._seqs[seq_id] = _PageTable(pages, n, hit_pages, hit, 0, ids is not None)
        return hit

    def plan_append(self, seq_id: Hashable, n: int, copied: dict[int, int]) -> Plan:
        """New pages: those it grows by, one for each page `_to_copy` (a first drop out of
        the window), one if it copies its shared partial last page (copy-on-write)."""
        seq = self._seqs[seq_id]
        if n == 0:
            return Plan(0, data=(False, [], 0))
        start, ps = seq.num_tokens, self.page_size
        drop_to = self.drop_point(start)
        to_copy = self._to_copy(seq, drop_to) if drop_to > 0 and not seq.num_dropped else []
        need = -(-(start + n) // ps) - len(seq.pages) + len(to_copy)
        if start % ps == 0:
            return Plan(need, data=(False, to_copy, drop_to))
        last = seq.pages[-1]
        holders = self.allocator.refcounts[last]
        cow = holders > 1 and holders - copied.get(last, 0) > 1
        if cow:
            copied[last] = copied.get(last, 0) + 1
        return Plan(need + cow, data=(cow, to_copy, drop_to))

    def append(self, seq_id: Hashable, n: int, known: bool, plan: Plan,
               new: list[int]) -> list[int]:
        seq = self._seqs[seq_id]
        cow, to_copy, drop_to = plan.data
        start = seq.num_tokens
        if cow:
            self._copy_on_write(seq, new.pop())
        if drop_to > seq.num_dropped:
            self._drop(seq, drop_to, to_copy, [new.pop() for _ in to_copy])
        seq.pages += new
        seq.num_tokens = start + n
        if not known:
            seq.caching = False  # content unknown from here on: stop caching it
        return self._slots(seq, start, start + n)

    def allocate(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def room(self, plan: Plan, spare_pages: int = 0) -> bool:
        """Whether `plan.need` new pages can be allocated, leaving `spare_pages` available,
        once its shared pages are held (the cached ones among them leave the cached queue)."""
        available = self.allocator.num_available - spare_pages - plan.need
        return len(plan.shared) <= available or self.num_unheld(plan.shared) <= available

    def shortage(self, plan: Plan) -> OutOfPages:
        alloc = self.allocator
        return OutOfPages(f"need {plan.need} pages, {alloc.num_free} free ({alloc.reserve} "
                          f"reserved), {alloc.num_cached - self.num_unheld(plan.shared)} "
                          f"evictable")

    def plan_fork(self, parent_id: Hashable) -> Plan:
        """Nothing new: the child shares every page."""
        return Plan(0)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        parent = self._seqs[parent_id]
        self.allocator.hold(parent.pages[parent.num_dropped:])
        self._seqs[child_id] = replace(parent, pages=list(parent.pages))

    def commit(self, seq_id: Hashable, token_ids: bytes | bytearray | None, salt: bytes) -> None:
        """Its full pages join the prefix cache; where the cache already holds the content
        of its next page in another page (an identical prompt prefilled at the same time),
        the sequence keeps its own pages uncached."""
        seq = self._seqs[seq_id]
        full = seq.num_tokens // self.page_size
        if not seq.caching or token_ids is None or full <= seq.num_cached:
            return
        seq.num_cached = self._index.insert(bytes(token_ids), seq.pages[:full],
                                            seq.num_cached, salt)
        if seq.num_cached < full:
            seq.caching = False

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id)
        del seq.pages[:seq.num_dropped]  # HOLE entries
        gone = self.allocator.drop(seq.pages)
        if self.scrub_on_free:
            self._scrub(gone)

    # ---- queries -----------------------------------------------------------------------

    def num_unheld(self, pages: Sequence[int]) -> int:
        """How many of `pages` no sequence holds (cached): a hit takes them off the queue."""
        refcounts = self.allocator.refcounts
        return [refcounts[page] for page in pages].count(0)

    def pages(self, seq_id: Hashable) -> list[int]:
        """The sequence's page table (a copy); HOLE for pages given back out of the window."""
        return list(self._get(seq_id).pages)

    def slots(self, seq_id: Hashable) -> list[int]:
        """The slot of each of the sequence's tokens; HOLE where its page went back."""
        seq = self._get(seq_id)
        dropped = seq.num_dropped * self.page_size
        return [HOLE] * dropped + self._slots(seq, dropped, seq.num_tokens)

    def owners(self, page: int) -> list[Hashable]:
        """Live sequences whose page table holds `page` (an id in [0, num_pages))."""
        check_int("page", page, 0, self.allocator.num_pages - 1)
        return [sid for sid, seq in self._seqs.items() if page in seq.pages]

    def drop_point(self, position: int) -> int:
        """Pages wholly before the window of a token at `position` (none: full attention)."""
        return 0

    def pages_alone(self, num_tokens: int) -> int:
        """The most pages one sequence of `num_tokens` tokens holds at once, alone."""
        return self.layout.num_pages_for(num_tokens)

    def hit_pages(self, n: int) -> int:
        """The most pages a new sequence of `n` tokens takes from the prefix cache (and the
        tier): never its last token's."""
        return (n - 1) // self.page_size if n else 0

    def page_tables(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """`KVCache.page_tables` of this group."""
        seqs = [self._get(sid) for sid in seq_ids]
        width = max((len(seq.pages) for seq in seqs), default=0)
        flat: list[int] = []
        for seq in seqs:
            flat += [0] * seq.num_dropped + seq.pages[seq.num_dropped:]
            flat += [0] * (width - len(seq.pages))
        return int_tensor(flat, torch.int32).reshape(len(seqs), width)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int]) -> torch.Tensor:
        """`KVCache.slot_mapping` of this group."""
        if not len(seq_ids) == len(starts) == len(ends):
            raise ValueError(f"slot_mapping takes one start and end per sequence: "
                             f"{len(seq_ids)} sequences, {len(starts)} starts, {len(ends)} ends")
        out: list[int] = []
        for sid, start, end in zip(seq_ids, starts, ends, strict=True):
            seq = self._get(sid)
            if type(start) is not int or type(end) is not int:
                raise TypeError(f"token range [{start!r}, {end!r}) of sequence {sid!r}: "
                                f"start and end must be ints")
            if not 0 <= start <= end <= seq.num_tokens:
                raise ValueError(f"token range [{start}, {end}) is outside sequence {sid!r} "
                                 f"of {seq.num_tokens} tokens")
            if start < end and start < seq.num_dropped * self.page_size:
                raise ValueError(f"token range [{start}, {end}) of sequence {sid!r} starts "
                                 f"in its first {seq.num_dropped * self.page_size} tokens, "
                                 f"whose pages went back out of the window")
            rewritten = max(min(end, seq.num_shared) - start, 0)
            out += [self.pool.padding_slot] * rewritten
            out += self._slots(seq, start + rewritten, end)
        return int_tensor(out)

    def stats(self, num_sequences: int, query_tokens: int) -> CacheStats:
        """Page counts, filled slots, prefix-cache and copy-on-write counters (the tokens
        looked up, `query_tokens`, are the cache's: every group looks up every prompt)."""
        full: set[int] = set()
        partial: dict[int, int] = {}
        ps = self.page_size
        for seq in self._seqs.values():
            nfull = seq.num_tokens // ps
            full.update(seq.pages[seq.num_dropped:nfull])
            if nfull < len(seq.pages):
                partial[seq.pages[nfull]] = seq.num_tokens - nfull * ps
        alloc = self.allocator
        return CacheStats(
            num_pages=alloc.num_pages, num_free_pages=alloc.num_free,
            num_cached_pages=alloc.num_cached, num_used_pages=alloc.num_used,
            num_sequences=num_sequences, num_tokens=len(full) * ps + sum(partial.values()),
            prefix_query_tokens=query_tokens, prefix_hit_tokens=self._hit_tokens,
            num_evicted_pages=alloc.stats().num_evicted,
            num_cow_copies=self._num_cow_copies, page_size=ps,
            num_tier_loads=self._num_tier_loads, num_tier_stores=self._num_tier_stores,
            num_reserved_pages=self.pool.num_reserved_pages)

    def check(self, num_tokens: dict[Hashable, int]) -> None:
        """The allocator, pool, prefix tree and tier consistent; each page table sized to its
        tokens, its first `num_cached` pages a tree path, its HOLEs before the window (none on
        a tree path); each page's reference count the page tables holding it, which hold no
        reserved page."""
        self.allocator.check()
        self.pool.check()
        assert self.pool.num_pages == self.allocator.num_pages, (
            f"the pool holds {self.pool.num_pages} pages, the allocator "
            f"{self.allocator.num_pages}")
        self._index.check()
        if self.tier is not None:
            self.tier.check()
        assert list(self._seqs) == list(num_tokens), (
            f"{self.name} holds sequences {list(self._seqs)}, the cache {list(num_tokens)}")
        holders: Counter[int] = Counter()
        for sid, seq in self._seqs.items():
            held = seq.pages[seq.num_dropped:]
            holders.update(held)
            assert seq.num_tokens == num_tokens[sid], (
                f"sequence {sid!r} holds {seq.num_tokens} tokens here, {num_tokens[sid]} in all")
            assert len(seq.pages) == -(-seq.num_tokens // self.page_size), (
                f"sequence {sid!r} holds {seq.num_tokens} tokens in {len(seq.pages)} pages")
            assert len(set(held)) == len(held), f"sequence {sid!r} repeats a page"
            assert seq.pages[:seq.num_dropped] == [HOLE] * seq.num_dropped and HOLE not in held, (
                f"sequence {sid!r} has {seq.num_dropped} pages dropped, page table {seq.pages}")
            assert seq.num_dropped <= self.drop_point(seq.num_tokens), (
                f"sequence {sid!r} dropped {seq.num_dropped} pages, some in its window")
            assert not (seq.num_dropped and (seq.num_cached or seq.caching)), (
                f"sequence {sid!r} dropped pages but is still cached")
            assert not (seq.num_dropped and any(map(self.allocator.is_cached, held))), (
                f"sequence {sid!r} dropped pages but holds pages the prefix cache indexes")
            assert seq.num_shared % self.page_size == 0 and seq.num_shared <= seq.num_tokens, (
                f"sequence {sid!r} shares {seq.num_shared} of {seq.num_tokens} tokens")
            assert self._index.holds_path(seq.pages[:seq.num_cached]), (
                f"sequence {sid!r}: first {seq.num_cached} pages {seq.pages[:seq.num_cached]} "
                f"are not a path of the prefix cache")
        refcounts = self.allocator.refcounts
        expected = [holders.get(page, 0) for page in range(len(refcounts))]
        wrong = [page for page, count in enumerate(refcounts) if count != expected[page]]
        assert not wrong, "reference counts unlike the page tables: " + "; ".join(
            f"page {page} counts {refcounts[page]}, held by {expected[page]}" for page in wrong[:5])
        reserved = sorted(page for page in holders if page >= self.allocator.num_pages)
        assert not reserved, f"sequences hold reserved or unknown pages {reserved}"

    # ---- internals ---------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _PageTable:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return seq

    def _fetch_from_tier(self, token_ids: bytes, n: int,
                         match: PrefixMatch) -> list[tuple[PageKey, torch.Tensor]]:
        """The keys and data of the pages continuing the device's `match` in the tier, page
        by page up to the first miss, never covering the last token; `token_ids` packed. Only
        `get` touches the tier, and only once the call is known to succeed."""
        page_bytes = self.page_size * TOKEN_BYTES
        parent_key = self.prefix_cache.chain_key(match.node, match.depth)
        loaded = []
        for i in range(len(match.pages), self.hit_pages(n)):
            key = PageKey.of_packed(parent_key, token_ids[i * page_bytes:(i + 1) * page_bytes])
            data = self.tier.get(key)
            if data is None:
                break
            loaded.append((key, data))
            parent_key = key.chain_key
        if loaded:
            for listener in self.fetch_listeners:
                listener([key for key, _ in loaded])
        return loaded

    def _load_from_tier(self, token_ids: bytes, pages: list[int], first: int,
                        loaded: list[tuple[PageKey, torch.Tensor]], salt: bytes) -> bool:
        """Write the data of `loaded` into the fresh pages [first, first + len(loaded)) of a
        new sequence and add them to the prefix cache after its device match. False, with a
        warning, if that raises (a fault of the device): the load is a miss, not a failure
        of the request (a Ctrl-C still raises)."""
        last = first + len(loaded)
        try:
            self.pool.write_pages(pages[first:last],
                                  torch.stack([data for _, data in loaded], dim=2))
            for listener in self.load_listeners:
                listener(pages[first:last])
            self.prefix_cache.insert(token_ids[:last * self.page_size * TOKEN_BYTES],
                                     pages[:last], salt=salt)
        except Exception as e:
            warnings.warn(f"kvpool: loading {len(loaded)} prefix pages from the tier failed "
                          f"({type(e).__name__}: {e}); they are computed again", RuntimeWarning,
                          stacklevel=2)
            return False
        self._num_tier_loads += len(loaded)
        return True

    def _evicted(self, pages: list[int], keys: Callable[[], list[PageKey]]) -> None:
        """The prefix cache's eviction hook: these cached pages, named by `keys()`, leave it
        and are about to be reused; copy them to the tier and scrub them. Eviction runs inside
        calls that have passed their checks: a page the tier cannot store is lost, as without
        a tier."""
        if self.tier is not None:
            self._num_tier_stores += store_pages(self.tier, self.pool, pages, keys())
        self._scrub(pages)

    def _scrub(self, pages: list[int]) -> None:
        """Zero pages whose content no sequence or cache keeps, if asked to."""
        if self.scrub_on_free and pages:
            self.pool.scrub_pages(pages)

    def _copy_on_write(self, seq: _PageTable, new_page: int) -> None:
        old = seq.pages[-1]
        self.pool.copy_pages([old], [new_page])
        self.allocator.drop([old])  # others still hold it: never reaches 0 here
        seq.pages[-1] = new_page
        self._num_cow_copies += 1

    def _to_copy(self, seq: _PageTable, drop_to: int) -> list[int]:
        """Indexes of the pages that `seq`, giving back its first pages [0, drop_to) out of the
        window, must copy to fresh ones first: its full pages in the window that the prefix
        cache indexes or that another sequence holds (and may yet commit). A sequence holds
        the tree's pages only while it holds the pages before them (the eviction order needs
        it), so at its first drop it lets go of its whole tree path and is cached no further;
        the tree keeps those pages whole, so a prefix hit is always served entirely."""
        refcounts, is_cached = self.allocator.refcounts, self.allocator.is_cached
        window = range(drop_to, seq.num_tokens // self.page_size)
        return [i for i in window if refcounts[seq.pages[i]] > 1 or is_cached(seq.pages[i])]

    def _drop(self, seq: _PageTable, drop_to: int, to_copy: list[int],
              copies: list[int]) -> None:
        """Give back pages [num_dropped, drop_to), and the pages at indexes `to_copy` after
        copying them to `copies`; cache the sequence no more."""
        kept = [seq.pages[i] for i in to_copy]
        self.pool.copy_pages(kept, copies)
        for i, page in zip(to_copy, copies, strict=True):
            seq.pages[i] = page
        gone = seq.pages[seq.num_dropped:drop_to] + kept
        seq.pages[seq.num_dropped:drop_to] = [HOLE] * (drop_to - seq.num_dropped)
        seq.num_dropped = drop_to
        seq.num_cached, seq.caching = 0, False
        self._scrub(self.allocator.drop(gone))

    def _slots(self, seq: _PageTable, start: int, end: int) -> list[int]:
        """The slots of tokens [start, end) of `seq`, built a page at a time."""
        ps, pages = self.page_size, seq.pages
        if ps == 1:  # a token's slot is its page
            return pages[start:end]
        slots: list[int] = []
        for i in range(start // ps, -(-end // ps)):
            first = i * ps
            slots += range(pages[i] * ps + max(start - first, 0),
                           pages[i] * ps + min(end - first, ps))
        return slots


def store_pages(tier: Tier, pool: KVPool, pages: list[int], keys: list[PageKey]) -> int:
    """Store `pages` of `pool` to `tier` under `keys`, read STORE_CHUNK_BYTES at a time (the
    copy on the device stays small); returns how many it stored. Never raises: a page that
    cannot be read (the device out of memory) or stored is dropped and counted."""
    chunk = max(1, STORE_CHUNK_BYTES // pool.layout.bytes_per_page)
    stored = 0
    for start in range(0, len(pages), chunk):
        part = pages[start:start + chunk]
        try:
            data = pool.read_pages(part)
        except Exception:  # noqa: BLE001 - any failure to read them loses the pages
            tier.count_dropped(len(part))
            continue
        for i, key in enumerate(keys[start:start + chunk]):
            stored += tier.store(key, data[:, :, i])
    return stored


class SlidingWindow(FullAttention):
    """Full attention's pages, less those wholly before the last `window` tokens of the next
    token: `append` gives them back (a HOLE stays in the page table).

    With `max_tokens_per_step` (the most tokens a call grows a sequence by, past its prefix
    hit: the engine's token budget of a step), a sequence holds a bounded number of pages
    however long it grows, so that one longer than the pool can run: an append takes its
    pages before it gives back those that left the window, so it holds the window, the
    tokens of this append and of the one before, and a partial page at each end."""

    def __init__(self, layout: KVLayout, num_pages: int, *, window: int,
                 max_tokens_per_step: int | None = None, **options):
        super().__init__(layout, num_pages, name=f"window {window:,}", **options)
        self.window = window
        self.max_tokens_per_step = max_tokens_per_step
        # With prefix caching, a first drop out of the window also copies the pages of the
        # window that the prefix tree indexes (`_to_copy`): without room for them alone, a
        # sequence would preempt itself and come back on the same hit, for ever.
        self._copies = -(-window // self.page_size) if self.prefix_cache is not None else 0
        # A prefix hit of h pages is held whole until the first drop, which then takes up to
        # two steps' pages and the copies beside it: h is capped where a sequence longer than
        # the pool would not fit (None: no such sequence fits at all).
        self._most_hit_pages = None
        usable = num_pages - self.allocator.reserve
        if max_tokens_per_step is not None and self._steady_pages() + self._copies <= usable:
            self._most_hit_pages = (usable - self._copies
                                    - -(-2 * max_tokens_per_step // self.page_size))

    def drop_point(self, position: int) -> int:
        return max(position - self.window + 1, 0) // self.page_size

    def pages_alone(self, num_tokens: int) -> int:
        pages = super().pages_alone(num_tokens)
        if self.max_tokens_per_step is not None:
            pages = min(pages, self._steady_pages())
        return pages + self._copies

    def hit_pages(self, n: int) -> int:
        most = super().hit_pages(n)
        return most if self._most_hit_pages is None else min(most, self._most_hit_pages)

    def _steady_pages(self) -> int:
        """The most pages a sequence holds at once past its first drop: at an append of k
        tokens at position s, after one of k' tokens, ceil((s + k) / page_size) less the
        floor((s - k' - window + 1) / page_size) given back before, with k, k' at most
        `max_tokens_per_step`."""
        return (self.window + 2 * self.max_tokens_per_step - 3) // self.page_size + 2

    def admitted(self, n: int, entering: int) -> int:
        """The entering tokens alone: the rest come chunk by chunk, as pages go back."""
        return entering
