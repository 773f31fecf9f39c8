"""Random operation sequences on KVCache, checking every invariant after every step.

Each token's K value is an id unique to its content (the token ids up to and including it),
as real KV is. After every step each live sequence, read through its page table, must give
back exactly its own values: a wrong share or a missed copy-on-write shows up at once. The
tier variant evicts into a small host tier, so pages loaded back from it are checked too. The
fp8 variants (K/V and MLA latent pages) store each id as two float8_e4m3fn values under given
scales of 1, exact. The
windowed variant's layer attends through a sliding window: pages out of it go back, and each
sequence must still read every token of its window.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvpool.cache import HOLE, KVCache
from kvpool.errors import DuplicateSequence, KVPoolError, SequenceTooLong, UnknownSequence
from kvpool.fp8 import FP8_DTYPE
from kvpool.layout import KVLayout
from kvpool.tiers import HostTier

PAGE_SIZE = 4
NUM_PAGES = 16
MAX_TOKENS = 40  # per sequence: appends past it must fail and change nothing
TIER_PAGES = 6
VOCAB = 3
# Prompts start from a few shared bases so that prefix hits, shared pages and evictions
# of shared pages are common.
BASES = ([0] * 16, [1, 2] * 8)
prompts = st.builds(lambda base, k, tail: base[:k] + tail, st.sampled_from(BASES),
                    st.integers(0, 16), st.lists(st.integers(0, VOCAB - 1), max_size=3))
# The positive finite float8_e4m3fn values, ascending: two of them spell an id exactly.
E4M3_VALUES = torch.arange(1, 127, dtype=torch.uint8).view(FP8_DTYPE).float().tolist()


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self, policy, prefix_caching, tier, page_size=PAGE_SIZE, fp8=False,
                 kind="mha", window=None):
        super().__init__()
        self.fp8 = fp8
        self.window = window
        self.page_size = page_size
        self.num_pages = NUM_PAGES * PAGE_SIZE // page_size  # the same tokens at any page size
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2 if fp8 else 1,
                          dtype=FP8_DTYPE if fp8 else torch.float32, page_size=page_size,
                          kind=kind, layer_windows=(window,) if window else ())
        self.tier = HostTier(TIER_PAGES) if tier else None
        self.cache = KVCache(layout, self.num_pages, device="cpu", policy=policy,
                             prefix_caching=prefix_caching, tier=self.tier,
                             max_tokens_per_seq=MAX_TOKENS,
                             kv_scales=((1.0, 1.0) if kind == "mha" else 1.0) if fp8 else None)
        self.tokens = {}  # seq id -> token ids the test gave it
        self.value_ids = {}  # content prefix -> unique value
        self.next_seq = 0

    # ---- helpers -------------------------------------------------------------------------

    def value(self, tokens, pos):
        """The K row of a token: its id (unique to its content), as two e4m3 values in fp8."""
        value = self.value_ids.setdefault(tuple(tokens[:pos + 1]), len(self.value_ids) + 1)
        if self.fp8:
            digits = len(E4M3_VALUES)
            return [E4M3_VALUES[value % digits], E4M3_VALUES[value // digits]]
        return [value]

    def write(self, seq_id, start):
        tokens = self.tokens[seq_id]
        slots = self.cache.slots(seq_id)[start:]
        if slots:
            k = torch.tensor([self.value(tokens, p) for p in range(start, len(tokens))],
                             dtype=torch.float32).view(len(slots), 1, -1)
            v = -k if self.cache.layout.kind == "mha" else None  # an MLA latent is one plane
            self.cache.pool.write(0, torch.tensor(slots), k, v)

    def snapshot(self):
        c = self.cache
        tier = self.tier
        return (
            {sid: (c.pages(sid), c.num_tokens(sid)) for sid in c.sequences()},
            [c.allocator.refcount(p) for p in range(self.num_pages)],
            c.stats(),
            (list(tier), tier.stats()) if tier else None,
            c.pool.kv.view(torch.uint8).clone(),  # the bytes: NaN compares equal to itself
        )

    def attempt(self, call):
        """Run `call`; if it raises (any error kvpool raises on purpose, or a bad argument's
        TypeError or ValueError), assert that nothing changed."""
        before = self.snapshot()
        try:
            return call(), True
        except (KVPoolError, TypeError, ValueError):
            self.assert_unchanged(before)
            return None, False

    def fails(self, error, call):
        """`call` must raise `error` and change nothing."""
        before = self.snapshot()
        with pytest.raises(error):
            call()
        self.assert_unchanged(before)

    def assert_unchanged(self, before):
        after = self.snapshot()
        assert before[:4] == after[:4]
        assert torch.equal(before[4], after[4])

    # ---- rules ---------------------------------------------------------------------------

    @rule(target=seqs, tokens=prompts, known=st.booleans())
    def add(self, tokens, known):
        seq_id = self.next_seq
        self.next_seq += 1
        call = (lambda: self.cache.add_sequence(seq_id, tokens)) if known else (
            lambda: self.cache.add_sequence(seq_id, num_tokens=len(tokens)))
        hit, ok = self.attempt(call)
        if not ok:
            return None
        assert hit % self.page_size == 0 and hit < max(len(tokens), 1)
        # unknown content gets values no other sequence can share
        self.tokens[seq_id] = tokens if known else [("u", seq_id, i) for i in range(len(tokens))]
        self.write(seq_id, hit)
        return seq_id

    @rule(seq=seqs, new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          known=st.booleans())
    def append(self, seq, new, known):
        if seq not in self.tokens:
            return
        call = (lambda: self.cache.append(seq, token_ids=new)) if known else (
            lambda: self.cache.append(seq, len(new)))
        slots, ok = self.attempt(call)
        if ok:
            start = len(self.tokens[seq])
            self.tokens[seq] = self.tokens[seq] + (
                new if known else [("u", seq, start + i) for i in range(len(new))])
            assert slots == self.cache.slots(seq)[start:]
            self.write(seq, start)
            # exactly the pages wholly before the first new token's window went back
            dropped = max(start - self.window + 1, 0) // self.page_size if self.window else 0
            assert self.cache.slots(seq).count(HOLE) == dropped * self.page_size

    @rule(batch=st.lists(st.tuples(seqs, st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                  max_size=6)), max_size=4),
          how=st.sampled_from(["token_ids", "num_tokens", "decode"]))
    def append_batch(self, batch, how):
        news = {seq: new for seq, new in batch if seq in self.tokens}
        if how == "decode":
            news = {seq: new[:1] for seq, new in news.items()}
        calls = {"token_ids": lambda: self.cache.append_batch(list(news),
                                                              token_ids=list(news.values())),
                 "num_tokens": lambda: self.cache.append_batch(list(news),
                                                               [len(n) for n in news.values()]),
                 "decode": lambda: self.cache.append_batch(list(news))}
        slots, ok = self.attempt(calls[how])
        if ok:
            expected = []
            for seq, new in news.items():
                start = len(self.tokens[seq])
                self.tokens[seq] = self.tokens[seq] + (new if how == "token_ids" else [
                    ("u", seq, start + i) for i in range(len(new))])
                expected += self.cache.slots(seq)[start:]
                self.write(seq, start)
                dropped = max(start - self.window + 1, 0) // self.page_size if self.window else 0
                assert self.cache.slots(seq).count(HOLE) == dropped * self.page_size
            assert slots == expected

    @rule(seq=seqs)
    def append_batch_listing_a_sequence_twice(self, seq):
        if seq in self.tokens:
            self.fails(ValueError, lambda: self.cache.append_batch([seq, seq]))

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens:
            return None
        child = self.next_seq
        self.next_seq += 1
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=seqs)
    def commit(self, seq):
        if seq in self.tokens:
            self.cache.commit(seq)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.cache.free_sequence(seq)
            del self.tokens[seq]

    @precondition(lambda self: self.cache.prefix_cache is not None)
    @rule(tokens=prompts)
    def finish(self, tokens):
        """A whole request in one step: its prompt is added, written, committed and freed,
        leaving its full pages cached (and, evicted, in the tier)."""
        seq_id = self.next_seq
        self.next_seq += 1
        hit, ok = self.attempt(lambda: self.cache.add_sequence(seq_id, tokens))
        if ok:
            self.tokens[seq_id] = tokens
            self.write(seq_id, hit)
            self.every_sequence_reads_its_own_values()
            self.cache.commit(seq_id)
            self.cache.free_sequence(seq_id)
            del self.tokens[seq_id]

    @rule(seq=seqs, tokens=prompts)
    def add_an_existing_id(self, seq, tokens):
        if seq in self.tokens:
            self.fails(DuplicateSequence, lambda: self.cache.add_sequence(seq, tokens))

    @rule(parent=seqs, child=seqs)
    def fork_onto_an_existing_id(self, parent, child):
        if parent in self.tokens and child in self.tokens:
            self.fails(DuplicateSequence, lambda: self.cache.fork(parent, child))

    @rule(method=st.sampled_from(["append", "commit", "free_sequence", "fork", "pages"]))
    def call_an_unknown_id(self, method):
        args = ("nobody", "child") if method == "fork" else ("nobody",)
        self.fails(UnknownSequence, lambda: getattr(self.cache, method)(*args))

    @rule(seq=seqs, bad=st.sampled_from([[1, "x"], [2**31], [0.5], "ab", {1, 2}]),
          where=st.sampled_from(["add", "append", "pages_to_add"]))
    def pass_bad_token_ids(self, seq, bad, where):
        calls = {"add": lambda: self.cache.add_sequence("new", bad),
                 "append": lambda: self.cache.append(seq, token_ids=bad),
                 "pages_to_add": lambda: self.cache.pages_to_add(bad)}
        if where != "append" or seq in self.tokens:
            self.fails((TypeError, ValueError), calls[where])

    @rule(seq=seqs)
    def grow_past_the_limit(self, seq):
        if seq in self.tokens:
            n = MAX_TOKENS + 1 - len(self.tokens[seq])
            self.fails(SequenceTooLong, lambda: self.cache.append(seq, n))

    @precondition(lambda self: self.cache.prefix_cache is not None)
    @rule(num_pages=st.integers(1, 4))
    def evict(self, num_pages):
        self.cache.prefix_cache.evict(num_pages)

    @precondition(lambda self: self.cache.prefix_cache is not None)
    @rule()
    def clear(self):
        self.cache.prefix_cache.clear()
        assert self.cache.stats().num_cached_pages == 0

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self):
        self.cache.check()
        s = self.cache.stats()
        assert s.num_free_pages + s.num_cached_pages + s.num_used_pages == self.num_pages

    @invariant()
    def every_sequence_reads_its_own_values(self):
        k = self.cache.pool.k_cache(0).reshape(-1, self.cache.layout.head_dim)
        for seq_id, tokens in self.tokens.items():
            slots = self.cache.slots(seq_id)
            held = [p for p, slot in enumerate(slots) if slot != HOLE]
            got = k[torch.tensor([slots[p] for p in held], dtype=torch.long)].float().tolist()
            assert got == [self.value(tokens, p) for p in held], seq_id
            in_window = range(max(len(tokens) - (self.window or len(tokens)), 0), len(tokens))
            assert set(in_window) <= set(held), seq_id

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free_sequence(seq_id)
        if self.cache.prefix_cache is not None:
            self.cache.prefix_cache.clear()
        assert self.cache.allocator.num_free == self.num_pages
        self.cache.check()


@pytest.mark.parametrize(("policy", "fp8"), [("lifo", False), ("first_fit", False),
                                             ("lifo", True)], ids=["lifo", "first_fit", "fp8"])
@pytest.mark.parametrize(("prefix_caching", "tier"), [(False, False), (True, False),
                                                      (True, True)])
def test_random_operations_keep_every_invariant(policy, fp8, prefix_caching, tier):
    run_machine(policy, prefix_caching, tier, fp8=fp8)


def test_random_operations_keep_every_invariant_with_token_granular_pages():
    run_machine("lifo", prefix_caching=True, tier=True, page_size=1)


def run_machine(policy, prefix_caching, tier, page_size=PAGE_SIZE, fp8=False):
    class Machine(CacheMachine):
        def __init__(self):
            super().__init__(policy, prefix_caching, tier, page_size, fp8)

    Machine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    Machine.TestCase().runTest()


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize(("prefix_caching", "tier"), [(False, False), (True, False),
                                                      (True, True)])
def test_random_operations_on_mla_latent_pages_keep_every_invariant(prefix_caching, tier, fp8):
    """Pages of one latent plane (DeepSeek's MLA), in float32 or fp8 under one latent scale,
    share, copy on write, cache and go to a tier exactly as K/V pages do."""
    class Machine(CacheMachine):
        def __init__(self):
            super().__init__("lifo", prefix_caching, tier, fp8=fp8, kind="mla")

    Machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    Machine.TestCase().runTest()


@pytest.mark.parametrize(("prefix_caching", "tier"), [(False, False), (True, False),
                                                      (True, True)])
def test_random_operations_on_windowed_pages_keep_every_invariant(prefix_caching, tier):
    """A sliding window of 6 tokens over 4-token pages: appends give back the pages that fall
    out of it (copying a tree path's pages still in it first), while forks, copy-on-write,
    prefix hits, eviction and the tier keep working."""
    class Machine(CacheMachine):
        def __init__(self):
            super().__init__("lifo", prefix_caching, tier, window=6)

    Machine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    Machine.TestCase().runTest()


@settings(max_examples=200, deadline=None)
@given(num_prompts=st.integers(1, 10), uses=st.lists(st.integers(0, 9), max_size=30))
def test_eviction_takes_the_least_recently_used_page_first(num_prompts, uses):
    """One cached page per prompt, used (hit) in a random order: evicting one page at a time
    must take them from the least recently used on, whatever the heap has queued."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                      page_size=PAGE_SIZE)
    cache = KVCache(layout, 2 * num_prompts + 1, device="cpu", prefix_caching=True)
    page_of = {}
    order = []  # prompt numbers, least recently used first
    for i in [*range(num_prompts), *(u for u in uses if u < num_prompts)]:
        tokens = [i] * (PAGE_SIZE + 1)  # one full page, matchable, and one more token
        assert cache.add_sequence("s", tokens) == (PAGE_SIZE if i in page_of else 0)
        cache.commit("s")
        page_of.setdefault(i, cache.pages("s")[0])
        cache.free_sequence("s")
        order = [j for j in order if j != i] + [i]
        cache.check()
    for i in order:
        assert cache.prefix_cache.evict(1) == [page_of[i]]
        cache.check()
    assert cache.prefix_cache.num_pages == 0
