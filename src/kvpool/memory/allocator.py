"""Page ids and their reference counts: which pages of the pool are free, cached, or held.

A page's reference count is its number of holders (the sequences whose page tables list it). A
page with count 0 is free (its content is worthless) or cached (the prefix cache indexes its
content). Cached pages wait on a queue in least-recently-used order, which allocations take from
at the cold end once the free pages run out: eviction costs what allocation costs, a step per
page, never a pass of its own. The allocator tells the prefix index at once (`on_evict`),
before it hands the pages out, so that the index drops them while their content is still
there. The queue is a doubly linked list threaded through two lists indexed by page id, its
sentinel the index past the last page; the marks of the prefix cache's pages are a list too
(a list's item is read and written by specialized opcodes, an array's or bytearray's not).

Every call checks before it acts: a call that raises has changed nothing. The owner of the
page tables, which knows its pages valid, takes and gives back references through `hold`
and `drop`, which skip the checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Lock

from kvpool.errors import MAX_PAGES, InvalidPage, OutOfPages, check_int
from kvpool.memory.first_fit import FirstFitFreeList

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


class PageAllocator:
    """Hands out page ids in `[0, num_pages)` and keeps a reference count per page.
    `policy="lifo"` reuses the most recently freed page first (cache-warm); `"first_fit"`
    always returns the lowest free ids, ascending. The last `reserve` free or cached pages go
    only to critical allocations. Allocating, sharing or freeing a batch costs O(batch),
    whatever the pool size (first_fit adds O(log num_pages) for each bucket of 64 ids that
    empties or refills). `thread_safe=False` drops the lock, for an owner that calls from
    one thread."""

    __slots__ = ("_num_pages", "_policy", "_reserve", "_free", "_refcounts", "_is_cached",
                 "_next", "_prev", "_num_cached", "_lock", "_num_allocated",
                 "_num_failed", "_num_evicted", "_num_revived", "_fewest_unused", "on_evict")

    def __init__(self, num_pages: int, *, policy: str = "lifo", reserve: int = 0,
                 thread_safe: bool = True) -> None:
        self._num_pages = check_int("num_pages", num_pages, 1, MAX_PAGES)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._policy = policy
        self._reserve = check_int("reserve", reserve, 0, num_pages)
        # lifo's free list is a stack whose top is the end of the list: stored descending, so
        # that a fresh allocator hands out 0, 1, 2, ... first.
        self._free = (FirstFitFreeList(num_pages) if policy == "first_fit"
                      else list(range(num_pages - 1, -1, -1)))
        self._refcounts = [0] * num_pages  # holders of each page
        self._is_cached = [False] * num_pages  # True: the prefix cache indexes the page
        self._next = [num_pages] * (num_pages + 1)  # the sentinel's: the coldest
        self._prev = [num_pages] * (num_pages + 1)  # the sentinel's: the warmest
        self._num_cached = 0  # pages on the queue
        # Without a lock the hot calls (allocate, share, free) skip the `with` statement, which
        # costs about 2,000 instructions, a tenth of allocate(16) + free(16).
        self._lock = Lock() if thread_safe else None
        self._num_allocated = 0
        self._num_failed = 0
        self._num_evicted = 0
        self._num_revived = 0  # cached pages held again (by a prefix hit): used again
        self._fewest_unused = num_pages  # low-water mark of free + cached: num_pages - peak
        # The prefix index's: called with the evicted pages, coldest first, once they have
        # left the queue and lost their marks, before anyone can write them. It runs under
        # the lock, so it must not call the allocator (a thread-safe one would wait forever);
        # if it raises, the evicted pages go to the free list and the allocation fails.
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
        return self._num_cached

    @property
    def num_used(self) -> int:
        """Pages with a reference count above 0."""
        return self._num_pages - len(self._free) - self._num_cached

    @property
    def num_available(self) -> int:
        """The most pages an allocation that is not critical may take: free + cached - reserve
        (below 0 once critical allocations took part of the reserve: the pages short)."""
        return len(self._free) + self._num_cached - self._reserve

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
        return n == 0 or n <= len(self._free) + self._num_cached - (0 if critical else
                                                                      self._reserve)

    def allocate(self, n: int, *, critical: bool = False) -> list[int]:
        """Take `n` pages, each with reference count 1, and return their ids: free pages
        first, then cached ones, least recently used first (given to `on_evict` first).
        Raises OutOfPages, changing nothing, when fewer than `n` pages are free or cached;
        only a critical allocation may use the last `reserve` of them."""
        if type(n) is not int or n <= 0:
            n = check_int("page count", n, 0)
            if n == 0:
                return []
        if self._lock is None:
            return self._allocate(n, critical)
        with self._lock:
            return self._allocate(n, critical)

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two). A cached page
        leaves the queue: it is held again (a prefix hit). Every page must be held or cached;
        otherwise raises InvalidPage (TypeError for an id that is not an int), changing
        nothing."""
        pages = pages if type(pages) is list else list(pages)
        with self._lock or nullcontext():
            refcounts, is_cached, num_pages = self._refcounts, self._is_cached, self._num_pages
            for page in pages:
                if type(page) is not int or not 0 <= page < num_pages:
                    self._check_id(page)
                if not refcounts[page] and not is_cached[page]:
                    raise InvalidPage(f"cannot share page {page}: it is free")
            self.hold(pages)

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page (a page listed twice loses two). A page left with
        none goes to the cached queue if the prefix cache indexes it (later pages of the
        batch colder, as a page table's tail is worth least), else to the free list.
        Returns the ids that went to the free list, in the order they reached 0. Raises
        InvalidPage for an id out of range or dropped below 0, TypeError for an id that is
        not an int; either way nothing changes."""
        pages = pages if type(pages) is list else list(pages)
        with self._lock or nullcontext():
            self._check_held(pages, "free", "it is not allocated")
            refcounts = self._refcounts
            if len(set(pages)) < len(pages):
                for page, times in Counter(pages).items():
                    if times > refcounts[page]:
                        raise InvalidPage(f"cannot free page {page} {times} times: "
                                          f"its reference count is {refcounts[page]}")
            return self.drop(pages)

    def hold(self, pages: list[int]) -> None:
        """`share` for the owner of the page tables, calling from one thread, whose pages are
        known held or cached (a page table's, a prefix match's): the same effect, unchecked."""
        refcounts, nxt = self._refcounts, self._next
        # A match's cached pages mostly lie on the queue in runs, each the next colder than the
        # last (`drop` queues a page table tail first): a run leaves at once, `first` to `last`.
        first = last = -1
        held = 0  # listings of pages held already (the rest come off the queue)
        for page in pages:
            if refcounts[page]:
                refcounts[page] += 1
                held += 1
                continue
            refcounts[page] = 1  # cached: held again, off the queue
            if nxt[page] != last:  # not the page after the run: a run of its own
                if first >= 0:
                    self._unlink(first, last)
                first = page
            last = page
        if first >= 0:
            self._unlink(first, last)
        revived = len(pages) - held
        self._num_cached -= revived
        self._num_revived += revived
        unused = len(self._free) + self._num_cached
        if unused < self._fewest_unused:
            self._fewest_unused = unused

    def drop(self, pages: list[int]) -> list[int]:
        """`free` for the owner of the page tables, calling from one thread, whose pages are
        known held at least as many times as listed (a page table's): the same effect,
        unchecked."""
        refcounts, is_cached, nxt, prv = self._refcounts, self._is_cached, self._next, self._prev
        sentinel = self._num_pages
        # The pages that go to the queue form one chain, linked as they come, back to front:
        # the first one is the warmest (next to the sentinel), the last the coldest, linked to
        # the queue's warmest page at the end. Each link is written once.
        warmest, after = prv[sentinel], sentinel
        released, kept = [], 0  # kept: listings after which the page is still held
        for page in pages:
            if refcounts[page] > 1:
                refcounts[page] -= 1
                kept += 1
                continue
            refcounts[page] = 0
            if is_cached[page]:
                prv[after] = page
                nxt[page] = after
                after = page
            else:
                released.append(page)
        nxt[warmest] = after
        prv[after] = warmest
        self._num_cached += len(pages) - kept - len(released)
        self._free.extend(released)
        return released

    def mark_cached(self, pages: Iterable[int]) -> None:
        """The prefix cache now indexes these held pages: when their counts reach 0 they
        wait on the cached queue instead of the free list (a page marked already stays so).
        Raises InvalidPage, changing nothing, for a page nobody holds."""
        pages = pages if type(pages) is list else list(pages)
        if self._lock is None:  # the prefix index's call on every commit: no `with`
            return self._mark(pages)
        with self._lock:
            return self._mark(pages)

    def _mark(self, pages: list[int]) -> None:
        self._check_held(pages, "cache", "nobody holds it")
        is_cached = self._is_cached
        for page in pages:
            is_cached[page] = True

    def evict(self, n: int) -> list[int]:
        """Move the `n` least recently used cached pages (or all, if fewer) to the free list,
        telling `on_evict` first; returns their ids."""
        n = check_int("page count", n, 0)
        with self._lock or nullcontext():
            pages = self._evict(min(n, self._num_cached))
            self._free.extend(pages)
        return pages

    def cached_pages(self) -> list[int]:
        """The cached pages, least recently used first."""
        with self._lock or nullcontext():
            return self._queued()

    def marked_pages(self) -> list[int]:
        """The pages marked as the prefix cache's (held or cached), ascending. O(num_pages):
        for checks."""
        with self._lock or nullcontext():
            return [page for page, marked in enumerate(self._is_cached) if marked]

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
        with self._lock or nullcontext():
            num_used = self._num_pages - len(self._free) - self._num_cached
            # Pages become used by allocate or by a hit that holds cached ones again, and
            # unused only by free, so the cumulative counts differ by exactly the pages in use.
            return AllocatorStats(
                num_pages=self._num_pages, num_free=len(self._free), num_used=num_used,
                peak_used=self._num_pages - self._fewest_unused,
                num_allocated=self._num_allocated,
                num_freed=self._num_allocated + self._num_revived - num_used,
                num_failed=self._num_failed, num_cached=self._num_cached,
                num_evicted=self._num_evicted)

    def fragmentation(self) -> float:
        """Fraction of free pages outside the longest run of consecutive free ids, 0.0 to 1.0:
        0.0 when the free pages form one contiguous block (or none is free). Any free page
        serves any sequence, so this measures locality, not lost capacity. O(num_pages)."""
        with self._lock or nullcontext():
            if not self._free:
                return 0.0
            is_free = bytearray(self._num_pages)  # one byte per page, 1 if free
            for page in self._free:
                is_free[page] = 1
            return 1.0 - max(map(len, is_free.split(b"\x00"))) / len(self._free)

    def check(self) -> None:
        """Verify the conservation law, the cached queue's links and the counters; raise
        AssertionError naming each broken invariant. O(num_pages): for tests and debugging."""
        with self._lock or nullcontext():
            problems = self._problems()
        if problems:
            raise AssertionError("PageAllocator invariants broken: " + "; ".join(problems))

    def _allocate(self, n: int, critical: bool) -> list[int]:
        """`allocate` of `n` > 0 pages, the lock held."""
        free = self._free
        left = len(free) + self._num_cached - n
        if left < self._reserve and (left < 0 or not critical):
            self._num_failed += 1
            raise OutOfPages(self._shortage(n, critical))
        fresh = n if n <= len(free) else len(free)
        if not fresh:
            ids = []
        elif self._policy == "first_fit":
            ids = free.take(fresh)
        else:
            ids = free[len(free) - fresh:]
            del free[len(free) - fresh:]
            ids.reverse()  # top of the stack first
        if fresh < n:
            try:
                ids += self._evict(n - fresh)
            except BaseException:  # on_evict raised: the fresh pages go back as they were
                free.extend(ids if self._policy == "first_fit" else reversed(ids))
                raise
        refcounts = self._refcounts
        for page in ids:
            refcounts[page] = 1
        self._num_allocated += n
        if left < self._fewest_unused:
            self._fewest_unused = left
        return ids

    def _evict(self, n: int) -> list[int]:
        """Take the `n` (at most `num_cached`) least recently used cached pages off the queue
        and unmark them, telling `on_evict`; returns them coldest first."""
        nxt, marks, sentinel = self._next, self._is_cached, self._num_pages
        pages = []
        page = nxt[sentinel]
        for _ in range(n):
            pages.append(page)
            marks[page] = False
            page = nxt[page]
        nxt[sentinel] = page
        self._prev[page] = sentinel
        self._num_cached -= n
        self._num_evicted += n
        if pages and self.on_evict is not None:
            try:
                self.on_evict(pages)
            except BaseException:  # unmarked and unheld: they are free
                self._free.extend(pages)
                raise
        return pages

    def _queued(self) -> list[int]:
        """The pages on the cached queue, coldest first, following `num_cached` links."""
        nxt, page = self._next, self._next[-1]
        pages = []
        for _ in range(self._num_cached):
            pages.append(page)
            page = nxt[page]
        return pages

    def _unlink(self, first: int, last: int) -> None:
        """Take the queue's pages from `first` to the colder `last` off it."""
        before, after = self._prev[last], self._next[first]
        self._next[before] = after
        self._prev[after] = before

    def _check_held(self, pages: list[int], verb: str, reason: str) -> None:
        """Raise InvalidPage "cannot `verb` page P: `reason`" for the first of `pages` nobody
        holds (TypeError for an id that is not an int)."""
        refcounts, num_pages = self._refcounts, self._num_pages
        for page in pages:
            if type(page) is not int or not 0 <= page < num_pages or not refcounts[page]:
                self._check_id(page)
                raise InvalidPage(f"cannot {verb} page {page}: {reason}")

    def _check_id(self, page: object) -> None:
        """Raise TypeError unless `page` is an int, InvalidPage unless it is in range."""
        if type(page) is not int:
            raise TypeError(f"page ids must be int, got {type(page).__name__} {page!r}")
        if not 0 <= page < self._num_pages:
            raise InvalidPage(f"page {page} is out of range [0, {self._num_pages})")

    def _problems(self) -> list[str]:
        """Every broken invariant, described (empty when all hold)."""
        problems = self._free.problems() if isinstance(self._free, FirstFitFreeList) else []
        broken_links = self._link_problems()
        if broken_links:  # the checks below walk the queue
            return problems + broken_links
        refcounts, is_cached, num_pages = self._refcounts, self._is_cached, self._num_pages
        free, cached = list(self._free), self._queued()
        unused = free + cached
        twice = sorted(p for p, times in Counter(unused).items() if times > 1)
        held = [p for p in unused if refcounts[p]]
        wrong_free = [p for p in free if is_cached[p]]
        wrong_cached = [p for p in cached if not is_cached[p]]
        negative = [p for p, count in enumerate(refcounts) if count < 0]
        num_unheld = refcounts.count(0)
        num_used, peak_used = num_pages - len(unused), num_pages - self._fewest_unused
        most_used = min(num_pages, self._num_allocated)
        checks = [
            (twice, f"pages on the free list or cached queue twice: {twice[:5]}"),
            (held, f"free or cached pages with references: {held[:5]}"),
            (wrong_free or wrong_cached, f"cached pages on the free list {wrong_free[:5]} or "
                                         f"uncached ones on the cached queue {wrong_cached[:5]}"),
            (negative, f"pages with negative reference counts: {negative[:5]}"),
            (num_unheld != len(unused), f"{num_unheld} pages have no references but "
                                        f"{len(free)} are free and {len(cached)} cached"),
            (not num_used <= peak_used <= most_used, f"peak_used {peak_used} not between "
             f"num_used {num_used} and min(num_pages, num_allocated) {most_used}"),
        ]
        return problems + [message for broken, message in checks if broken]

    def _link_problems(self) -> list[str]:
        """The cached queue's broken links, described: it must run from the sentinel through
        `num_cached` pages back to the sentinel, each page's `prev` naming the one before."""
        nxt, prv, sentinel = self._next, self._prev, self._num_pages
        page, before = nxt[sentinel], sentinel
        for _ in range(self._num_cached):
            if page == sentinel or prv[page] != before:
                return [f"the cached queue's links break at page {page}"]
            page, before = nxt[page], page
        if page != sentinel or prv[sentinel] != before:
            return [f"the cached queue holds more than its {self._num_cached} pages"]
        return []

    def _shortage(self, n: int, critical: bool) -> str:
        """The OutOfPages message for a request of `n` pages."""
        usable = ", usable by this critical allocation" if critical else ""
        cached = f" and {self._num_cached} cached" if self._num_cached else ""
        return (f"need {n} pages, {len(self._free)} free{cached} "
                f"({self._reserve} reserved{usable})")
