"""Page ids and their reference counts: which pages of the pool are free, cached, or held.

`PageAllocator` hands out page ids in `[0, num_pages)` and keeps one reference count per page:
the number of holders (the sequences whose page tables list it). A page with count 0 is free
(its content is worthless) or cached (the prefix cache indexes its content). Cached pages
wait on a queue in least-recently-used order; an allocation takes free pages first, then
cached ones from the queue's cold end, telling `on_evict` which cached pages it took. So
eviction costs what allocation costs, a step per page, and is never a pass of its own.
Every call checks before it acts: a call that raises has changed nothing.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Lock

from kvpool.errors import MAX_PAGES, InvalidPage, OutOfPages, check_int
from kvpool.first_fit import FirstFitFreeList

POLICIES = ("lifo", "first_fit")


@dataclass(slots=True, frozen=True)
class AllocatorStats:
    """A snapshot of an allocator's counters, all in pages except `num_failed` (calls)."""

    num_pages: int
    num_free: int
    num_used: int
    peak_used: int
    num_allocated: int
    num_freed: int
    num_failed: int
    num_cached: int = 0
    num_evicted: int = 0

    @property
    def utilization(self) -> float:
        """Fraction of pages in use, from 0.0 to 1.0."""
        return self.num_used / self.num_pages


class _CachedQueue:
    """Page ids in least-recently-used order: a doubly linked list threaded through two
    int32 arrays indexed by page id (4 bytes a page each, no object per entry), whose
    sentinel is the index past the last page. O(1) per page to add, remove or pop. (Lists
    would make the loops about twice as fast, but cost 0.8 MiB more per 100,000 pages, over
    the heap budget.)"""

    __slots__ = ("_next", "_prev", "size")

    def __init__(self, num_pages: int) -> None:
        self._next = array("i", [num_pages]) * (num_pages + 1)  # sentinel's: the coldest
        self._prev = array("i", [num_pages]) * (num_pages + 1)  # sentinel's: the warmest
        self.size = 0  # pages queued (an attribute: len() would cost a Python call)

    def __iter__(self):
        """The pages, coldest first."""
        nxt, page = self._next, self._next[-1]
        for _ in range(self.size):
            yield page
            page = nxt[page]

    def push_warm(self, pages: list[int]) -> None:
        """Add pages (not queued) at the warm end, in order: the last is the warmest."""
        nxt, prv = self._next, self._prev
        sentinel = len(nxt) - 1
        for page in pages:
            last = prv[sentinel]
            nxt[last] = page
            prv[page] = last
            nxt[page] = sentinel
            prv[sentinel] = page
        self.size += len(pages)

    def remove(self, pages: Collection[int]) -> None:
        """Take queued pages (each once) out of the queue."""
        nxt, prv = self._next, self._prev
        for page in pages:
            before, after = prv[page], nxt[page]
            nxt[before] = after
            prv[after] = before
        self.size -= len(pages)

    def pop_cold(self, n: int) -> list[int]:
        """Remove and return the `n` coldest pages, coldest first; needs `n <= self.size`."""
        nxt, prv = self._next, self._prev
        sentinel = len(nxt) - 1
        pages = []
        page = nxt[sentinel]
        for _ in range(n):
            pages.append(page)
            page = nxt[page]
        nxt[sentinel] = page
        prv[page] = sentinel
        self.size -= n
        return pages

    def problems(self) -> list[str]:
        """Broken links, described: the list must run from the sentinel through `len(self)`
        pages back to the sentinel, each page's `prev` naming the page before it."""
        nxt, prv = self._next, self._prev
        sentinel = len(nxt) - 1
        page, before = nxt[sentinel], sentinel
        for _ in range(self.size):
            if page == sentinel or prv[page] != before:
                return [f"the cached queue's links break at page {page}"]
            page, before = nxt[page], page
        if page != sentinel or prv[sentinel] != before:
            return [f"the cached queue holds more than its {self.size} pages"]
        return []


class PageAllocator:
    """Hands out page ids in `[0, num_pages)` and keeps a reference count per page.

    `policy="lifo"` reuses the most recently freed page first (cache-warm); `"first_fit"`
    always returns the lowest free ids, ascending. Cached pages are taken only when no free
    page is left, least recently used first. The last `reserve` free or cached pages go only
    to critical allocations. Allocating, sharing or freeing a batch costs O(batch), whatever
    the pool size. `thread_safe=False` drops the lock, for an owner that calls from one thread.
    """

    __slots__ = ("_num_pages", "_policy", "_reserve", "_free", "_cached", "_is_cached",
                 "_refcounts", "_lock", "_num_allocated", "_num_failed",
                 "_num_evicted", "_fewest_unused", "on_evict")

    def __init__(self, num_pages: int, *, policy: str = "lifo", reserve: int = 0,
                 thread_safe: bool = True) -> None:
        self._num_pages = check_int("num_pages", num_pages, 1, MAX_PAGES)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._policy = policy
        self._reserve = check_int("reserve", reserve, 0, num_pages)
        self._free: list[int] | FirstFitFreeList
        if policy == "first_fit":
            self._free = FirstFitFreeList(num_pages)
        else:
            # A stack whose top is the end of the list: stored descending, so that a fresh
            # allocator hands out 0, 1, 2, ... first.
            self._free = list(range(num_pages - 1, -1, -1))
        self._cached = _CachedQueue(num_pages)
        self._is_cached = bytearray(num_pages)  # 1: the prefix cache indexes the page
        self._refcounts = [0] * num_pages
        self._lock = Lock() if thread_safe else nullcontext()
        self._num_allocated = 0
        self._num_failed = 0
        self._num_evicted = 0
        self._fewest_unused = num_pages  # low-water mark of free + cached: num_pages - peak
        self.on_evict: Callable[[list[int]], None] | None = None

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list (count 0, not cached), reserved ones included."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages with count 0 whose content the prefix cache keeps (evictable)."""
        return self._cached.size

    @property
    def num_used(self) -> int:
        """Pages with a reference count above 0."""
        return self._num_pages - len(self._free) - self._cached.size

    @property
    def reserve(self) -> int:
        """Free or cached pages only a critical allocation may take."""
        return self._reserve

    @property
    def refcounts(self) -> list[int]:
        """Reference counts indexed by page id: the live list itself, for fast reads by the
        layers above. Read it, never write it."""
        return self._refcounts

    @property
    def policy(self) -> str:
        """Which free pages are handed out first: "lifo" or "first_fit"."""
        return self._policy

    def can_allocate(self, n: int, *, critical: bool = False) -> bool:
        """Whether `allocate(n, critical=critical)` would succeed now."""
        n = check_int("page count", n, 0)
        return n <= len(self._free) + self._cached.size - (0 if critical else self._reserve)

    def allocate(self, n: int, *, critical: bool = False) -> list[int]:
        """Take `n` pages, each with reference count 1, and return their ids: free pages
        first, then cached ones, least recently used first (given to `on_evict` first).

        Raises OutOfPages, changing nothing, when fewer than `n` pages are free or cached;
        only a critical allocation may use the last `reserve` of them.
        """
        if type(n) is not int or n <= 0:
            n = check_int("page count", n, 0)
            if n == 0:
                return []
        free = self._free
        with self._lock:
            left = len(free) + self._cached.size - n
            if left < self._reserve and (left < 0 or not critical):
                self._num_failed += 1
                raise OutOfPages(self._shortage(n, critical))
            fresh = n if n <= len(free) else len(free)
            if isinstance(free, FirstFitFreeList):
                ids = free.take(fresh)
            else:
                ids = free[len(free) - fresh:]
                del free[len(free) - fresh:]
                ids.reverse()  # top of the stack first
            if fresh < n:
                ids += self._evict(n - fresh)
            refcounts = self._refcounts
            for page in ids:
                refcounts[page] = 1
            self._num_allocated += n
            if left < self._fewest_unused:
                self._fewest_unused = left
        return ids

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two). A cached page
        leaves the queue: it is held again (a prefix hit).

        Every page must be held or cached; otherwise raises InvalidPage (TypeError for an id
        that is not an int), changing nothing.
        """
        pages = list(pages)
        refcounts, is_cached, num_pages = self._refcounts, self._is_cached, self._num_pages
        with self._lock:
            revived = []
            for page in pages:
                if type(page) is not int or not 0 <= page < num_pages:
                    raise self._bad_id(page)
                if not refcounts[page]:
                    if not is_cached[page]:
                        raise InvalidPage(f"cannot share page {page}: it is free")
                    revived.append(page)
            if revived:
                self._cached.remove(dict.fromkeys(revived))
            for page in pages:
                refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page (a page listed twice loses two). A page left with
        none goes to the cached queue if the prefix cache indexes it (later pages of the
        batch colder, as a page table's tail is worth least), else to the free list.
        Returns the ids that went to the free list, in the order they reached 0.

        Raises InvalidPage for an id out of range or dropped below 0, TypeError for an id that
        is not an int; either way nothing changes.
        """
        pages = list(pages)
        refcounts, is_cached, num_pages = self._refcounts, self._is_cached, self._num_pages
        with self._lock:
            for page in pages:
                if type(page) is not int or not 0 <= page < num_pages or not refcounts[page]:
                    raise self._not_held(page)
            if len(set(pages)) < len(pages):
                self._check_repeats(pages)
            released, cached = [], []
            for page in pages:
                count = refcounts[page] - 1
                refcounts[page] = count
                if not count:
                    (cached if is_cached[page] else released).append(page)
            if cached:
                cached.reverse()
                self._cached.push_warm(cached)
            self._free.extend(released)
        return released

    def mark_cached(self, pages: Iterable[int]) -> None:
        """The prefix cache now indexes these held pages: when their counts reach 0 they
        wait on the cached queue instead of the free list. Raises InvalidPage, changing
        nothing, for a page nobody holds."""
        pages = list(pages)
        with self._lock:
            for page in pages:
                self._check_id(page)
                if not self._refcounts[page]:
                    raise InvalidPage(f"cannot cache page {page}: nobody holds it")
            for page in pages:
                self._is_cached[page] = 1

    def evict(self, n: int) -> list[int]:
        """Move the `n` least recently used cached pages (or all, if fewer) to the free list,
        telling `on_evict` first; returns their ids."""
        n = check_int("page count", n, 0)
        with self._lock:
            pages = self._evict(min(n, self._cached.size))
            self._free.extend(pages)
        return pages

    def cached_pages(self) -> list[int]:
        """The cached pages, least recently used first."""
        with self._lock:
            return list(self._cached)

    def refcount(self, page: int) -> int:
        """How many holders page `page` has; 0 means it is free or cached."""
        self._check_id(page)
        return self._refcounts[page]

    def is_cached(self, page: int) -> bool:
        """Whether the prefix cache indexes page `page` (held or not)."""
        self._check_id(page)
        return bool(self._is_cached[page])

    def stats(self) -> AllocatorStats:
        """The counters as of now; `num_freed` counts pages whose holders all let go."""
        with self._lock:
            unused = len(self._free) + self._cached.size
            num_used = self._num_pages - unused
            # Pages become used only by allocate and unused only by free, so the cumulative
            # counts differ by exactly the pages in use.
            return AllocatorStats(
                num_pages=self._num_pages, num_free=len(self._free), num_used=num_used,
                peak_used=self._num_pages - self._fewest_unused,
                num_allocated=self._num_allocated, num_freed=self._num_allocated - num_used,
                num_failed=self._num_failed, num_cached=self._cached.size,
                num_evicted=self._num_evicted)

    def fragmentation(self) -> float:
        """Fraction of free pages outside the longest run of consecutive free ids, 0.0 to 1.0.

        0.0 when the free pages form one contiguous block (or none is free). Any free page
        serves any sequence, so this measures locality, not lost capacity. O(num_pages).
        """
        with self._lock:
            if not self._free:
                return 0.0
            is_free = bytearray(self._num_pages)  # one byte per page, 1 if free
            for page in self._free:
                is_free[page] = 1
            num_free = len(self._free)
        longest = max(map(len, bytes(is_free).split(b"\x00")))
        return 1.0 - longest / num_free

    def check(self) -> None:
        """Verify the conservation law and the counters; raise AssertionError naming each
        broken invariant. O(num_pages): meant for tests and debugging."""
        with self._lock:
            problems = self._problems()
        if problems:
            raise AssertionError("PageAllocator invariants broken: " + "; ".join(problems))

    def _evict(self, n: int) -> list[int]:
        """Take the `n` least recently used cached pages off the queue and the index."""
        pages = self._cached.pop_cold(n)
        for page in pages:
            self._is_cached[page] = 0
        self._num_evicted += n
        if pages and self.on_evict is not None:
            self.on_evict(pages)
        return pages

    def _check_id(self, page: object) -> None:
        if type(page) is not int or not 0 <= page < self._num_pages:
            raise self._bad_id(page)

    def _bad_id(self, page: object) -> Exception:
        """The error for something that is not a page id."""
        if type(page) is not int:
            return TypeError(f"page ids must be int, got {type(page).__name__} {page!r}")
        return InvalidPage(f"page {page} is out of range [0, {self._num_pages})")

    def _not_held(self, page: object) -> Exception:
        """The error for freeing `page`, which is not a held page id."""
        if type(page) is not int or not 0 <= page < self._num_pages:
            return self._bad_id(page)
        return InvalidPage(f"cannot free page {page}: it is not allocated")

    def _check_repeats(self, pages: list[int]) -> None:
        """Raise unless every page listed more than once is held that often."""
        for page, times in Counter(pages).items():
            if times > self._refcounts[page]:
                raise InvalidPage(f"cannot free page {page} {times} times: "
                                  f"its reference count is {self._refcounts[page]}")

    def _problems(self) -> list[str]:
        """Every broken invariant, described (empty when all hold)."""
        refcounts = self._refcounts
        free, cached = list(self._free), list(self._cached)
        problems = self._free.problems() if isinstance(self._free, FirstFitFreeList) else []
        problems += self._cached.problems()
        unused = free + cached
        if len(set(unused)) != len(unused):
            twice = sorted(p for p, times in Counter(unused).items() if times > 1)
            problems.append(f"pages on the free list or cached queue twice: {twice[:5]}")
        held = [p for p in unused if refcounts[p]]
        if held:
            problems.append(f"free or cached pages with references: {held[:5]}")
        wrong_free = [p for p in free if self._is_cached[p]]
        wrong_cached = [p for p in cached if not self._is_cached[p]]
        if wrong_free or wrong_cached:
            problems.append(f"cached pages on the free list {wrong_free[:5]} or uncached ones "
                            f"on the cached queue {wrong_cached[:5]}")
        if min(refcounts) < 0:
            negative = [p for p, count in enumerate(refcounts) if count < 0]
            problems.append(f"pages with negative reference counts: {negative[:5]}")
        num_unheld = refcounts.count(0)
        if num_unheld != len(unused):
            problems.append(f"{num_unheld} pages have no references but {len(free)} are free "
                            f"and {len(cached)} cached")
        num_used, peak_used = self._num_pages - len(unused), self._num_pages - self._fewest_unused
        if not num_used <= peak_used <= min(self._num_pages, self._num_allocated):
            problems.append(
                f"peak_used {peak_used} not between num_used {num_used} and "
                f"min(num_pages, num_allocated) {min(self._num_pages, self._num_allocated)}")
        return problems

    def _shortage(self, n: int, critical: bool) -> str:
        """The OutOfPages message for a request of `n` pages."""
        usable = ", usable by this critical allocation" if critical else ""
        cached = f" and {self._cached.size} cached" if self._cached.size else ""
        return (f"need {n} pages, {len(self._free)} free{cached} "
                f"({self._reserve} reserved{usable})")
