"""PageAllocator, one behaviour per test, with exact page ids."""

import re
from dataclasses import replace

import pytest

from kvpool.errors import InvalidPage, KVPoolError, OutOfPages
from kvpool.memory.allocator import POLICIES, AllocatorStats, PageAllocator


def state(allocator):
    """Everything a failed call must leave as it was: free count, reference counts, stats,
    and the order in which the free pages would be handed out."""
    return (
        allocator.num_free,
        [allocator.refcount(page) for page in range(allocator.num_pages)],
        allocator.stats(),
        list(allocator._free),
    )


# ---- handing out ids ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_fresh_allocator_hands_out_ascending_ids_from_zero(policy):
    allocator = PageAllocator(10, policy=policy)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.allocate(4) == [3, 4, 5, 6]


@pytest.mark.parametrize("policy", POLICIES)
def test_allocated_pages_have_reference_count_one(policy):
    allocator = PageAllocator(4, policy=policy)
    allocator.allocate(2)
    assert [allocator.refcount(page) for page in range(4)] == [1, 1, 0, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_allocate_zero_returns_empty_list_and_changes_nothing(policy):
    allocator = PageAllocator(4, policy=policy)
    before = state(allocator)
    assert allocator.allocate(0) == []
    assert state(allocator) == before


def test_lifo_reuses_most_recently_freed_page_first():
    allocator = PageAllocator(8)
    allocator.allocate(4)
    allocator.free([1])
    allocator.free([3])
    assert allocator.allocate(2) == [3, 1]


def test_lifo_batch_free_makes_its_last_page_the_next_one_handed_out():
    allocator = PageAllocator(8)
    allocator.allocate(4)
    allocator.free([0, 2, 1])
    assert allocator.allocate(3) == [1, 2, 0]


def test_lifo_hands_out_fresh_pages_after_freed_ones():
    allocator = PageAllocator(8)
    allocator.allocate(4)
    allocator.free([2])
    assert allocator.allocate(3) == [2, 4, 5]


def test_first_fit_returns_lowest_free_ids_ascending():
    allocator = PageAllocator(8, policy="first_fit")
    allocator.allocate(6)
    allocator.free([4, 1, 3])
    assert allocator.allocate(2) == [1, 3]
    assert allocator.allocate(2) == [4, 6]


def test_first_fit_takes_lowest_ids_across_a_large_pool():
    allocator = PageAllocator(1000, policy="first_fit")
    allocator.allocate(900)
    allocator.free([899, 5, 640, 64, 63, 300])
    assert allocator.allocate(8) == [5, 63, 64, 300, 640, 899, 900, 901]


@pytest.mark.parametrize("policy", POLICIES)
def test_allocate_can_take_every_page(policy):
    allocator = PageAllocator(130, policy=policy)
    assert allocator.allocate(130) == list(range(130))
    assert allocator.num_free == 0


# ---- capacity and the reserve -------------------------------------------------------------


def test_out_of_pages_message_names_needed_free_and_reserved():
    allocator = PageAllocator(10, reserve=2)
    allocator.allocate(7)
    with pytest.raises(OutOfPages, match=r"^need 12 pages, 3 free \(2 reserved\)$"):
        allocator.allocate(12)


@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_pages_changes_nothing_but_the_failure_count(policy):
    allocator = PageAllocator(10, policy=policy)
    allocator.free(allocator.allocate(6)[2:4])
    free_count, refcounts, stats, free_order = state(allocator)
    with pytest.raises(OutOfPages):
        allocator.allocate(7)
    assert state(allocator) == (free_count, refcounts, replace(stats, num_failed=1), free_order)


def test_out_of_pages_is_a_memory_error_and_a_kvpool_error():
    allocator = PageAllocator(1)
    with pytest.raises(MemoryError):
        allocator.allocate(2)
    with pytest.raises(KVPoolError):
        allocator.allocate(2)


def test_non_critical_allocation_may_not_take_the_reserved_pages():
    allocator = PageAllocator(10, reserve=2)
    allocator.allocate(8)
    assert not allocator.can_allocate(1)
    with pytest.raises(OutOfPages, match=r"need 1 pages, 2 free \(2 reserved\)"):
        allocator.allocate(1)


def test_num_available_counts_free_and_cached_pages_past_the_reserve():
    allocator = PageAllocator(10, reserve=2)
    pages = allocator.allocate(5)
    allocator.mark_cached(pages[:2])
    allocator.free(pages[:3])  # two cached, one free
    assert (allocator.num_free, allocator.num_cached, allocator.num_available) == (6, 2, 6)
    assert allocator.can_allocate(6) and not allocator.can_allocate(7)


def test_marked_pages_lists_the_cached_marks_until_eviction():
    allocator = PageAllocator(10)
    pages = allocator.allocate(4)
    allocator.mark_cached(pages[:3])
    allocator.mark_cached(pages[:1])  # marked already: listed once
    allocator.free(pages[:3])
    assert allocator.marked_pages() == [0, 1, 2]
    assert allocator.evict(2) == [2, 1]
    assert allocator.marked_pages() == [0]
    allocator.check()


def test_marked_held_pages_wait_on_the_queue_once_dropped():
    allocator = PageAllocator(10, thread_safe=False)
    pages = allocator.allocate(4)
    allocator.mark_cached(pages[1:3])
    assert allocator.drop(pages) == [0, 3]
    assert (allocator.marked_pages(), allocator.cached_pages()) == ([1, 2], [2, 1])
    allocator.check()


def test_critical_allocation_may_take_the_reserved_pages():
    allocator = PageAllocator(10, reserve=2)
    allocator.allocate(8)
    assert allocator.can_allocate(2, critical=True)
    assert allocator.allocate(2, critical=True) == [8, 9]
    # the reserve taken: nothing is available, and taking nothing still succeeds
    assert allocator.num_available == -2 and allocator.can_allocate(0)
    assert allocator.allocate(0) == []


def test_critical_allocation_cannot_take_more_than_the_free_pages():
    allocator = PageAllocator(10, reserve=2)
    allocator.allocate(8)
    assert not allocator.can_allocate(3, critical=True)
    with pytest.raises(OutOfPages, match=r"need 3 pages, 2 free \(2 reserved"):
        allocator.allocate(3, critical=True)


def test_reserve_of_the_whole_pool_leaves_pages_only_for_critical_allocations():
    allocator = PageAllocator(4, reserve=4)
    assert not allocator.can_allocate(1)
    assert allocator.allocate(4, critical=True) == [0, 1, 2, 3]


def test_can_allocate_matches_the_free_pages_above_the_reserve():
    allocator = PageAllocator(10, reserve=3)
    allocator.allocate(2)
    assert allocator.can_allocate(5)
    assert not allocator.can_allocate(6)
    assert allocator.can_allocate(8, critical=True)
    assert allocator.can_allocate(0)


# ---- sharing and freeing ------------------------------------------------------------------


def test_share_adds_one_reference_per_listing():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    allocator.share([0, 0, 1])
    assert [allocator.refcount(0), allocator.refcount(1)] == [3, 2]


def test_free_returns_only_the_pages_that_reached_zero():
    allocator = PageAllocator(4)
    allocator.allocate(3)
    allocator.share([1])
    assert allocator.free([0, 1, 2]) == [0, 2]
    assert allocator.refcount(1) == 1
    assert allocator.free([1]) == [1]
    assert allocator.num_free == 4


def test_free_of_a_page_listed_twice_drops_two_references():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    allocator.share([1])
    assert allocator.free([1, 0, 1]) == [0, 1]
    assert allocator.num_free == 4


def test_free_returns_released_pages_in_the_order_they_reached_zero():
    allocator = PageAllocator(8)
    allocator.allocate(4)
    allocator.share([2])
    assert allocator.free([3, 2, 0, 2, 1]) == [3, 0, 2, 1]
    assert allocator.allocate(4) == [1, 2, 0, 3]


def test_pages_still_shared_stay_off_the_free_list():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    allocator.share([0])
    assert allocator.free([0]) == []
    assert allocator.allocate(2) == [2, 3]


@pytest.mark.parametrize("policy", POLICIES)
def test_free_of_an_empty_batch_returns_nothing(policy):
    allocator = PageAllocator(4, policy=policy)
    allocator.allocate(2)
    before = state(allocator)
    assert allocator.free([]) == []
    assert state(allocator) == before


def test_free_and_share_accept_any_iterable_of_ids():
    allocator = PageAllocator(4)
    allocator.allocate(3)
    allocator.share(page for page in (0, 1))
    assert allocator.free((0, 1, 2)) == [2]
    assert allocator.free(iter([0, 1])) == [0, 1]


def test_free_result_is_a_new_list():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    released = allocator.free(pages)
    assert released == pages and released is not pages


# ---- invalid pages: typed errors, nothing changed ------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_double_free_raises_invalid_page_and_changes_nothing(policy):
    allocator = PageAllocator(8, policy=policy)
    allocator.free(allocator.allocate(4)[1:2])
    before = state(allocator)
    with pytest.raises(InvalidPage, match="cannot free page 1: it is not allocated"):
        allocator.free([0, 1])
    assert state(allocator) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_double_free_inside_one_batch_raises_and_changes_nothing(policy):
    allocator = PageAllocator(8, policy=policy)
    allocator.allocate(6)
    before = state(allocator)
    with pytest.raises(InvalidPage, match="cannot free page 5 2 times: its reference count is 1"):
        allocator.free([4, 5, 3, 5])
    assert state(allocator) == before


def test_free_more_times_than_shared_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(1)
    allocator.share([0])
    before = state(allocator)
    with pytest.raises(InvalidPage, match="cannot free page 0 3 times: its reference count is 2"):
        allocator.free([0, 0, 0])
    assert state(allocator) == before


def test_free_of_a_never_allocated_page_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    before = state(allocator)
    with pytest.raises(InvalidPage, match="cannot free page 3: it is not allocated"):
        allocator.free([0, 3])
    assert state(allocator) == before


@pytest.mark.parametrize("bad", [4, 1000, 2**70])
def test_free_of_an_out_of_range_id_late_in_the_batch_changes_nothing(bad):
    allocator = PageAllocator(4)
    allocator.allocate(3)
    before = state(allocator)
    with pytest.raises(InvalidPage, match=rf"page {bad} is out of range \[0, 4\)"):
        allocator.free([0, 1, bad, 2])
    assert state(allocator) == before


def test_free_of_a_negative_id_raises_instead_of_counting_from_the_end():
    allocator = PageAllocator(4)
    allocator.allocate(4)
    before = state(allocator)
    with pytest.raises(InvalidPage, match=r"page -1 is out of range \[0, 4\)"):
        allocator.free([2, -1])
    assert state(allocator) == before


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_free_of_a_non_int_id_raises_type_error_and_changes_nothing(bad):
    allocator = PageAllocator(4)
    allocator.allocate(3)
    before = state(allocator)
    with pytest.raises(TypeError, match=f"page ids must be int, got {type(bad).__name__}"):
        allocator.free([0, bad])
    assert state(allocator) == before


def test_share_of_a_free_page_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    before = state(allocator)
    with pytest.raises(InvalidPage, match="cannot share page 3: it is free"):
        allocator.share([0, 3])
    assert state(allocator) == before


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [(4, InvalidPage, r"page 4 is out of range \[0, 4\)"), (-1, InvalidPage, "page -1"),
     (0.0, TypeError, "page ids must be int, got float"),
     (False, TypeError, "page ids must be int, got bool")],
)
def test_share_of_a_bad_id_raises_and_changes_nothing(bad, error, message):
    allocator = PageAllocator(4)
    allocator.allocate(2)
    before = state(allocator)
    with pytest.raises(error, match=message):
        allocator.share([1, bad])
    assert state(allocator) == before


@pytest.mark.parametrize(
    ("bad", "error"), [(4, InvalidPage), (-1, InvalidPage), (1.0, TypeError), (True, TypeError)]
)
def test_refcount_of_a_bad_id_raises(bad, error):
    with pytest.raises(error):
        PageAllocator(4).refcount(bad)


# ---- bad arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "error", "message"),
    [(-1, ValueError, "page count must be >= 0, got -1"),
     (1.5, TypeError, "page count must be an int, got float 1.5"),
     ("3", TypeError, "page count must be an int, got str '3'"),
     (True, TypeError, "page count must be an int, got bool True"),
     (None, TypeError, "page count must be an int, got NoneType None")],
)
@pytest.mark.parametrize("method", ["allocate", "can_allocate"])
def test_bad_page_counts_raise_and_change_nothing(method, n, error, message):
    allocator = PageAllocator(4)
    allocator.allocate(1)
    before = state(allocator)
    with pytest.raises(error, match=message):
        getattr(allocator, method)(n)
    assert state(allocator) == before


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"num_pages": 0}, ValueError, r"num_pages must be in \[1, 2147483647\], got 0"),
     ({"num_pages": -5}, ValueError, r"num_pages must be in \[1, 2147483647\], got -5"),
     ({"num_pages": 2**70}, ValueError, r"num_pages must be in \[1, 2147483647\], got 1180"),
     ({"num_pages": 4.0}, TypeError, "num_pages must be an int, got float"),
     ({"num_pages": True}, TypeError, "num_pages must be an int, got bool"),
     ({"num_pages": 4, "policy": "fifo"}, ValueError, "policy must be one of .*'fifo'"),
     ({"num_pages": 4, "reserve": 5}, ValueError, r"reserve must be in \[0, 4\], got 5"),
     ({"num_pages": 4, "reserve": -1}, ValueError, r"reserve must be in \[0, 4\], got -1"),
     ({"num_pages": 4, "reserve": 1.0}, TypeError, "reserve must be an int")],
)
def test_constructor_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        PageAllocator(**kwargs)


# ---- properties and stats -----------------------------------------------------------------


def test_properties_describe_the_pool():
    allocator = PageAllocator(10, policy="first_fit", reserve=2)
    allocator.allocate(3)
    assert (allocator.num_pages, allocator.num_free, allocator.num_used) == (10, 7, 3)
    assert (allocator.reserve, allocator.policy) == (2, "first_fit")


def test_refcounts_is_a_live_view_of_the_reference_counts():
    allocator = PageAllocator(3)
    view = allocator.refcounts
    allocator.allocate(2)
    allocator.share([1])
    assert view == [1, 2, 0]


def test_stats_count_pages_cumulatively_and_track_the_peak():
    allocator = PageAllocator(10)
    first = allocator.allocate(3)
    allocator.allocate(2)
    allocator.free(first)
    allocator.allocate(1)
    assert allocator.stats() == AllocatorStats(
        num_pages=10, num_free=7, num_used=3, peak_used=5,
        num_allocated=6, num_freed=3, num_failed=0,
    )


def test_stats_count_a_shared_page_as_freed_only_when_its_last_reference_goes():
    allocator = PageAllocator(4)
    allocator.allocate(1)
    allocator.share([0])
    allocator.free([0])
    assert allocator.stats().num_freed == 0
    allocator.free([0])
    assert allocator.stats().num_freed == 1


def test_cached_pages_held_again_count_in_the_peak_and_as_freed_when_let_go_again():
    allocator = PageAllocator(16)
    pages = allocator.allocate(4)
    allocator.mark_cached(pages)
    allocator.free(pages)
    allocator.allocate(4)
    allocator.share(pages)  # a prefix hit: the cached pages are used again
    stats = allocator.stats()
    assert (stats.num_used, stats.peak_used, stats.num_freed) == (8, 8, 4)
    allocator.check()
    allocator.free(pages)
    assert allocator.stats().num_freed == 8
    allocator.check()


def test_stats_utilization_is_the_used_fraction():
    allocator = PageAllocator(8)
    allocator.allocate(2)
    assert allocator.stats().utilization == 0.25


def test_stats_count_failed_allocations():
    allocator = PageAllocator(2)
    for _ in range(3):
        with pytest.raises(OutOfPages):
            allocator.allocate(3)
    assert allocator.stats().num_failed == 3


# ---- fragmentation ------------------------------------------------------------------------


def test_fragmentation_is_zero_when_the_free_pages_are_one_run():
    allocator = PageAllocator(10, policy="first_fit")
    allocator.allocate(4)
    assert allocator.fragmentation() == 0.0


def test_fragmentation_is_zero_when_no_page_is_free():
    allocator = PageAllocator(4)
    allocator.allocate(4)
    assert allocator.fragmentation() == 0.0


def test_fragmentation_counts_free_pages_outside_the_longest_free_run():
    allocator = PageAllocator(10)
    allocator.allocate(10)
    allocator.free([1, 2, 5, 7, 8, 9])  # free runs of 2, 1 and 3 pages
    assert allocator.fragmentation() == 0.5


# ---- check() ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_check_passes_after_ordinary_use(policy):
    allocator = PageAllocator(200, policy=policy, reserve=3)
    pages = allocator.allocate(150)
    allocator.share(pages[::3])
    allocator.free(pages[::2])
    allocator.check()


def test_check_names_a_free_page_that_has_references():
    allocator = PageAllocator(4)
    allocator._refcounts[2] = 1
    with pytest.raises(AssertionError, match=r"free or cached pages with references: \[2\]"):
        allocator.check()


def test_check_names_a_page_on_the_free_list_twice():
    allocator = PageAllocator(4)
    allocator.allocate(1)
    allocator._free.append(3)
    with pytest.raises(AssertionError, match=r"on the free list or cached queue twice: \[3\]"):
        allocator.check()


def test_check_names_a_free_page_missing_from_the_free_list():
    allocator = PageAllocator(4)
    allocator._free.remove(1)
    with pytest.raises(AssertionError, match="4 pages have no references but 3 are free"):
        allocator.check()


def test_check_names_a_negative_reference_count():
    allocator = PageAllocator(4)
    allocator.allocate(4)
    allocator._refcounts[1] = -1
    with pytest.raises(AssertionError, match=r"negative reference counts: \[1\]"):
        allocator.check()


def test_check_names_a_first_fit_bucket_out_of_order():
    allocator = PageAllocator(8, policy="first_fit")
    allocator._free._buckets[0].reverse()
    with pytest.raises(AssertionError, match="bucket 0 is not ascending"):
        allocator.check()


def test_check_names_a_first_fit_id_in_another_bucket():
    allocator = PageAllocator(200, policy="first_fit")
    allocator._free._buckets[1].remove(70)
    allocator._free._buckets[0].append(70)
    with pytest.raises(AssertionError, match="bucket 0 holds ids of another bucket"):
        allocator.check()


def test_check_names_a_first_fit_id_in_another_bucket_out_of_order():
    allocator = PageAllocator(200, policy="first_fit")
    allocator._free._buckets[1].remove(70)
    allocator._free._buckets[0].insert(5, 70)
    with pytest.raises(AssertionError, match="bucket 0 is not ascending and distinct; bucket 0 "
                                             "holds ids of another bucket"):
        allocator.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_check_names_a_marked_page_on_the_free_list_and_an_unmarked_one_on_the_queue(policy):
    allocator = PageAllocator(8, policy=policy)
    pages = allocator.allocate(2)
    allocator.mark_cached(pages)
    allocator.free(pages)
    allocator.check()
    allocator._is_cached[pages[0]] = False
    allocator._is_cached[5] = True
    with pytest.raises(AssertionError, match=re.escape(
            f"cached pages on the free list [5] or uncached ones on the cached queue "
            f"[{pages[0]}]")):
        allocator.check()


def test_check_names_a_first_fit_bucket_heap_out_of_heap_order():
    allocator = PageAllocator(200, policy="first_fit")
    allocator._free._nonempty[:] = [3, 0, 1, 2]
    with pytest.raises(AssertionError, match="the bucket heap is not a heap"):
        allocator.check()


def test_check_names_a_first_fit_size_that_does_not_match_the_buckets():
    allocator = PageAllocator(200, policy="first_fit")
    allocator._free._size += 1
    with pytest.raises(AssertionError, match="size 201 does not match the buckets"):
        allocator.check()


def test_check_names_a_cached_page_whose_back_link_is_wrong():
    allocator = cached_allocator()
    allocator._prev[1] = allocator.num_pages
    with pytest.raises(AssertionError, match="the cached queue's links break at page 1"):
        allocator.check()


def test_check_names_a_peak_above_the_pages_ever_allocated():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    allocator._fewest_unused = 1
    with pytest.raises(AssertionError, match=r"peak_used 3 not between num_used 2 and "
                                             r"min\(num_pages, num_allocated\) 2"):
        allocator.check()


# ---- thread_safe=False --------------------------------------------------------------------


def test_allocator_without_a_lock_behaves_the_same():
    allocator = PageAllocator(8, thread_safe=False)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.share([1])
    assert allocator.free([0, 1]) == [0]
    assert allocator.stats().peak_used == 3
    allocator.check()


# ---- cached pages: count 0, content kept, taken only when no free page is left -----------

def cached_allocator(num_pages=6):
    """Pages 0-2 held, cached, then let go (0 the warmest); pages 3-5 free."""
    allocator = PageAllocator(num_pages)
    pages = allocator.allocate(3)
    allocator.mark_cached(pages)
    assert allocator.free(pages) == []  # none went to the free list
    return allocator


def test_pages_let_go_while_cached_wait_on_the_queue_tail_first():
    allocator = cached_allocator()
    assert allocator.cached_pages() == [2, 1, 0]
    assert (allocator.num_free, allocator.num_cached, allocator.num_used) == (3, 3, 0)
    assert [allocator.refcount(p) for p in range(3)] == [0, 0, 0]
    allocator.check()


def test_allocation_takes_free_pages_first_then_the_coldest_cached_ones():
    allocator = cached_allocator()
    evicted = []
    allocator.on_evict = evicted.append
    assert allocator.allocate(4) == [3, 4, 5, 2]
    assert evicted == [[2]]
    assert not allocator.is_cached(2) and allocator.cached_pages() == [1, 0]
    assert allocator.stats().num_evicted == 1
    allocator.check()


@pytest.mark.parametrize("policy", ["lifo", "first_fit"])
def test_an_on_evict_that_raises_leaves_the_evicted_pages_free(policy):
    allocator = PageAllocator(6, policy=policy)
    pages = allocator.allocate(3)
    allocator.mark_cached(pages)
    allocator.free(pages)

    def broken(evicted):
        raise RuntimeError("listener failed")

    allocator.on_evict = broken
    with pytest.raises(RuntimeError, match="listener failed"):
        allocator.allocate(5)  # 3 free pages, then 2 evictions
    allocator.check()
    assert (allocator.num_free, allocator.num_cached, allocator.num_used) == (5, 1, 0)
    with pytest.raises(RuntimeError, match="listener failed"):
        allocator.evict(1)
    allocator.check()
    allocator.on_evict = None
    assert sorted(allocator.allocate(6)) == list(range(6))


def test_lifo_after_an_allocation_that_on_evict_failed_hands_out_the_same_ids_next():
    allocator = PageAllocator(8)
    pages = allocator.allocate(6)
    allocator.mark_cached(pages[:1])
    allocator.free(pages)  # free, the top of the stack first: 5, 4, 3, 2, 1, 6, 7; 0 cached

    def broken(evicted):
        raise RuntimeError("listener failed")

    allocator.on_evict = broken
    with pytest.raises(RuntimeError, match="listener failed"):
        allocator.allocate(8)  # the 7 free pages, then 1 eviction
    allocator.on_evict = None
    assert allocator.allocate(7) == [5, 4, 3, 2, 1, 6, 7]


def test_evicting_nothing_does_not_call_on_evict():
    allocator = cached_allocator()
    calls = []
    allocator.on_evict = calls.append
    assert allocator.evict(0) == [] and calls == []
    assert allocator.evict(3) == [2, 1, 0] and calls == [[2, 1, 0]]
    assert allocator.evict(3) == [] and calls == [[2, 1, 0]]  # none cached


def test_sharing_a_cached_page_takes_it_off_the_queue():
    allocator = cached_allocator()
    allocator.share([1])
    assert allocator.cached_pages() == [2, 0] and allocator.refcount(1) == 1
    allocator.free([1])
    assert allocator.cached_pages() == [2, 0, 1]  # the most recently used now
    allocator.check()


def test_sharing_cached_pages_takes_them_off_the_queue_run_by_run():
    allocator = PageAllocator(6)
    pages = allocator.allocate(5)
    allocator.mark_cached(pages)
    allocator.free(pages)
    assert allocator.cached_pages() == [4, 3, 2, 1, 0]
    allocator.share([1, 2, 4, 1])  # runs [1, 2] and [4]; 1 held twice
    assert allocator.cached_pages() == [3, 0]
    assert [allocator.refcount(p) for p in range(5)] == [0, 2, 1, 0, 1]
    allocator.check()
    allocator.share([0, 3])  # one run: 3 is now the page next colder than 0
    assert allocator.cached_pages() == [] and allocator.num_cached == 0
    allocator.check()


def test_evict_moves_the_coldest_cached_pages_to_the_free_list():
    allocator = cached_allocator()
    assert allocator.evict(2) == [2, 1]
    assert allocator.evict(5) == [0]
    assert (allocator.num_free, allocator.num_cached) == (6, 0)
    allocator.check()


def test_the_reserve_counts_cached_pages_as_available():
    allocator = PageAllocator(4, reserve=1)
    pages = allocator.allocate(3)
    allocator.mark_cached(pages)
    allocator.free(pages)
    assert allocator.can_allocate(3) and not allocator.can_allocate(4)
    assert allocator.allocate(4, critical=True) == [3, 2, 1, 0]


def test_marking_a_page_nobody_holds_cached_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(1)
    with pytest.raises(InvalidPage, match="cannot cache page 1: nobody holds it"):
        allocator.mark_cached([0, 1])
    assert not allocator.is_cached(0)
    allocator.check()


def test_out_of_pages_counts_cached_pages_in_its_message():
    allocator = cached_allocator(3)
    with pytest.raises(OutOfPages, match=r"need 4 pages, 0 free and 3 cached \(0 reserved\)"):
        allocator.allocate(4)
    assert allocator.cached_pages() == [2, 1, 0]
