"""Page ids and their reference counts: which pages of the pool are free, and who holds the rest.

`PageAllocator` hands out page ids in `[0, num_pages)` and keeps one reference count per page.
A page is free exactly when its count is 0, and then it is on the free list. Every call that
can fail checks first or undoes its own work before raising, so a failed call changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from operator import not_
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

    @property
    def utilization(self) -> float:
        """Fraction of pages in use, from 0.0 to 1.0."""
        return self.num_used / self.num_pages


class PageAllocator:
    """Hands out page ids in `[0, num_pages)` and keeps a reference count per page.

    `policy="lifo"` reuses the most recently freed page first (cache-warm); `"first_fit"`
    always returns the lowest free ids, ascending. The last `reserve` free pages go only to
    critical allocations. Allocating or freeing a batch costs O(batch), whatever the pool size.
    """

    __slots__ = (
        "_num_pages",
        "_policy",
        "_reserve",
        "_first_fit",
        "_free",
        "_refcounts",
        "_lock",
        "_num_allocated",
        "_num_failed",
        "_fewest_free",
    )

    def __init__(
        self, num_pages: int, *, policy: str = "lifo", reserve: int = 0, thread_safe: bool = True
    ) -> None:
        self._num_pages = check_int("num_pages", num_pages, 1, MAX_PAGES)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._policy = policy
        self._reserve = check_int("reserve", reserve, 0, num_pages)
        self._first_fit = policy == "first_fit"
        self._free: list[int] | FirstFitFreeList
        if self._first_fit:
            self._free = FirstFitFreeList(num_pages)
        else:
            # A stack whose top is the end of the list: stored descending, so that a fresh
            # allocator hands out 0, 1, 2, ... first.
            self._free = list(range(num_pages - 1, -1, -1))
        self._refcounts = [0] * num_pages
        self._lock = Lock() if thread_safe else nullcontext()
        self._num_allocated = 0
        self._num_failed = 0
        self._fewest_free = num_pages  # low-water mark of the free list: num_pages - peak_used

    @property
    def num_pages(self) -> int:
        """Pages in the pool, free or not."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list (reference count 0), reserved ones included."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with a reference count above 0."""
        return self._num_pages - len(self._free)

    @property
    def reserve(self) -> int:
        """Free pages only a critical allocation may take."""
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
        return n <= len(self._free) - (0 if critical else self._reserve)

    def allocate(self, n: int, *, critical: bool = False) -> list[int]:
        """Take `n` free pages, each with reference count 1, and return their ids.

        Raises OutOfPages, changing nothing, when fewer than `n` pages are free; only a
        critical allocation may use the last `reserve` free pages.
        """
        if type(n) is not int or n <= 0:
            n = check_int("page count", n, 0)
            if n == 0:
                return []
        free = self._free
        refcounts = self._refcounts
        with self._lock:
            left = len(free) - n  # free pages after this allocation
            if left < self._reserve and (left < 0 or not critical):
                self._num_failed += 1
                raise OutOfPages(self._shortage(n, critical))
            if self._first_fit:
                ids = free.take(n)
            else:
                ids = free[-n:]
                del free[-n:]
                ids.reverse()  # top of the stack first
            for page in ids:
                refcounts[page] = 1
            self._num_allocated += n
            if left < self._fewest_free:
                self._fewest_free = left
        return ids

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two).

        Every page must be allocated; otherwise raises InvalidPage (TypeError for an id that is
        not an int), changing nothing.
        """
        if type(pages) is not list:
            pages = list(pages)
        refcounts = self._refcounts
        num_pages = self._num_pages
        with self._lock:
            for page in pages:
                if type(page) is not int or page < 0 or page >= num_pages:
                    raise _bad_page(page, num_pages)
                if not refcounts[page]:
                    raise InvalidPage(f"cannot share page {page}: it is not allocated")
            for page in pages:
                refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page (a page listed twice loses two) and return the ids
        that reached 0 and went back to the free list, in the order they reached 0.

        Raises InvalidPage for an id out of range or dropped below 0, TypeError for an id that
        is not an int; either way nothing changes.
        """
        if type(pages) is not list:
            pages = list(pages)
        refcounts = self._refcounts
        with self._lock:
            # One pass that validates and decrements; a bad batch is undone before raising.
            # (Validating in a pass of its own would cost as much as the decrements.)
            held = False
            try:
                for page in pages:
                    if type(page) is not int or page < 0:
                        raise IndexError  # not a page id: handled like one past the end
                    count = refcounts[page] - 1  # IndexError past the last page
                    refcounts[page] = count
                    if count:
                        held = True  # still shared, or freed more often than it was held
            except IndexError:
                self._undo_free(pages, stop=page)
                raise _bad_page(page, self._num_pages) from None
            released = self._settle_free(pages) if held else pages[:]
            self._free.extend(released)
        return released

    def retain(self, pages: list[int]) -> int:
        """`share` for a caller that owns its page ids (a KVCache's page tables): each page
        allocated and listed once. Validates nothing, so it costs one step per page; a wrong
        id corrupts the counts, which `check()` reports. Returns how many of the pages had
        exactly one reference before."""
        refcounts = self._refcounts
        ones = 0
        with self._lock:
            for page in pages:
                count = refcounts[page]
                refcounts[page] = count + 1
                if count == 1:
                    ones += 1
        return ones

    def release(self, pages: list[int]) -> list[int]:
        """`free` for a caller that owns its page ids and holds a reference on each, listed
        once. Validates nothing (see `retain`). Returns the ids that reached 0 and went back
        to the free list: `pages` itself when all did."""
        refcounts = self._refcounts
        with self._lock:
            held = False
            for page in pages:
                count = refcounts[page] - 1
                refcounts[page] = count
                if count:
                    held = True
            released = [page for page in pages if not refcounts[page]] if held else pages
            self._free.extend(released)
        return released

    def refcount(self, page: int) -> int:
        """How many holders page `page` has; 0 means it is free."""
        if type(page) is not int or page < 0 or page >= self._num_pages:
            raise _bad_page(page, self._num_pages)
        return self._refcounts[page]

    def stats(self) -> AllocatorStats:
        """The counters as of now; `num_freed` counts pages that went back to the free list."""
        with self._lock:
            num_free = len(self._free)
            num_used = self._num_pages - num_free
            # Pages become used only by allocate and free only by free, so the cumulative
            # counts differ by exactly the pages in use.
            return AllocatorStats(
                num_pages=self._num_pages,
                num_free=num_free,
                num_used=num_used,
                peak_used=self._num_pages - self._fewest_free,
                num_allocated=self._num_allocated,
                num_freed=self._num_allocated - num_used,
                num_failed=self._num_failed,
            )

    def fragmentation(self) -> float:
        """Fraction of free pages outside the longest run of consecutive free ids, 0.0 to 1.0.

        0.0 when the free pages form one contiguous block (or none is free). Any free page
        serves any sequence, so this measures locality, not lost capacity. O(num_pages).
        """
        with self._lock:
            num_free = len(self._free)
            if num_free == 0:
                return 0.0
            is_free = bytes(map(not_, self._refcounts))  # one byte per page, 1 if free
        longest = max(map(len, is_free.split(b"\x00")))
        return 1.0 - longest / num_free

    def check(self) -> None:
        """Verify the conservation law and the counters; raise AssertionError naming each
        broken invariant. O(num_pages): meant for tests and debugging."""
        with self._lock:
            problems = self._problems()
        if problems:
            raise AssertionError("PageAllocator invariants broken: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        """Every broken invariant, described (empty when all hold)."""
        num_pages, refcounts = self._num_pages, self._refcounts
        free = list(self._free)
        problems = self._free.problems() if self._first_fit else []
        bad_ids = [p for p in free if type(p) is not int or not 0 <= p < num_pages]
        if bad_ids:
            return [*problems, f"free list holds ids that are not pages: {bad_ids[:5]}"]
        if len(set(free)) != len(free):
            twice = sorted(p for p, times in Counter(free).items() if times > 1)
            problems.append(f"pages on the free list twice: {twice[:5]}")
        held_but_free = [p for p in free if refcounts[p]]
        if held_but_free:
            problems.append(f"pages on the free list with references: {held_but_free[:5]}")
        if min(refcounts) < 0:
            negative = [p for p, count in enumerate(refcounts) if count < 0]
            problems.append(f"pages with negative reference counts: {negative[:5]}")
        num_unheld = refcounts.count(0)
        if num_unheld != len(free):
            problems.append(
                f"{num_unheld} pages have no references but {len(free)} are on the free list"
            )
        num_used, peak_used = num_pages - len(free), num_pages - self._fewest_free
        if not num_used <= peak_used <= min(num_pages, self._num_allocated):
            problems.append(
                f"peak_used {peak_used} not between num_used {num_used} and "
                f"min(num_pages, num_allocated) {min(num_pages, self._num_allocated)}"
            )
        return problems

    def _undo_free(self, pages: list[int], stop: object = None) -> None:
        """Give back the references a failing free() took: those of the ids before the first
        occurrence of `stop` (the bad id it stopped at), or of all `pages` if `stop` is None."""
        refcounts = self._refcounts
        for page in pages:
            # `is`, not ==: the bad id fails at its first occurrence, and 1.0 == 1.
            if page is stop:
                return
            refcounts[page] += 1

    def _settle_free(self, pages: list[int]) -> list[int]:
        """After free() decremented `pages`, some of them still held: return the released
        ones, each once, or undo the batch and raise if a page went below 0."""
        refcounts = self._refcounts
        over = next((page for page in pages if refcounts[page] < 0), None)
        if over is not None:
            self._undo_free(pages)
            times, held = pages.count(over), refcounts[over]
            if held == 0:
                raise InvalidPage(f"cannot free page {over}: it is not allocated")
            raise InvalidPage(
                f"cannot free page {over} {times} times: its reference count is {held}"
            )
        # A page listed twice reaches 0 at its last listing.
        last_first = dict.fromkeys(page for page in reversed(pages) if not refcounts[page])
        return list(reversed(last_first))

    def _shortage(self, n: int, critical: bool) -> str:
        """The OutOfPages message for a request of `n` pages."""
        usable = ", usable by this critical allocation" if critical else ""
        return f"need {n} pages, {len(self._free)} free ({self._reserve} reserved{usable})"


def _bad_page(page: object, num_pages: int) -> Exception:
    """The error for something that is not a page id: TypeError, or InvalidPage if out of range."""
    if type(page) is not int:
        return TypeError(f"page ids must be int, got {type(page).__name__} {page!r}")
    return InvalidPage(f"page {page} is out of range [0, {num_pages})")
