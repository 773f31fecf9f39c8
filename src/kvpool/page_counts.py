"""The allocator's per-page state and the loops over it: a reference count per page, a mark
for the pages the prefix cache indexes, and the queue of cached pages no sequence holds.

The queue keeps cached pages in least-recently-used order: a doubly linked list threaded
through two int32 arrays indexed by page id (4 bytes a page each, no object per entry), whose
sentinel is the index past the last page. Lists would make the Python loops about twice as
fast, but cost 0.8 MiB more per 100,000 pages.

`hold`, `share`, `release` and `pop_cold` are written twice: here in Python, the readable reference,
and in `_pages.c`, the same loops compiled, built with the package when a C compiler is
there. The compiled loops take the same containers, and where the reference would raise they
change nothing and return None, so that the reference runs and raises the error naming the
page. Without the compiled module every call runs the reference.
"""

from __future__ import annotations

from array import array
from collections import Counter

from kvpool.errors import InvalidPage

try:
    from kvpool import _pages as compiled
except ImportError:  # built without a C compiler
    compiled = None


class PageCounts:
    """Reference counts, cached marks and the cached queue of `num_pages` pages. Callers
    check capacity; `share` and `release` check the ids and change nothing when one is bad."""

    __slots__ = ("refcounts", "is_cached", "next", "prev", "num_cached", "num_marked")

    def __init__(self, num_pages: int) -> None:
        self.refcounts = [0] * num_pages  # holders of each page
        self.is_cached = bytearray(num_pages)  # 1: the prefix cache indexes the page
        self.next = array("i", [num_pages]) * (num_pages + 1)  # sentinel's: the coldest
        self.prev = array("i", [num_pages]) * (num_pages + 1)  # sentinel's: the warmest
        self.num_cached = 0  # pages on the queue
        self.num_marked = 0  # pages marked cached, held or queued

    def hold(self, pages: list[int]) -> None:
        """Give each page, free until now, its first reference."""
        if compiled is None or compiled.hold(self.refcounts, pages) is None:
            self._hold(pages)

    def share(self, pages: list[int]) -> None:
        """Add one reference to each page (a page listed twice gains two); a cached page
        leaves the queue. Raises InvalidPage (TypeError for an id that is not an int),
        changing nothing, unless every page is held or cached."""
        revived = None if compiled is None else compiled.share(
            self.refcounts, self.is_cached, self.next, self.prev, pages)
        if revived is None:
            revived = self._share(pages)
        self.num_cached -= revived

    def release(self, pages: list[int], free: list[int]) -> list[int]:
        """Drop one reference to each page (a page listed twice loses two). A page left with
        none joins the queue's warm end if cached (the first to reach 0 warmest, as a page
        table's tail is worth least), else the `free` list; returns the latter, in the
        order they reached 0. Raises InvalidPage for an id out of range or dropped below 0,
        TypeError for an id that is not an int; either way nothing changes."""
        done = None if compiled is None else compiled.release(
            self.refcounts, self.is_cached, self.next, self.prev, pages)
        released, queued = self._release(pages) if done is None else done
        free.extend(released)
        self.num_cached += queued
        return released

    def mark(self, pages: list[int]) -> None:
        """Mark held pages cached (a page marked already stays so)."""
        is_cached = self.is_cached
        for page in pages:
            if not is_cached[page]:
                is_cached[page] = 1
                self.num_marked += 1

    def pop_cold(self, n: int) -> list[int]:
        """Take the `n` coldest pages (`n <= num_cached`) off the queue and unmark them;
        returns them coldest first."""
        if compiled is None:
            pages = self._pop_cold(n)
        else:
            pages = compiled.pop_cold(self.refcounts, self.is_cached, self.next, self.prev, n)
        self.num_cached -= n
        self.num_marked -= n
        return pages

    def queued(self) -> list[int]:
        """The queued pages, coldest first."""
        nxt, page = self.next, self.next[-1]
        pages = []
        for _ in range(self.num_cached):
            pages.append(page)
            page = nxt[page]
        return pages

    def problems(self) -> list[str]:
        """Broken queue links or a wrong count, described: the list must run from the
        sentinel through `num_cached` pages back to the sentinel, each page's `prev` naming
        the one before, and `num_marked` pages must be marked cached."""
        nxt, prv = self.next, self.prev
        sentinel = len(nxt) - 1
        page, before = nxt[sentinel], sentinel
        for _ in range(self.num_cached):
            if page == sentinel or prv[page] != before:
                return [f"the cached queue's links break at page {page}"]
            page, before = nxt[page], page
        if page != sentinel or prv[sentinel] != before:
            return [f"the cached queue holds more than its {self.num_cached} pages"]
        if self.is_cached.count(1) != self.num_marked:
            return [f"{self.is_cached.count(1)} pages are marked cached, "
                    f"num_marked={self.num_marked}"]
        return []

    # ---- the reference loops -----------------------------------------------------------

    def _hold(self, pages: list[int]) -> None:
        """`hold` in Python."""
        refcounts = self.refcounts
        for page in pages:
            refcounts[page] = 1

    def _share(self, pages: list[int]) -> int:
        """`share` in Python; returns how many pages left the queue."""
        refcounts, is_cached, num_pages = self.refcounts, self.is_cached, len(self.refcounts)
        for page in pages:
            if type(page) is not int or not 0 <= page < num_pages:
                self.check_id(page)  # raises the error naming it
            if not refcounts[page] and not is_cached[page]:
                raise InvalidPage(f"cannot share page {page}: it is free")
        nxt, prv = self.next, self.prev
        revived = 0
        for page in pages:
            if not refcounts[page]:  # cached: held again, off the queue
                before, after = prv[page], nxt[page]
                nxt[before] = after
                prv[after] = before
                revived += 1
            refcounts[page] += 1
        return revived

    def _release(self, pages: list[int]) -> tuple[list[int], int]:
        """`release` in Python; returns the released pages and how many joined the queue."""
        refcounts, is_cached, num_pages = self.refcounts, self.is_cached, len(self.refcounts)
        for page in pages:
            if type(page) is not int or not 0 <= page < num_pages or not refcounts[page]:
                self.check_id(page)  # raises the error naming it, if it is not a page id
                raise InvalidPage(f"cannot free page {page}: it is not allocated")
        if len(set(pages)) < len(pages):
            for page, times in Counter(pages).items():
                if times > refcounts[page]:
                    raise InvalidPage(f"cannot free page {page} {times} times: "
                                      f"its reference count is {refcounts[page]}")
        released, queued = [], []
        for page in pages:
            count = refcounts[page] - 1
            refcounts[page] = count
            if not count:
                (queued if is_cached[page] else released).append(page)
        queued.reverse()  # the first to reach 0 goes in last: the warmest
        self._push_warm(queued)
        return released, len(queued)

    def _pop_cold(self, n: int) -> list[int]:
        """`pop_cold` in Python."""
        nxt, prv = self.next, self.prev
        sentinel = len(nxt) - 1
        pages = []
        page = nxt[sentinel]
        for _ in range(n):
            pages.append(page)
            self.is_cached[page] = 0
            page = nxt[page]
        nxt[sentinel] = page
        prv[page] = sentinel
        return pages

    def _push_warm(self, pages: list[int]) -> None:
        """Add pages (not queued) at the warm end, in order: the last is the warmest."""
        nxt, prv = self.next, self.prev
        sentinel = len(nxt) - 1
        for page in pages:
            last = prv[sentinel]
            nxt[last] = page
            prv[page] = last
            nxt[page] = sentinel
            prv[sentinel] = page

    def check_id(self, page: object) -> None:
        """Raise TypeError unless `page` is an int, InvalidPage unless it is in range."""
        if type(page) is not int:
            raise TypeError(f"page ids must be int, got {type(page).__name__} {page!r}")
        if not 0 <= page < len(self.refcounts):
            raise InvalidPage(f"page {page} is out of range [0, {len(self.refcounts)})")
