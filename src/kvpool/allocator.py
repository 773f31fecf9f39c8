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

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from threading import Lock

from kvpool.errors import MAX_PAGES, InvalidPage, OutOfPages, check_int
from kvpool.first_fit import FirstFitFreeList
from kvpool.page_counts import PageCounts

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
    always returns the lowest free ids, ascending. Cached pages are taken only when no free
    page is left, least recently used first. The last `reserve` free or cached pages go only
    to critical allocations. Allocating, sharing or freeing a batch costs O(batch), whatever
    the pool size. `thread_safe=False` drops the lock, for an owner that calls from one thread.
    """

    __slots__ = ("_num_pages", "_policy", "_reserve", "_free", "_counts", "_refcounts",
                 "_lock", "_num_allocated", "_num_failed", "_num_evicted", "_fewest_unused",
                 "on_evict")

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
        self._counts = PageCounts(num_pages)
        self._refcounts = self._counts.refcounts
        # Without a lock the hot calls (allocate, share, free) skip the `with` statement, which
        # costs about 2,000 instructions, a tenth of allocate(16) + free(16).
        self._lock = Lock() if thread_safe else None
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
        return self._counts.num_cached

    @property
    def num_used(self) -> int:
        """Pages with a reference count above 0."""
        return self._num_pages - len(self._free) - self._counts.num_cached

    @property
    def num_available(self) -> int:
        """Free and cached pages an allocation that is not critical may take (the reserve
        left out): an allocation of up to this many succeeds."""
        return len(self._free) + self._counts.num_cached - self._reserve

    @property
    def num_marked(self) -> int:
        """Pages the prefix cache indexes, held or cached (those marked by `mark_cached` and
        not evicted since)."""
        return self._counts.num_marked

    @property
    def cached_marks(self) -> bytearray:
        """One byte per page, 1 where the prefix cache indexes the page: the live bytearray
        itself, for fast reads by the prefix cache. Read it, never write it; eviction clears
        a page's byte."""
        return self._counts.is_cached

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
        return n <= len(self._free) + self._counts.num_cached - (0 if critical else self._reserve)

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
        if self._lock is None:
            return self._allocate(n, critical)
        with self._lock:
            return self._allocate(n, critical)

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two). A cached page
        leaves the queue: it is held again (a prefix hit).

        Every page must be held or cached; otherwise raises InvalidPage (TypeError for an id
        that is not an int), changing nothing.
        """
        pages = pages if type(pages) is list else list(pages)
        if self._lock is None:
            self._counts.share(pages)
            return
        with self._lock:
            self._counts.share(pages)

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page (a page listed twice loses two). A page left with
        none goes to the cached queue if the prefix cache indexes it (later pages of the
        batch colder, as a page table's tail is worth least), else to the free list.
        Returns the ids that went to the free list, in the order they reached 0.

        Raises InvalidPage for an id out of range or dropped below 0, TypeError for an id that
        is not an int; either way nothing changes.
        """
        pages = pages if type(pages) is list else list(pages)
        if self._lock is None:
            return self._counts.release(pages, self._free)
        with self._lock:
            return self._counts.release(pages, self._free)

    def mark_cached(self, pages: Iterable[int]) -> None:
        """The prefix cache now indexes these held pages: when their counts reach 0 they
        wait on the cached queue instead of the free list. Raises InvalidPage, changing
        nothing, for a page nobody holds."""
        pages = pages if type(pages) is list else list(pages)
        with self._lock or nullcontext():
            refcounts, num_pages = self._refcounts, self._num_pages
            for page in pages:
                if type(page) is not int or not 0 <= page < num_pages or not refcounts[page]:
                    self._counts.check_id(page)  # raises the error naming a bad id
                    raise InvalidPage(f"cannot cache page {page}: nobody holds it")
            self._counts.mark(pages)

    def evict(self, n: int) -> list[int]:
        """Move the `n` least recently used cached pages (or all, if fewer) to the free list,
        telling `on_evict` first; returns their ids."""
        n = check_int("page count", n, 0)
        with self._lock or nullcontext():
            pages = self._evict(min(n, self._counts.num_cached))
            self._free.extend(pages)
        return pages

    def cached_pages(self) -> list[int]:
        """The cached pages, least recently used first."""
        with self._lock or nullcontext():
            return self._counts.queued()

    def refcount(self, page: int) -> int:
        """How many holders page `page` has; 0 means it is free or cached."""
        self._counts.check_id(page)
        return self._refcounts[page]

    def is_cached(self, page: int) -> bool:
        """Whether the prefix cache indexes page `page` (held or not)."""
        self._counts.check_id(page)
        return bool(self._counts.is_cached[page])

    def stats(self) -> AllocatorStats:
        """The counters as of now; `num_freed` counts pages whose holders all let go."""
        with self._lock or nullcontext():
            unused = len(self._free) + self._counts.num_cached
            num_used = self._num_pages - unused
            # Pages become used only by allocate and unused only by free, so the cumulative
            # counts differ by exactly the pages in use.
            return AllocatorStats(
                num_pages=self._num_pages, num_free=len(self._free), num_used=num_used,
                peak_used=self._num_pages - self._fewest_unused,
                num_allocated=self._num_allocated, num_freed=self._num_allocated - num_used,
                num_failed=self._num_failed, num_cached=self._counts.num_cached,
                num_evicted=self._num_evicted)

    def fragmentation(self) -> float:
        """Fraction of free pages outside the longest run of consecutive free ids, 0.0 to 1.0.

        0.0 when the free pages form one contiguous block (or none is free). Any free page
        serves any sequence, so this measures locality, not lost capacity. O(num_pages).
        """
        with self._lock or nullcontext():
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
        with self._lock or nullcontext():
            problems = self._problems()
        if problems:
            raise AssertionError("PageAllocator invariants broken: " + "; ".join(problems))

    def _allocate(self, n: int, critical: bool) -> list[int]:
        """`allocate` of `n` > 0 pages, the lock held."""
        free = self._free
        left = len(free) + self._counts.num_cached - n
        if left < self._reserve and (left < 0 or not critical):
            self._num_failed += 1
            raise OutOfPages(self._shortage(n, critical))
        fresh = n if n <= len(free) else len(free)
        if not fresh:
            ids = []
        elif isinstance(free, FirstFitFreeList):
            ids = free.take(fresh)
        else:
            ids = free[len(free) - fresh:]
            del free[len(free) - fresh:]
            ids.reverse()  # top of the stack first
        if fresh < n:
            ids += self._evict(n - fresh)
        self._counts.hold(ids)
        self._num_allocated += n
        if left < self._fewest_unused:
            self._fewest_unused = left
        return ids

    def _evict(self, n: int) -> list[int]:
        """Take the `n` least recently used cached pages off the queue and the index."""
        pages = self._counts.pop_cold(n)
        self._num_evicted += n
        if pages and self.on_evict is not None:
            self.on_evict(pages)
        return pages

    def _problems(self) -> list[str]:
        """Every broken invariant, described (empty when all hold)."""
        refcounts = self._refcounts
        free, cached = list(self._free), self._counts.queued()
        problems = self._free.problems() if isinstance(self._free, FirstFitFreeList) else []
        problems += self._counts.problems()
        unused = free + cached
        if len(set(unused)) != len(unused):
            twice = sorted(p for p, times in Counter(unused).items() if times > 1)
            problems.append(f"pages on the free list or cached queue twice: {twice[:5]}")
        held = [p for p in unused if refcounts[p]]
        if held:
            problems.append(f"free or cached pages with references: {held[:5]}")
        is_cached = self._counts.is_cached
        wrong_free = [p for p in free if is_cached[p]]
        wrong_cached = [p for p in cached if not is_cached[p]]
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
        cached = f" and {self._counts.num_cached} cached" if self._counts.num_cached else ""
        return (f"need {n} pages, {len(self._free)} free{cached} "
                f"({self._reserve} reserved{usable})")
