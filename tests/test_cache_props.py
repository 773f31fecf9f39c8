"""Random operation sequences on the coordinator (KVCache), checking every invariant after
every step. One machine draws its configuration first: the group combination (one full group,
one sliding-window group, a full and a window group, a full and a Mamba state group), the
allocation policy, the page size, the page dtype (float32, or fp8 under scales of 1), K/V or
MLA latent pages, prefix caching, and a small host tier (one page group only).

Each token's K value is an id unique to its content (the token ids up to and including it),
as real KV is, written through each group's `slot_mapping` from the prefix hit on, as the
engine writes (a group whose match outruns the hit sends the recomputed tokens to its padding
page). After every step each live sequence, read through each group's page table, must give
back exactly its own values: a wrong share, a rewritten shared page or a missed copy-on-write
shows up at once; a window group must still hold every token of the window. fp8 pages store
each id as two float8_e4m3fn values, exact.
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from depth import examples
from kvpool.cache import HOLE, KVCache, StateSpec
from kvpool.cache.tiers import HostTier
from kvpool.errors import DuplicateSequence, KVPoolError, SequenceTooLong, UnknownSequence
from kvpool.memory.fp8 import FP8_DTYPE
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout

PAGE_SIZE = 4
NUM_PAGES = 16  # of PAGE_SIZE tokens: the same tokens at any page size
WINDOW = 6
MAX_TOKENS = 40  # per sequence: appends past it must fail and change nothing
TIER_PAGES = 6
STATE_SLOTS, CHECKPOINT_SLOTS, INTERVAL = 5, 3, 4
VOCAB = 3
# Prompts start from a few shared bases so that prefix hits, shared pages and evictions
# of shared pages are common.
BASES = ([0] * 16, [1, 2] * 8)
prompts = st.builds(lambda base, k, tail: base[:k] + tail, st.sampled_from(BASES),
                    st.integers(0, 16), st.lists(st.integers(0, VOCAB - 1), max_size=3))
# The positive finite float8_e4m3fn values, ascending: two of them spell an id exactly.
E4M3_VALUES = torch.arange(1, 127, dtype=torch.uint8).view(FP8_DTYPE).float().tolist()


@functools.cache
def entering_counts(num_tokens: int):
    """How many of a prompt's `num_tokens` enter at once: all (None), or a count, out of range
    by one at either end too (built once a length: a strategy built afresh costs more than a
    step)."""
    return st.none() | st.integers(-1, num_tokens + 1)


WINDOWS = {"full": (), "window": (WINDOW,), "full+window": (None, WINDOW), "full+state": ()}
configs = st.fixed_dictionaries({
    "groups": st.sampled_from(list(WINDOWS)), "policy": st.sampled_from(["lifo", "first_fit"]),
    "page_size": st.sampled_from([PAGE_SIZE, PAGE_SIZE, 1]), "fp8": st.booleans(),
    "kind": st.sampled_from(["mha", "mla"]), "prefix_caching": st.booleans(),
    "tier": st.booleans()})


def build(groups, policy, page_size, fp8, kind, prefix_caching, tier) -> KVCache:
    """The cache of one drawn configuration."""
    windows = WINDOWS[groups]
    layout = KVLayout(num_layers=max(len(windows), 1), num_kv_heads=1,
                      head_dim=2 if fp8 else 1, dtype=FP8_DTYPE if fp8 else torch.float32,
                      page_size=page_size, kind=kind, layer_windows=windows)
    num_pages = NUM_PAGES * PAGE_SIZE // page_size
    states = StateSpec(MambaLayout(1, 2, 2, 1, 1, 1, torch.float32), STATE_SLOTS,
                       CHECKPOINT_SLOTS, INTERVAL, 2 * INTERVAL) if groups == "full+state" else None
    one_group = len(windows) < 2 and states is None
    return KVCache(layout, num_pages if len(windows) < 2 else (num_pages, num_pages * 5 // 8),
                   device="cpu", policy=policy, prefix_caching=prefix_caching,
                   tier=HostTier(TIER_PAGES) if tier and prefix_caching and one_group else None,
                   max_tokens_per_seq=MAX_TOKENS, states=states,
                   kv_scales=((1.0, 1.0) if kind == "mha" else 1.0) if fp8 else None)


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.cache = None
        self.tokens = {}  # seq id -> token ids the test gave it
        self.value_ids = {}  # content prefix -> unique value
        self.rows = {}  # tuple of token ids -> their K rows, as `values` gives them
        self.next_seq = 0

    @initialize(config=configs)
    def configure(self, config):
        self.fp8 = config["fp8"]
        self.page_size = config["page_size"]
        self.cache = build(**config)
        self.groups = self.cache.page_groups

    # ---- helpers -------------------------------------------------------------------------

    def values(self, tokens, start=0):
        """The K rows of tokens[start:]: each token's id (unique to its content, the token
        ids up to and including it: the id of its prefix and itself), as two e4m3 values in
        fp8. Worked out once a content (an id, once given, never changes)."""
        key = tuple(tokens)
        rows = self.rows.get(key)
        if rows is None:
            rows = self.rows[key] = self._values(tokens)
        return rows[start:]

    def _values(self, tokens):
        rows, value = [], 0
        for token in tokens:
            value = self.value_ids.setdefault((value, token), len(self.value_ids) + 1)
            if self.fp8:
                digits = len(E4M3_VALUES)
                rows.append([E4M3_VALUES[value % digits], E4M3_VALUES[value // digits]])
            else:
                rows.append([value])
        return rows

    def write(self, seq_id, start):
        """Write tokens [start, end) in every group through slot_mapping, as the model does."""
        tokens = self.tokens[seq_id]
        if start == len(tokens):
            return
        k = torch.tensor(self.values(tokens, start),
                         dtype=torch.float32).view(len(tokens) - start, 1, -1)
        v = -k if self.cache.layout.kind == "mha" else None  # an MLA latent is one plane
        for g, group in enumerate(self.groups):
            group.pool.write(0, self.cache.slot_mapping([seq_id], [start], [len(tokens)],
                                                        group=g), k, v)

    def snapshot(self):
        c = self.cache
        state = None if c.state is None else (
            {sid: c.state_slot(sid) for sid in c.sequences()}, c.states.num_free,
            c.state.checkpoints.lengths())
        return (
            {sid: ([c.pages(sid, g) for g in range(len(self.groups))], c.num_tokens(sid))
             for sid in c.sequences()},
            [list(g.allocator.refcounts) for g in self.groups],
            c.stats(), c.group_stats(), state,
            (list(c.tier), c.tier.stats()) if c.tier else None,
            # the bytes: NaN compares equal to itself
            [g.pool.kv.view(torch.uint8).cpu().numpy().tobytes() for g in self.groups],
        )

    def attempt(self, call, errors=(KVPoolError, TypeError, ValueError)):
        """Run `call`; if it raises one of `errors` (by default any error kvpool raises on
        purpose, or a bad argument's TypeError or ValueError), assert that nothing changed."""
        before = self.snapshot()
        try:
            return call(), True
        except errors:
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
        assert before[:6] == after[:6]
        assert before[6] == after[6], "the pages' bytes changed"

    def grew(self, seq, new, known, start):
        """Record tokens appended to `seq` from `start`, write them, and check the window."""
        self.tokens[seq] = self.tokens[seq] + (
            new if known else [("u", seq, start + i) for i in range(len(new))])
        self.write(seq, start)
        for g, group in enumerate(self.groups):
            # exactly the pages wholly before the first new token's window went back
            dropped = group.drop_point(start) if group.window else 0
            assert self.cache.slots(seq, g).count(HOLE) == dropped * self.page_size

    # ---- rules ---------------------------------------------------------------------------

    @rule(target=seqs, tokens=prompts, known=st.booleans(), data=st.data())
    def add(self, tokens, known, data):
        """A sequence of a prompt, or of its first `entering` tokens (the rest to come chunk
        by chunk), the whole prompt counted as looked up."""
        seq_id = self.next_seq
        self.next_seq += 1
        entering = data.draw(entering_counts(len(tokens)), label="entering")
        given = {"token_ids": tokens} if known else {"num_tokens": len(tokens)}
        before = self.cache.stats().prefix_query_tokens
        valid = entering in (None, *range(len(tokens) + 1))
        hit, ok = self.attempt(lambda: self.cache.add_sequence(seq_id, **given, entering=entering),
                               KVPoolError if valid else (KVPoolError, ValueError))
        if not ok or not valid:
            assert not ok, f"entering={entering} accepted for a prompt of {len(tokens)}"
            return None
        held = tokens if entering is None else tokens[:entering]
        assert hit % self.page_size == 0 and hit < max(len(held), 1)
        looked_up = len(tokens) if known and self.cache.prefix_cache is not None else 0
        assert self.cache.stats().prefix_query_tokens == before + looked_up
        # unknown content gets values no other sequence can share
        self.tokens[seq_id] = held if known else [("u", seq_id, i) for i in range(len(held))]
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
            assert slots == self.cache.slots(seq)[start:]
            self.grew(seq, new, known, start)

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
                expected += self.cache.slots(seq)[start:]
                self.grew(seq, new, how == "token_ids", start)
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
        _, ok = self.attempt(lambda: self.cache.fork(parent, child))  # a state slot may lack
        if ok:
            self.tokens[child] = list(self.tokens[parent])
            return child
        return None

    @precondition(lambda self: self.cache is not None and self.cache.state is not None)
    @rule(seq=seqs, back=st.integers(0, 12))
    def compute_states(self, seq, back):
        """A step over the sequence's last `back` tokens: the state checkpoints it reserves
        become matchable at the next commit."""
        if seq in self.tokens:
            n = len(self.tokens[seq])
            batch = self.cache.state_batch([seq], [max(n - back, 0)], [n])
            assert batch.slots.tolist() == [self.cache.state_slot(seq)]

    @rule(seq=seqs)
    def commit(self, seq):
        if seq in self.tokens:
            self.cache.commit(seq)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.cache.free_sequence(seq)
            del self.tokens[seq]

    @precondition(lambda self: self.cache is not None and self.cache.prefix_cache is not None)
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

    @precondition(lambda self: self.cache is not None and self.cache.prefix_cache is not None)
    @rule(num_pages=st.integers(1, 4))
    def evict(self, num_pages):
        self.cache.evict(num_pages)

    @precondition(lambda self: self.cache is not None and self.cache.prefix_cache is not None
                  and len(self.cache.page_groups) > 1)
    @rule(num_pages=st.integers(1, 4))
    def evict_in_the_window_group(self, num_pages):
        """Later hits are bounded by the window group, while the full group matches more."""
        self.cache.page_groups[1].prefix_cache.evict(num_pages)

    @precondition(lambda self: self.cache is not None and self.cache.prefix_cache is not None)
    @rule()
    def clear(self):
        self.cache.evict(self.cache.num_pages)
        assert self.cache.stats().num_cached_pages == 0

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self):
        if self.cache is None:
            return
        self.cache.check()
        assert self.cache.sequences() == list(self.tokens)
        for s, group in zip(self.cache.group_stats(), self.groups, strict=True):
            assert s.num_free_pages + s.num_cached_pages + s.num_used_pages == \
                group.allocator.num_pages

    @invariant()
    def every_sequence_reads_its_own_values(self):
        if self.cache is None:
            return
        values = {seq_id: self.values(tokens) for seq_id, tokens in self.tokens.items()}
        for g, group in enumerate(self.groups):
            # every slot's K row, read once a group
            k = group.pool.k_cache(0).reshape(-1, self.cache.layout.head_dim).float().tolist()
            for seq_id, tokens in self.tokens.items():
                slots = self.cache.slots(seq_id, g)
                held = [p for p, slot in enumerate(slots) if slot != HOLE]
                got = [k[slots[p]] for p in held]
                assert got == [values[seq_id][p] for p in held], (g, seq_id)
                window = group.window or len(tokens)
                assert set(range(max(len(tokens) - window, 0), len(tokens))) <= set(held)

    def teardown(self):
        if self.cache is None:
            return
        for seq_id in list(self.tokens):
            self.cache.free_sequence(seq_id)
        self.cache.evict(self.cache.num_pages)
        for group in self.groups:
            assert group.allocator.num_free == group.allocator.num_pages
        if self.cache.state is not None:
            assert self.cache.states.num_free == self.cache.states.num_slots
        self.cache.check()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=examples(400),
                                     stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=examples(200), deadline=None)
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
