"""KVCache: sequences -> page tables, with fork, copy-on-write, commit, a prefix cache, an
optional tier that evicted prefix pages move to and are loaded back from, and, when every
layer attends through a sliding window, pages given back once they fall out of it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvpool.allocator import PageAllocator
from kvpool.errors import (
    DuplicateSequence,
    OutOfPages,
    SequenceTooLong,
    UnknownSequence,
    check_int,
)
from kvpool.fp8 import is_fp8
from kvpool.layout import KVLayout
from kvpool.pool import KVPool
from kvpool.prefix_cache import NO_MATCH, NoPrefixCache, PrefixCache, PrefixMatch, salt_key
from kvpool.tiers import PageKey, Tier, page_namespace
from kvpool.tokens import TOKEN_BYTES, pack_tokens, unpack_tokens

HOLE = -1  # the page-table entry of a page given back after it fell out of the window


@dataclass(slots=True)
class _SequenceState:
    pages: list[int]  # page table: logical page i -> page id
    num_tokens: int
    token_ids: bytearray | None  # every token's id, packed; None: unknown, or not cached
    num_cached: int  # pages [0, num_cached) are the sequence's path in the prefix cache
    num_dropped: int = 0  # pages [0, num_dropped) fell out of the window: given back, HOLE
    salt: bytes = b""  # the prefix cache's root of its cache salt (salt_key)


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


class KVCache:
    """Owns a `KVPool` on `device`, a `PageAllocator` and (when `prefix_caching`) a
    `PrefixCache`, and maps each sequence to its page table (host bookkeeping: the page tables
    and slot mappings it builds are host tensors). Every mutating call checks first and then
    acts: a call that raises has changed nothing. Not thread-safe: call it from one thread (as
    the engine's loop does) or under a lock.

    With a `tier`, evicted prefix pages move there, and a later prompt continuing their
    prefix loads them back instead of recomputing. The tier is bound to this cache's
    namespace: its layout, `model_fingerprint` (a string naming the model and its weights)
    and the `kv_scales` of fp8 pages (as KVPool takes them; with a tier they must be given,
    since a stored page reads back right only under the scales it was written with). When
    every layer of `layout` has a sliding window and `free_out_of_window`, `append` gives
    back the pages that fall out of it (see `_to_copy`)."""

    def __init__(self, layout: KVLayout, num_pages: int, *, device: str | torch.device,
                 policy: str = "lifo", prefix_caching: bool = False, reserve: int = 0,
                 max_tokens_per_seq: int | None = None, scrub_on_free: bool = False,
                 tier: Tier | None = None, model_fingerprint: str = "",
                 kv_scales=None, free_out_of_window: bool = True):
        if max_tokens_per_seq is not None:
            check_int("max_tokens_per_seq", max_tokens_per_seq, 1)
        if tier is not None and not prefix_caching:
            raise ValueError("a tier holds evicted prefix pages: it needs prefix_caching=True")
        if not isinstance(model_fingerprint, str):
            raise TypeError(f"model_fingerprint must be a str, "
                            f"got {type(model_fingerprint).__name__}")
        if tier is not None and is_fp8(layout.dtype) and kv_scales is None:
            raise ValueError("fp8 pages in a tier need kv_scales given: scales taken from a "
                             "cache's first prefill would differ between caches sharing it")
        self.layout = layout
        self.page_size = layout.page_size
        self._page_bytes = layout.page_size * TOKEN_BYTES  # one page of packed token ids
        self.allocator = PageAllocator(num_pages, policy=policy, reserve=reserve,
                                       thread_safe=False)
        self.pool = KVPool(layout, num_pages, device=device, kv_scales=kv_scales)
        scales = None if self.pool.scales is None else self.pool.scales.tolist()
        self.namespace = page_namespace(layout, model_fingerprint, scales)
        if tier is not None:
            tier.bind(self.namespace, self.pool.kv[:, :, 0].shape, layout.dtype)
        self.tier = tier
        self.prefix_cache = PrefixCache(self.allocator, layout.page_size) \
            if prefix_caching else None
        self._index = self.prefix_cache or NoPrefixCache()
        self.max_tokens_per_seq = max_tokens_per_seq
        self._scrub_on_free = scrub_on_free
        if self.prefix_cache is not None and (tier is not None or scrub_on_free):
            self.prefix_cache.evict_hooks.append(self._evicted)
        windows = layout.layer_windows
        # tokens the last new token attends to when every layer is windowed; else None
        self.window = (max(windows) if free_out_of_window and windows and None not in windows
                       else None)
        self._seqs: dict[Hashable, _SequenceState] = {}
        self._prefix_query_tokens = self._prefix_hit_tokens = 0
        self._num_cow_copies = self._num_tier_loads = self._num_tier_stores = 0

    # ---- sequences ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Create a sequence holding `token_ids` (or `num_tokens` unknown tokens) and give it
        pages. Returns how many leading tokens the prefix cache served (whole pages, never
        the last token); their KV is already in the pool, loaded from the tier for pages
        past the device's match. A `cache_salt` shares pages only with sequences of the
        same salt (in the pool and in the tier)."""
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists")
        n, ids = _tokens(token_ids, num_tokens)
        salt = salt_key(cache_salt)
        self._check_length(seq_id, n)
        match = self._match(ids, n, salt)
        need = -(-n // self.page_size) - len(match.pages)  # tier hits take fresh pages too
        if need + len(match.pages) > self.allocator.num_available:
            self._check_room(need, match.pages)
        loaded = [] if self.tier is None or ids is None else self._fetch_from_tier(ids, n, match)
        if match.pages:
            self.allocator.share(match.pages)
        pages = match.pages + self.allocator.allocate(need)
        hit_pages = len(match.pages) + len(loaded)
        if loaded:
            self._load_from_tier(ids, pages, len(match.pages), loaded, salt)
        if ids is not None and self.prefix_cache is not None:
            self._prefix_query_tokens += n
            self._prefix_hit_tokens += hit_pages * self.page_size
        kept = None if ids is None or self.prefix_cache is None else bytearray(ids)
        self._seqs[seq_id] = _SequenceState(pages, n, kept, hit_pages, salt=salt)
        return hit_pages * self.page_size

    def append(self, seq_id: Hashable, num_tokens: int | None = None, *,
               token_ids: Sequence[int] | None = None) -> list[int]:
        """Grow a sequence by `num_tokens` (default 1, or `len(token_ids)`); returns the new
        tokens' slots. A shared partial last page is copied first (copy-on-write); with
        windowed layers, the pages wholly before the first new token's window go back."""
        seq = self._get(seq_id)
        n, packed = _tokens(token_ids, num_tokens, default=1)
        self._check_length(seq_id, seq.num_tokens + n)
        if n == 0:
            return []
        need, cow, to_copy = self._growth(seq, n, {})
        return self._grow(seq, n, packed, self.allocator.allocate(need), cow, to_copy)

    def append_batch(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | None = None,
                     *, token_ids: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Grow many sequences in one call: sequence `seq_ids[i]` by `num_tokens[i]` tokens
        (default 1 each: a decode step) or by `token_ids[i]`. Returns the new tokens' slots,
        sequence after sequence. Each sequence fills its partial last page first (copied
        first if shared), then takes whole new pages; one allocation serves the batch, so the
        call grows every sequence or, raising, changes nothing."""
        seq_ids = list(seq_ids)
        seqs = [self._get(sid) for sid in seq_ids]
        if len(set(seq_ids)) < len(seqs):
            raise ValueError("append_batch lists a sequence more than once")
        counts, packed = _batch_counts(len(seqs), num_tokens, token_ids)
        if self.max_tokens_per_seq is not None:
            for sid, seq, n in zip(seq_ids, seqs, counts, strict=True):
                self._check_length(sid, seq.num_tokens + n)
        copied: dict[int, int] = {}
        growths = [self._growth(seq, n, copied) for seq, n in zip(seqs, counts, strict=True)]
        new_pages = self.allocator.allocate(sum([need for need, _, _ in growths]))
        slots: list[int] = []
        taken = 0
        for seq, n, ids, (need, cow, to_copy) in zip(seqs, counts, packed, growths, strict=True):
            if n:
                slots += self._grow(seq, n, ids, new_pages[taken:taken + need], cow, to_copy)
                taken += need
        return slots

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing every page of `parent_id` (reference counts +1)."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequence(f"sequence {child_id!r} already exists")
        self.allocator.share(parent.pages[parent.num_dropped:])
        token_ids = None if parent.token_ids is None else bytearray(parent.token_ids)
        self._seqs[child_id] = _SequenceState(list(parent.pages), parent.num_tokens,
                                              token_ids, parent.num_cached, parent.num_dropped,
                                              parent.salt)

    def commit(self, seq_id: Hashable) -> None:
        """Declare the KV of every token the sequence holds written; with prefix caching its
        full pages become matchable by later sequences. Where the prefix cache already holds
        the content of the sequence's next page in another page (an identical prompt
        prefilled at the same time), the sequence keeps its own pages uncached."""
        seq = self._get(seq_id)
        full = seq.num_tokens // self.page_size
        if seq.token_ids is None or full <= seq.num_cached:
            return
        seq.num_cached = self._index.insert(bytes(seq.token_ids), seq.pages[:full],
                                            seq.num_cached, seq.salt)
        if seq.num_cached < full:
            seq.token_ids = None

    def set_last_token(self, seq_id: Hashable, token_id: int) -> None:
        """Record the id of the sequence's last token, appended before it was known (overlap
        scheduling appends a step's sampled token while the device still samples it). Call
        it before the commit that covers that token."""
        seq = self._get(seq_id)
        packed = pack_tokens([token_id])
        if seq.num_tokens == 0:
            raise ValueError(f"sequence {seq_id!r} holds no token")
        if seq.token_ids is not None:
            seq.token_ids[-TOKEN_BYTES:] = packed

    def free_sequence(self, seq_id: Hashable) -> None:
        """Give back the sequence's references. Its cached pages stay in the prefix cache
        (evictable once nobody else holds them)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        del seq.pages[:seq.num_dropped]  # HOLE entries
        self._scrub(self.allocator.free(seq.pages))

    # ---- queries -----------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds."""
        return self._get(seq_id).num_tokens

    def pages(self, seq_id: Hashable) -> list[int]:
        """The sequence's page table (a copy); HOLE for pages given back out of the window."""
        return list(self._get(seq_id).pages)

    def slots(self, seq_id: Hashable) -> list[int]:
        """The slot of each of the sequence's tokens; HOLE for tokens whose page went back
        out of the window."""
        seq = self._get(seq_id)
        dropped = seq.num_dropped * self.page_size
        return [HOLE] * dropped + self._slots(seq, dropped, seq.num_tokens)

    def sequences(self) -> list[Hashable]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def owners(self, page: int) -> list[Hashable]:
        """Live sequences whose page table holds `page` (for debugging and metrics)."""
        return [sid for sid, seq in self._seqs.items() if page in seq.pages]

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (O(1), unlike `stats()`)."""
        return self.allocator.num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages no sequence holds whose content the prefix cache keeps (O(1))."""
        return self.allocator.num_cached

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get: free ones plus cached ones no sequence holds."""
        return self.num_free_pages + self.num_cached_pages

    @property
    def scrub_on_free(self) -> bool:
        """Whether pages no sequence or cache keeps are zeroed (fixed at construction)."""
        return self._scrub_on_free

    @property
    def device(self) -> torch.device:
        """Where the pool lives."""
        return self.pool.device

    def pages_to_add(self, token_ids: Sequence[int] | None = None, *,
                     num_tokens: int | None = None, cache_salt: str | None = None) -> int:
        """Available pages `add_sequence` would consume: new pages (tier hits included: they
        are loaded into new pages) plus the cached pages its prefix hit would take off the
        cached queue. Changes nothing."""
        n, ids = _tokens(token_ids, num_tokens)
        match = self._match(ids, n, salt_key(cache_salt))
        return -(-n // self.page_size) - len(match.pages) + self._num_unheld(match.pages)

    def pages_to_append(self, seq_id: Hashable, num_tokens: int = 1) -> int:
        """Pages `append(seq_id, num_tokens)` would take, copy-on-write and the copies of a
        first drop out of the window included (not counting the pages it gives back)."""
        seq = self._get(seq_id)
        need, _, _ = self._growth(seq, check_int("num_tokens", num_tokens, 0), {})
        return need

    @property
    def frees_out_of_window(self) -> bool:
        """Whether pages go back as sequences grow past the window (every layer windowed,
        and `free_out_of_window`)."""
        return self.window is not None

    def prefix_hit(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Tokens of `token_ids` the device's prefix cache would serve to `add_sequence`
        (whole pages, never the last token; pages a tier would load are not counted).
        Changes nothing."""
        n, ids = _tokens(token_ids, None)
        return len(self._match(ids, n, salt_key(cache_salt)).pages) * self.page_size

    def can_add(self, token_ids: Sequence[int], *, spare_pages: int = 0,
                entering: int | None = None, cache_salt: str | None = None) -> bool:
        """Whether `add_sequence(seq_id, token_ids)` would succeed and leave `spare_pages`
        pages available. With `entering`, the sequence enters with its first `entering`
        tokens and takes the rest chunk by chunk: a cache that gives pages back out of the
        window asks room for those alone; one that keeps every page, for all of them.
        Changes nothing."""
        if entering is not None and self.frees_out_of_window:
            token_ids = token_ids[:entering]
        return (self.pages_to_add(token_ids, cache_salt=cache_salt) + spare_pages
                <= self.num_available_pages)

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether `append(seq_id, num_tokens)` would succeed. Changes nothing."""
        return self.pages_to_append(seq_id, num_tokens) <= self.num_available_pages

    def check_fits(self, num_tokens: int) -> None:
        """Raise OutOfPages unless one sequence of `num_tokens` tokens fits in the pool alone."""
        need, have = self.layout.num_pages_for(num_tokens), self.num_pages
        if need > have:
            raise OutOfPages(f"{num_tokens} tokens need {need} pages of {self.page_size} "
                             f"tokens; the pool has {have}")

    def page_tables(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Page tables `[batch, max_pages]` int32 on the host (bookkeeping: whoever hands them
        to a kernel moves them to the pool's device), rows padded with page id 0, which also
        stands for the pages given back out of the window."""
        seqs = [self._get(sid) for sid in seq_ids]
        width = max((len(seq.pages) for seq in seqs), default=0)
        rows = [[0] * seq.num_dropped + seq.pages[seq.num_dropped:]
                + [0] * (width - len(seq.pages)) for seq in seqs]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)

    def slot_mapping(self, seq_ids: Sequence[Hashable], starts: Sequence[int],
                     ends: Sequence[int]) -> torch.Tensor:
        """Slots int64 of tokens [starts[i], ends[i]) of each sequence, concatenated, on the
        host (as page tables are)."""
        out: list[int] = []
        for sid, start, end in zip(seq_ids, starts, ends, strict=True):
            seq = self._get(sid)
            if not 0 <= start <= end <= seq.num_tokens:
                raise ValueError(f"token range [{start}, {end}) is outside sequence {sid!r} "
                                 f"of {seq.num_tokens} tokens")
            if start < end and start < seq.num_dropped * self.page_size:
                raise ValueError(f"token range [{start}, {end}) of sequence {sid!r} starts "
                                 f"in its first {seq.num_dropped * self.page_size} tokens, "
                                 f"whose pages went back out of the window")
            out.extend(self._slots(seq, start, end))
        return torch.tensor(out, dtype=torch.int64)

    def stats(self) -> CacheStats:
        """Page counts, filled slots, prefix-cache and copy-on-write counters."""
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
            num_sequences=len(self._seqs), num_tokens=len(full) * ps + sum(partial.values()),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_evicted_pages=alloc.stats().num_evicted,
            num_cow_copies=self._num_cow_copies, page_size=ps,
            num_tier_loads=self._num_tier_loads, num_tier_stores=self._num_tier_stores,
            num_reserved_pages=self.pool.num_reserved_pages)

    def check(self) -> None:
        """Invariants: allocator conservation; page tables sized to their tokens; each
        sequence's first `num_cached` pages a path of the prefix cache; each page's reference
        count equal to the number of sequences whose page table holds it; pages given back
        only before the window of the next token, and never by a sequence on a tree path;
        the prefix tree, the tier and the pool's fp8 scales consistent; the pool's reserved
        pages outside the allocator's ids."""
        self.allocator.check()
        self.pool.check()
        assert self.pool.num_pages == self.allocator.num_pages, (
            f"the pool holds {self.pool.num_pages} pages, the allocator "
            f"{self.allocator.num_pages}")
        self._index.check()
        if self.tier is not None:
            self.tier.check()
        holders: Counter[int] = Counter()
        for sid, seq in self._seqs.items():
            held = seq.pages[seq.num_dropped:]
            holders.update(held)
            assert len(seq.pages) == -(-seq.num_tokens // self.page_size), (
                f"sequence {sid!r} holds {seq.num_tokens} tokens in {len(seq.pages)} pages")
            assert len(set(held)) == len(held), f"sequence {sid!r} repeats a page"
            assert seq.pages[:seq.num_dropped] == [HOLE] * seq.num_dropped and HOLE not in held, (
                f"sequence {sid!r} has {seq.num_dropped} pages dropped, page table {seq.pages}")
            assert seq.num_dropped <= self._drop_point(seq.num_tokens), (
                f"sequence {sid!r} dropped {seq.num_dropped} pages, some in its window")
            assert not (seq.num_dropped and (seq.num_cached or seq.token_ids is not None)), (
                f"sequence {sid!r} dropped pages but is still cached")
            assert not (seq.num_dropped and any(map(self.allocator.is_cached, held))), (
                f"sequence {sid!r} dropped pages but holds pages the prefix cache indexes")
            assert seq.token_ids is None or len(seq.token_ids) == seq.num_tokens * TOKEN_BYTES, (
                f"sequence {sid!r}: {len(seq.token_ids)} bytes of ids, {seq.num_tokens} tokens")
            assert self._index.holds_path(seq.pages[:seq.num_cached]), (
                f"sequence {sid!r}: first {seq.num_cached} pages {seq.pages[:seq.num_cached]} "
                f"are not a path of the prefix cache")
        for page in range(self.allocator.num_pages):
            assert self.allocator.refcount(page) == holders[page], (
                f"page {page}: refcount {self.allocator.refcount(page)}, {holders[page]} holders")
        reserved = sorted(page for page in holders if page >= self.allocator.num_pages)
        assert not reserved, f"sequences hold reserved or unknown pages {reserved}"

    # ---- internals ---------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}")
        return seq

    def _match(self, token_ids: bytes | None, n: int, salt: bytes) -> PrefixMatch:
        """The cached prefix of a sequence of `n` tokens under `salt`: whole pages, never the
        last token (its logits must be computed); the empty match when the content is
        unknown."""
        if token_ids is None:
            return NO_MATCH
        return self._index.match(token_ids, (n - 1) // self.page_size if n else 0, salt)

    def _num_unheld(self, pages: list[int]) -> int:
        """How many of `pages` no sequence holds (cached): a hit takes them off the queue."""
        refcounts = self.allocator.refcounts
        return [refcounts[page] for page in pages].count(0)

    def _check_room(self, need: int, hit_pages: list[int]) -> None:
        """Raise OutOfPages unless `need` pages can be allocated once `hit_pages` are held
        (the cached ones among them leave the cached queue)."""
        alloc = self.allocator
        taken = self._num_unheld(hit_pages)
        if need and need + taken > alloc.num_available:
            raise OutOfPages(f"need {need} pages, {alloc.num_free} free "
                             f"({alloc.reserve} reserved), "
                             f"{alloc.num_cached - taken} evictable")

    def _fetch_from_tier(self, token_ids: bytes, n: int, match: PrefixMatch) -> list[torch.Tensor]:
        """The data of the pages continuing the device's `match` in the tier, page by
        page up to the first miss, never covering the last token; `token_ids` packed. Only
        `get` touches the tier, and only once the call is known to succeed."""
        page_bytes = self._page_bytes
        parent_key = self.prefix_cache.chain_key(match.node, match.depth)
        loaded = []
        for i in range(len(match.pages), (n - 1) // self.page_size):
            page_ids = unpack_tokens(token_ids[i * page_bytes:(i + 1) * page_bytes])
            key = PageKey.of(parent_key, page_ids)
            data = self.tier.get(key)
            if data is None:
                break
            loaded.append(data)
            parent_key = key.chain_key
        return loaded

    def _load_from_tier(self, token_ids: bytes, pages: list[int], first: int,
                        loaded: list[torch.Tensor], salt: bytes) -> None:
        """Write `loaded` into the fresh pages [first, first + len(loaded)) of a new
        sequence and add them to the prefix cache after its device match."""
        last = first + len(loaded)
        self.pool.write_pages(pages[first:last], torch.stack(loaded, dim=2))
        self._num_tier_loads += len(loaded)
        self.prefix_cache.insert(token_ids[:last * self._page_bytes], pages[:last], salt=salt)

    def _evicted(self, pages: list[int], keys: list[PageKey]) -> None:
        """The prefix cache's eviction hook: these cached pages, named by `keys`, left it and
        are about to be reused; copy them to the tier and scrub them. Eviction runs inside
        calls that have passed their checks, and never fails: a page the tier cannot store is
        lost, as without a tier."""
        if self.tier is not None:
            data = self.pool.read_pages(pages)
            for i, key in enumerate(keys):
                self._num_tier_stores += self.tier.store(key, data[:, :, i])
        self._scrub(pages)

    def _scrub(self, pages: list[int]) -> None:
        """Zero pages whose content no sequence or cache keeps, if asked to."""
        if self._scrub_on_free and pages:
            self.pool.scrub_pages(pages)

    def _check_length(self, seq_id: Hashable, n: int) -> None:
        limit = self.max_tokens_per_seq
        if limit is not None and n > limit:
            raise SequenceTooLong(f"sequence {seq_id!r} would hold {n} tokens, "
                                  f"over the limit of {limit}")

    def _growth(self, seq: _SequenceState, n: int,
                copied: dict[int, int]) -> tuple[int, bool, list[int]]:
        """What appending `n` tokens to `seq` takes: new pages (those it grows by, one for each
        page `_to_copy`, one if it copies its shared partial last page), whether it makes that
        copy (copy-on-write), and `_to_copy`. `copied` counts the copies of each page made by
        sequences earlier in the batch; this one's is added."""
        if n == 0:
            return 0, False, []
        start, ps = seq.num_tokens, self.page_size
        drop_to = self._drop_point(start)
        first_drop = drop_to > 0 and not seq.num_dropped
        to_copy = self._to_copy(seq, drop_to) if first_drop else []
        need = -(-(start + n) // ps) - len(seq.pages) + len(to_copy)
        if start % ps == 0:
            return need, False, to_copy
        last = seq.pages[-1]
        holders = self.allocator.refcounts[last]
        cow = holders > 1 and holders - copied.get(last, 0) > 1
        if cow:
            copied[last] = copied.get(last, 0) + 1
        return need + cow, cow, to_copy

    def _copy_on_write(self, seq: _SequenceState, new_page: int) -> None:
        old = seq.pages[-1]
        self.pool.copy_pages([old], [new_page])
        self.allocator.free([old])  # others still hold it: never reaches 0 here
        seq.pages[-1] = new_page
        self._num_cow_copies += 1

    def _grow(self, seq: _SequenceState, n: int, packed: bytes | None, new_pages: list[int],
              cow: bool, to_copy: list[int]) -> list[int]:
        """Add `n` tokens (ids `packed`, or unknown) to `seq` as its `_growth` planned, with
        `new_pages`; returns the new tokens' slots."""
        start = seq.num_tokens
        drop_to = self._drop_point(start)
        if cow:
            self._copy_on_write(seq, new_pages.pop())
        if drop_to > seq.num_dropped:
            self._drop(seq, drop_to, to_copy, [new_pages.pop() for _ in to_copy])
        seq.pages += new_pages
        seq.num_tokens = start + n
        if seq.token_ids is not None:
            if packed is None:
                seq.token_ids = None  # content unknown from here on: stop caching it
            else:
                seq.token_ids += packed
        return self._slots(seq, start, start + n)

    def _drop_point(self, position: int) -> int:
        """Pages wholly before the window of a token at `position`: 0 when layers are not all
        windowed."""
        if self.window is None:
            return 0
        return max(position - self.window + 1, 0) // self.page_size

    def _to_copy(self, seq: _SequenceState, drop_to: int) -> list[int]:
        """Indexes of the pages that `seq`, giving back its first pages [0, drop_to) out of the
        window, must copy to fresh ones first: its full pages in the window that the prefix
        cache indexes or that another sequence holds (and may yet commit). A sequence holds
        the tree's pages only while it holds the pages before them (the eviction order needs
        it), so at its first drop it lets go of its whole tree path and is cached no further;
        the tree keeps those pages whole, so a prefix hit is always served entirely."""
        refcounts, is_cached = self.allocator.refcounts, self.allocator.is_cached
        window = range(drop_to, seq.num_tokens // self.page_size)
        return [i for i in window if refcounts[seq.pages[i]] > 1 or is_cached(seq.pages[i])]

    def _drop(self, seq: _SequenceState, drop_to: int, to_copy: list[int],
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
        seq.num_cached, seq.token_ids = 0, None
        self._scrub(self.allocator.free(gone))

    def _slots(self, seq: _SequenceState, start: int, end: int) -> list[int]:
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
    if num_tokens is not None and num_tokens != len(token_ids):
        raise ValueError(f"num_tokens={num_tokens} disagrees with {len(token_ids)} token_ids")
    return len(token_ids), pack_tokens(token_ids)


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
