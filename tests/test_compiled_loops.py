"""The allocator's per-page loops: the compiled ones do exactly what the Python ones do."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import allocator as allocator_module
from kvpool.allocator import PageAllocator
from kvpool.errors import InvalidPage, OutOfPages

NUM_PAGES = 12

needs_compiled = pytest.mark.skipif(allocator_module.compiled is None,
                                    reason="the package was built without a C compiler")

page = st.integers(0, NUM_PAGES - 1)
bad = st.sampled_from([-1, NUM_PAGES, 2**70, 1.0, "3", None, True])
ids = st.one_of(page, page, page, bad)  # mostly valid, so that batches often succeed
operations = st.lists(st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 6)),
    st.tuples(st.just("share"), st.lists(ids, max_size=5)),
    st.tuples(st.just("free"), st.lists(ids, max_size=5)),
    st.tuples(st.just("free"), st.lists(page, min_size=2, max_size=6, unique=True)),
    st.tuples(st.just("mark_cached"), st.lists(page, max_size=6)),
    st.tuples(st.just("evict"), st.integers(0, 3)),
), max_size=40)


def state(allocator):
    return (list(allocator.refcounts), bytes(allocator.cached_marks), allocator.cached_pages(),
            allocator.num_marked, allocator.stats(), list(allocator._free))


def apply(allocator, op, arg):
    """Run one operation; the result, or the type and message of the error it raised."""
    if op == "mark_cached":  # held pages only, as the prefix cache marks them
        arg = [p for p in arg if allocator.refcounts[p] > 0]
    try:
        return getattr(allocator, op)(arg)
    except (TypeError, InvalidPage, OutOfPages) as error:
        return type(error), str(error)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(operations)
def test_compiled_and_python_loops_agree_on_every_call(ops):
    compiled, python = PageAllocator(NUM_PAGES), PageAllocator(NUM_PAGES)
    for op, arg in ops:
        got = apply(compiled, op, arg)
        loops, allocator_module.compiled = allocator_module.compiled, None
        try:
            want = apply(python, op, arg)
        finally:
            allocator_module.compiled = loops
        assert got == want, (op, arg)
        assert state(compiled) == state(python), (op, arg)
        compiled.check()


@needs_compiled
def test_compiled_release_refuses_a_batch_freeing_a_page_more_often_than_it_is_held():
    allocator = PageAllocator(4)
    allocator.allocate(2)
    before = state(allocator)
    assert allocator_module.compiled.release(allocator._refcounts, allocator._is_cached,
                                             allocator._next, allocator._prev, [1, 1]) is None
    assert state(allocator) == before


@needs_compiled
def test_compiled_loops_reject_containers_that_do_not_match():
    allocator = PageAllocator(4)
    with pytest.raises(ValueError, match="one byte per page"):
        allocator_module.compiled.share(allocator._refcounts, bytearray(3), allocator._next,
                                        allocator._prev, [])
