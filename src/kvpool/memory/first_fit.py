"""The free list of the allocator's "first_fit" policy: free page ids handed out lowest first."""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator
from heapq import heappop, heappush
from itertools import chain

# first_fit keeps free ids in buckets of 2**_BUCKET_SHIFT consecutive ids: small enough that
# inserting into a bucket is a short memmove, large enough that buckets rarely empty.
_BUCKET_SHIFT = 6
_BUCKET_SIZE = 1 << _BUCKET_SHIFT


class FirstFitFreeList:
    """Free page ids handed out lowest first, in ascending buckets of `_BUCKET_SIZE`
    consecutive ids, and a heap of the non-empty buckets' numbers: O(1) per id, plus
    O(log num_pages) per bucket that empties or refills."""

    __slots__ = ("_buckets", "_nonempty", "_size")

    def __init__(self, num_pages: int) -> None:
        self._buckets = [
            list(range(start, min(start + _BUCKET_SIZE, num_pages)))
            for start in range(0, num_pages, _BUCKET_SIZE)
        ]
        self._nonempty = list(range(len(self._buckets)))  # ascending, so already a heap
        self._size = num_pages

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._buckets)

    def take(self, n: int) -> list[int]:
        """Remove and return the `n` lowest free ids, ascending; needs `n <= len(self)`."""
        buckets, nonempty = self._buckets, self._nonempty
        ids: list[int] = []
        while len(ids) < n:
            bucket = buckets[nonempty[0]]
            want = n - len(ids)
            ids += bucket[:want]
            del bucket[:want]
            if not bucket:
                heappop(nonempty)
        self._size -= n
        return ids

    def extend(self, pages: list[int]) -> None:
        """Add free ids (distinct, and not already free), like list.extend on the lifo stack."""
        buckets, nonempty = self._buckets, self._nonempty
        for page in pages:
            bucket = buckets[page >> _BUCKET_SHIFT]
            if not bucket:
                heappush(nonempty, page >> _BUCKET_SHIFT)
            insort(bucket, page)
        self._size += len(pages)

    def problems(self) -> list[str]:
        """Every broken invariant of the buckets and the heap, described."""
        problems = []
        for number, bucket in enumerate(self._buckets):
            if bucket != sorted(set(bucket)):
                problems.append(f"bucket {number} is not ascending and distinct")
            if any(page >> _BUCKET_SHIFT != number for page in bucket):
                problems.append(f"bucket {number} holds ids of another bucket")
        heap = self._nonempty
        if sorted(heap) != [number for number, bucket in enumerate(self._buckets) if bucket]:
            problems.append("the bucket heap does not list exactly the non-empty buckets")
        if any(heap[(i - 1) // 2] > heap[i] for i in range(1, len(heap))):
            problems.append("the bucket heap is not a heap")
        if self._size != sum(map(len, self._buckets)):
            problems.append(f"size {self._size} does not match the buckets")
        return problems
