"""Random operation sequences on a KVCache of two page groups (a full-attention layer and a
layer with a 6-token window, each in a pool of its own), checking every invariant after every
step.

Each token's K value is an id unique to its content (the token ids up to and including it). The
model's writes go through `slot_mapping` from the prefix hit on, as the engine's do, so a group
whose match outruns the hit writes the recomputed tokens to its pool's padding page: after every
step each live sequence, read through each group's page table, must give back exactly its own values
(a shared page rewritten, a wrong share or a missed copy shows up at once), and the window group
must still hold every token of the window.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
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
from kvpool.layout import KVLayout

PAGE_SIZE = 4
WINDOW = 6
NUM_PAGES = (16, 10)  # full pool, window pool
MAX_TOKENS = 40
VOCAB = 3
BASES = ([0] * 16, [1, 2] * 8)
prompts = st.builds(lambda base, k, tail: base[:k] + tail, st.sampled_from(BASES),
                    st.integers(0, 16), st.lists(st.integers(0, VOCAB - 1), max_size=3))
news = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9)


class GroupedMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self, prefix_caching):
        super().__init__()
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                          page_size=PAGE_SIZE, layer_windows=(None, WINDOW))
        self.cache = KVCache(layout, NUM_PAGES, device="cpu",
                             prefix_caching=prefix_caching, max_tokens_per_seq=MAX_TOKENS)
        self.tokens = {}  # seq id -> token ids the test gave it
        self.value_ids = {}
        self.next_seq = 0

    # ---- helpers -------------------------------------------------------------------------

    def value(self, tokens, pos):
        return self.value_ids.setdefault(tuple(tokens[:pos + 1]), len(self.value_ids) + 1)

    def write(self, seq_id, start):
        """Write tokens [start, end) in every group through slot_mapping, as the model does."""
        tokens = self.tokens[seq_id]
        if start == len(tokens):
            return
        k = torch.tensor([[self.value(tokens, p)] for p in range(start, len(tokens))],
                         dtype=torch.float32).view(-1, 1, 1)
        for g, pool in enumerate(self.cache.kv_pools.pools):
            slots = self.cache.slot_mapping([seq_id], [start], [len(tokens)], group=g)
            pool.write(0, slots, k, -k)

    def snapshot(self):
        c = self.cache
        return ({sid: [(c.pages(sid, g), c.num_tokens(sid)) for g in range(2)]
                 for sid in c.sequences()},
                [[cache.allocator.refcount(p) for p in range(cache.allocator.num_pages)]
                 for cache in c.groups],
                c.stats(), c.group_stats(),
                [pool.kv.view(torch.uint8).clone() for pool in c.kv_pools.pools])  # NaN-safe

    def attempt(self, call):
        before = self.snapshot()
        try:
            return call(), True
        except (KVPoolError, TypeError, ValueError):
            self.assert_unchanged(before)
            return None, False

    def fails(self, error, call):
        before = self.snapshot()
        with pytest.raises(error):
            call()
        self.assert_unchanged(before)

    def assert_unchanged(self, before):
        after = self.snapshot()
        assert before[:4] == after[:4]
        assert all(torch.equal(a, b) for a, b in zip(before[4], after[4], strict=True))

    def grew(self, seq, new, known, start):
        self.tokens[seq] = self.tokens[seq] + (
            new if known else [("u", seq, start + i) for i in range(len(new))])
        self.write(seq, start)
        dropped = max(start - WINDOW + 1, 0) // PAGE_SIZE
        assert self.cache.slots(seq, 1).count(HOLE) == dropped * PAGE_SIZE
        assert HOLE not in self.cache.slots(seq, 0)

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
        assert hit % PAGE_SIZE == 0 and hit < max(len(tokens), 1)
        self.tokens[seq_id] = tokens if known else [("u", seq_id, i) for i in range(len(tokens))]
        self.write(seq_id, hit)
        return seq_id

    @rule(seq=seqs, new=news, known=st.booleans())
    def append(self, seq, new, known):
        if seq not in self.tokens:
            return
        call = (lambda: self.cache.append(seq, token_ids=new)) if known else (
            lambda: self.cache.append(seq, len(new)))
        slots, ok = self.attempt(call)
        if ok:
            start = len(self.tokens[seq])
            assert slots == tuple(self.cache.slots(seq, g)[start:] for g in range(2))
            self.grew(seq, new, known, start)

    @rule(batch=st.lists(st.tuples(seqs, news), max_size=4), decode=st.booleans())
    def append_batch(self, batch, decode):
        grow = {seq: new[:1] if decode else new for seq, new in batch if seq in self.tokens}
        call = (lambda: self.cache.append_batch(list(grow))) if decode else (
            lambda: self.cache.append_batch(list(grow), token_ids=list(grow.values())))
        slots, ok = self.attempt(call)
        if ok:
            expected = ([], [])
            for seq, new in grow.items():
                start = len(self.tokens[seq])
                for g in range(2):
                    expected[g].extend(self.cache.slots(seq, g)[start:])
                self.grew(seq, new, not decode, start)
            assert slots == expected

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
        """A whole request: added, written, committed and freed, its pages left cached."""
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

    @precondition(lambda self: self.cache.prefix_cache is not None)
    @rule(group=st.integers(0, 1), num_pages=st.integers(1, 4))
    def evict_in_one_group(self, group, num_pages):
        self.cache.groups[group].prefix_cache.evict(num_pages)

    @rule(seq=seqs, tokens=prompts)
    def add_an_existing_id(self, seq, tokens):
        if seq in self.tokens:
            self.fails(DuplicateSequence, lambda: self.cache.add_sequence(seq, tokens))

    @rule(method=st.sampled_from(["append", "commit", "free_sequence", "pages", "num_tokens"]))
    def call_an_unknown_id(self, method):
        self.fails(UnknownSequence, lambda: getattr(self.cache, method)("nobody"))

    @rule(seq=seqs, bad=st.sampled_from([[1, "x"], [2**31], [0.5], "ab"]),
          where=st.sampled_from(["add", "append"]))
    def pass_bad_token_ids(self, seq, bad, where):
        calls = {"add": lambda: self.cache.add_sequence("new", bad),
                 "append": lambda: self.cache.append(seq, token_ids=bad)}
        if where == "add" or seq in self.tokens:
            self.fails((TypeError, ValueError), calls[where])

    @rule(seq=seqs)
    def grow_past_the_limit(self, seq):
        if seq in self.tokens:
            n = MAX_TOKENS + 1 - len(self.tokens[seq])
            self.fails(SequenceTooLong, lambda: self.cache.append(seq, n))

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self):
        self.cache.check()
        for s, n in zip(self.cache.group_stats(), NUM_PAGES, strict=True):
            assert s.num_free_pages + s.num_cached_pages + s.num_used_pages == n

    @invariant()
    def every_sequence_reads_its_own_values(self):
        for g, pool in enumerate(self.cache.kv_pools.pools):
            k = pool.k_cache(0).reshape(-1)
            for seq_id, tokens in self.tokens.items():
                slots = self.cache.slots(seq_id, g)
                held = [p for p, slot in enumerate(slots) if slot != HOLE]
                got = k[torch.tensor([slots[p] for p in held], dtype=torch.long)].tolist()
                assert got == [self.value(tokens, p) for p in held], (g, seq_id)
                window = WINDOW if g else len(tokens)
                assert set(range(max(len(tokens) - window, 0), len(tokens))) <= set(held)

    def teardown(self):
        for seq_id in list(self.tokens):
            self.cache.free_sequence(seq_id)
        for cache in self.cache.groups:
            if cache.prefix_cache is not None:
                cache.prefix_cache.clear()
            assert cache.allocator.num_free == cache.allocator.num_pages
        self.cache.check()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_operations_on_a_full_and_window_pool_pair_keep_every_invariant(prefix_caching):
    class Machine(GroupedMachine):
        def __init__(self):
            super().__init__(prefix_caching)

    Machine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    Machine.TestCase().runTest()
