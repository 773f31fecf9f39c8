"""Random operation sequences on PageAllocator against a reference model, and many threads
on one allocator. check() and the model comparison run after every step."""

import random
import sys
import threading
from collections import Counter
from contextlib import contextmanager

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from depth import examples
from kvpool.errors import InvalidPage, OutOfPages
from kvpool.memory.allocator import POLICIES, AllocatorStats, PageAllocator

NUM_PAGES = 70  # more than one first_fit bucket
RESERVE = 3
NOT_INTS = (1.0, "2", None, True)
# The argument strategies are built once: a strategy built afresh at every step costs more
# than the step. Pages are drawn as indices into the model's lists (as sampled_from draws
# them), with strategies shared by every list of the same length.
BAD_IDS = (st.integers(NUM_PAGES, 2 * NUM_PAGES), st.integers(-NUM_PAGES, -1),
           st.sampled_from(NOT_INTS))
A_FREE_PAGE = "a free page"  # drawn as a bad id: then which free page
BAD_ID = {False: st.one_of(BAD_IDS), True: st.one_of(*BAD_IDS, st.just(A_FREE_PAGE))}


def draw_from(data, pages, **kwargs):
    """A list of `pages`' elements, as st.lists(st.sampled_from(pages), **kwargs) draws it."""
    return [pages[i] for i in data.draw(st.lists(st.integers(0, len(pages) - 1), **kwargs))]


class AllocatorMachine(RuleBasedStateMachine):
    """The model: a dict of the reference counts of held pages, and the free pages as a stack
    (top at the end) that lifo pops and first_fit takes the lowest of."""

    policy = "lifo"

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(NUM_PAGES, policy=self.policy, reserve=RESERVE)
        self.refs = {}  # page -> reference count, held pages only
        self.free = list(range(NUM_PAGES - 1, -1, -1))  # for lifo the top is the end
        self.num_allocated = self.num_freed = self.num_failed = self.peak_used = 0

    def next_free(self, n):
        """The ids the policy must hand out next."""
        return self.free[::-1][:n] if self.policy == "lifo" else sorted(self.free)[:n]

    def batch(self, data, max_size):
        """Held pages, possibly repeated."""
        return draw_from(data, sorted(self.refs), max_size=max_size)

    @rule(n=st.integers(0, 20), critical=st.booleans())
    def allocate(self, n, critical):
        if n and n > len(self.free) - (0 if critical else RESERVE):
            with pytest.raises(OutOfPages):
                self.allocator.allocate(n, critical=critical)
            self.num_failed += 1
            return
        expected = self.next_free(n)
        assert self.allocator.allocate(n, critical=critical) == expected
        for page in expected:
            self.free.remove(page)
            self.refs[page] = 1
        self.num_allocated += n
        self.peak_used = max(self.peak_used, len(self.refs))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        pages = self.batch(data, 4)
        self.allocator.share(pages)
        for page in pages:
            self.refs[page] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_pages(self, data):
        pages = self.batch(data, 6)
        if any(times > self.refs[page] for page, times in Counter(pages).items()):
            with pytest.raises(InvalidPage):
                self.allocator.free(pages)
            return
        released = []
        for page in pages:
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                released.append(page)
        assert self.allocator.free(pages) == released
        self.free.extend(released)
        self.num_freed += len(released)

    @rule(data=st.data(), method=st.sampled_from(["free", "share"]))
    def call_with_a_bad_id(self, data, method):
        bad = data.draw(BAD_ID[bool(self.free)])
        if bad == A_FREE_PAGE:
            bad = self.free[data.draw(st.integers(0, len(self.free) - 1))]
        pages = draw_from(data, sorted(self.refs), unique=True) if self.refs else []
        pages.insert(data.draw(st.integers(0, len(pages))), bad)
        with pytest.raises(TypeError if type(bad) is not int else InvalidPage):
            getattr(self.allocator, method)(pages)

    @invariant()
    def matches_the_model(self):
        allocator = self.allocator
        allocator.check()
        assert allocator.refcounts == [self.refs.get(page, 0) for page in range(NUM_PAGES)]
        assert allocator.stats() == AllocatorStats(
            num_pages=NUM_PAGES, num_free=len(self.free), num_used=len(self.refs),
            peak_used=self.peak_used, num_allocated=self.num_allocated,
            num_freed=self.num_freed, num_failed=self.num_failed,
        )


class FirstFitMachine(AllocatorMachine):
    policy = "first_fit"


SETTINGS = settings(max_examples=examples(60), stateful_step_count=50, deadline=None)
TestLifo = AllocatorMachine.TestCase
TestLifo.settings = SETTINGS
TestFirstFit = FirstFitMachine.TestCase
TestFirstFit.settings = SETTINGS


@contextmanager
def frequent_thread_switches():
    """Switch threads as often as the interpreter allows, to make interleavings likely."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def run_threads(work, num_threads):
    """Run work(i) in num_threads threads; return the exceptions they raised."""
    errors = []

    def guarded(me):
        try:
            work(me)
        except Exception as error:  # a thread's exception would otherwise only be printed
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(me,)) for me in range(num_threads)]
    with frequent_thread_switches():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return errors


@pytest.mark.parametrize("policy", POLICIES)
def test_threads_never_hold_the_same_page_at_once(policy):
    num_pages = 64
    allocator = PageAllocator(num_pages, policy=policy)
    owner = [None] * num_pages  # which thread holds each page
    clashes = []

    def work(me):
        rng = random.Random(me)
        for _ in range(500):
            try:
                pages = allocator.allocate(rng.randint(1, 8))
            except OutOfPages:
                continue
            for page in pages:
                if owner[page] is not None:
                    clashes.append((page, owner[page], me))
                owner[page] = me
            allocator.share(pages)
            allocator.free(pages)
            for page in pages:
                if owner[page] != me:
                    clashes.append((page, owner[page], me))
                owner[page] = None
            allocator.free(pages)

    assert run_threads(work, num_threads=8) == []
    assert clashes == []
    allocator.check()
    assert allocator.num_free == num_pages


@pytest.mark.parametrize("policy", POLICIES)
def test_threads_sharing_pages_never_get_a_page_someone_still_holds(policy):
    num_pages = 64
    allocator = PageAllocator(num_pages, policy=policy)
    holders = [0] * num_pages  # references the test hands around, per page
    handed = []  # pages shared with whichever thread picks them up
    book = threading.Lock()  # guards the test's bookkeeping, not the allocator
    clashes = []

    def drop(pages):
        with book:
            for page in pages:
                holders[page] -= 1
        allocator.free(pages)

    def work(me):
        rng = random.Random(me)
        for _ in range(300):
            try:
                pages = allocator.allocate(rng.randint(1, 4))
            except OutOfPages:
                pages = []
            with book:
                clashes.extend(page for page in pages if holders[page])
                for page in pages:
                    holders[page] = 2  # this thread and the thread that picks it up
            allocator.share(pages)
            handed.extend(pages)
            drop(pages)
            picked = []
            for _ in range(rng.randint(0, 4)):
                try:
                    picked.append(handed.pop())
                except IndexError:
                    break
            drop(picked)

    assert run_threads(work, num_threads=8) == []
    drop(list(handed))
    assert clashes == []
    allocator.check()
    assert allocator.num_free == num_pages
