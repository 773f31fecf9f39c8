"""The allocator's per-page loops: the compiled ones do exactly what the Python ones do."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import page_counts
from kvpool.errors import InvalidPage
from kvpool.page_counts import PageCounts

NUM_PAGES = 12

needs_compiled = pytest.mark.skipif(page_counts.compiled is None,
                                    reason="the package was built without a C compiler")

page = st.integers(0, NUM_PAGES - 1)
bad = st.sampled_from([-1, NUM_PAGES, 2**70, 1.0, "3", None, True])
ids = st.one_of(page, page, page, bad)  # mostly valid, so that batches often succeed
operations = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.lists(page, max_size=6, unique=True)),
    st.tuples(st.just("share"), st.lists(ids, max_size=5)),
    st.tuples(st.just("release"), st.lists(ids, max_size=5)),
    st.tuples(st.just("release"), st.lists(page, min_size=2, max_size=6, unique=True)),
    st.tuples(st.just("mark"), st.lists(page, max_size=6)),
    st.tuples(st.just("pop_cold"), st.integers(0, 3)),
), max_size=40)


def state(counts):
    return (list(counts.refcounts), bytes(counts.is_cached), counts.queued(), counts.num_cached,
            counts.num_marked)


def apply(counts, op, arg):
    """Run one operation; the result, or the type and message of the error it raised."""
    try:
        if op == "hold":
            free = [p for p in arg if not counts.refcounts[p] and not counts.is_cached[p]]
            return counts.hold(free)
        if op == "mark":  # as the allocator's mark_cached: held pages only
            return counts.mark([p for p in arg if counts.refcounts[p] > 0])
        if op == "pop_cold":
            return counts.pop_cold(min(arg, counts.num_cached))
        if op == "release":
            return counts.release(list(arg), [])
        return counts.share(list(arg))
    except (TypeError, InvalidPage) as error:
        return type(error), str(error)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(operations)
def test_compiled_and_python_loops_agree_on_every_call(ops):
    compiled, python = PageCounts(NUM_PAGES), PageCounts(NUM_PAGES)
    for op, arg in ops:
        got = apply(compiled, op, arg)
        loops, page_counts.compiled = page_counts.compiled, None
        try:
            want = apply(python, op, arg)
        finally:
            page_counts.compiled = loops
        assert got == want, (op, arg)
        assert state(compiled) == state(python), (op, arg)
        assert compiled.problems() == []


@needs_compiled
def test_compiled_release_refuses_a_batch_freeing_a_page_more_often_than_it_is_held():
    counts = PageCounts(4)
    counts.hold([1])
    before = state(counts)
    assert page_counts.compiled.release(counts.refcounts, counts.is_cached, counts.next,
                                        counts.prev, [1, 1]) is None
    assert state(counts) == before


@needs_compiled
def test_compiled_loops_reject_containers_that_do_not_match():
    counts = PageCounts(4)
    with pytest.raises(ValueError, match="one byte per page"):
        page_counts.compiled.share(counts.refcounts, bytearray(3), counts.next, counts.prev, [])
