"""Prefix caching of a hybrid model: state checkpoints at interval multiples, a hit as deep as
the deepest checkpoint within the KV match, tombstones, two eviction orders; the design's two
scenarios exactly, and a random operation sequence with check() after every step."""

import re

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from depth import examples
from hybrid_util import hybrid_cache
from kvpool.cache.tokens import pack_tokens
from kvpool.errors import OutOfPages, OutOfStateSlots
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout

STATES = MambaLayout(num_layers=2, conv_dim=3, conv_kernel=3, num_heads=1, head_dim=2,
                     state_size=2, dtype=torch.float32)


def cache(num_pages=64, page_size=16, interval=64, track=256, num_checkpoint_slots=8, *,
          device):
    layout = KVLayout(1, 1, 2, dtype=torch.float32, page_size=page_size)
    return hybrid_cache(layout, num_pages, STATES, 2, device=device, prefix_caching=True,
                       num_checkpoint_slots=num_checkpoint_slots,
                       checkpoint_interval=interval, track_interval=track)


def compute(c, seq_id, start, end):
    """What a step does to the cache: reserve the checkpoints of tokens [start, end), write
    each one's state (its token count, as a stand-in), then commit."""
    batch = c.state_batch([seq_id], [start], [end])
    for request in batch.checkpoints:
        c.states.ssm[:, request.slot] = request.num_tokens
    c.commit(seq_id)
    return [request.num_tokens for request in batch.checkpoints]


def cached_then_freed(c, tokens, seq_id="a", chunk=64):
    """Add a prompt, prefill it in chunks of `chunk` tokens, commit and free it."""
    c.add_sequence(seq_id, tokens)
    made = []
    for start in range(0, len(tokens), chunk):
        made += compute(c, seq_id, start, min(start + chunk, len(tokens)))
    pages = c.pages(seq_id)
    c.free_sequence(seq_id)
    return made, pages


def test_cached_prefix_of_230_tokens_with_checkpoints_every_64_gives_a_hit_of_192(device):
    c = cache(device=device)
    tokens = list(range(230))
    made, _ = cached_then_freed(c, tokens)
    assert made == [64, 128, 192]
    assert c.add_sequence("b", tokens + [7]) == 192  # KV match: 14 pages, 224 tokens
    assert torch.all(c.states.ssm[:, c.state_slot("b")] == 192)  # the checkpoint, copied
    c.check()


def test_an_add_whose_checkpoint_copy_fails_gives_back_its_slot_and_pages(monkeypatch, device):
    c = cache(device=device)
    tokens = list(range(230))
    cached_then_freed(c, tokens)
    free_slots, stats = c.states.num_free, c.stats()

    def broken(*args):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(c.states, "copy", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        c.add_sequence("b", tokens + [7])
    assert (c.states.num_free, c.stats(), c.sequences()) == (free_slots, stats, [])
    c.check()


def test_a_checkpoint_past_the_kv_match_is_not_restored(device):
    """The same prompt again: its KV match stops short of the last token (112 of 128), so
    the checkpoint after all 128 tokens is out of reach and the one at 64 serves."""
    c = cache(device=device)
    tokens = list(range(128))
    made, _ = cached_then_freed(c, tokens)
    assert made == [64, 128]
    assert c.add_sequence("b", tokens) == 64
    assert torch.all(c.states.ssm[:, c.state_slot("b")] == 64)
    c.check()


def test_tombstone_at_256_backs_off_to_the_checkpoint_at_192(device):
    c = cache(device=device)
    tokens = list(range(280))
    made, pages = cached_then_freed(c, tokens)
    assert made == [64, 128, 192, 256]
    for n in (200, 150, 100):  # hits on 192, 128 and 64 leave 256 least recently used
        c.add_sequence("x", tokens[:n])
        c.free_sequence("x")
    assert c.state.checkpoints.evict(1) == 1
    assert sorted(c.state.checkpoints.lengths()) == [64, 128, 192]
    assert c.add_sequence("b", tokens) == 192  # KV match: 17 pages, 272 tokens
    assert c.pages("b")[:17] == pages[:17]  # the whole KV match is shared, tombstone's too
    assert torch.all(c.states.ssm[:, c.state_slot("b")] == 192)
    # 192..279 is computed again; the K/V of 192..271 is in the shared pages already, so
    # only 272..279 is written to the sequence's own page
    slots = c.slot_mapping(["b"], [192], [280]).tolist()
    assert slots[:80] == [c.pool.padding_slot] * 80
    assert slots[80:] == c.slots("b")[272:280]
    assert compute(c, "b", 192, 280) == [256]  # and the checkpoint at 256 is saved anew
    c.check()


def test_an_append_batch_of_no_tokens_keeps_the_checkpoints_for_the_commit(device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    batch = c.state_batch(["a"], [0], [130])
    assert [r.num_tokens for r in batch.checkpoints] == [128]
    c.append_batch(["a"], [0])
    c.commit("a")
    c.free_sequence("a")
    assert c.add_sequence("b", list(range(131))) == 128
    c.check()


def test_an_append_of_unknown_ids_before_the_commit_releases_the_steps_checkpoints(device):
    """Overlap scheduling appends a token before its id is known, between the step's
    state_batch and its commit: the sequence's content is unknown from there on, so the
    commit keeps none of the checkpoints reserved for it."""
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    batch = c.state_batch(["a"], [0], [130])
    assert [r.num_tokens for r in batch.checkpoints] == [128]
    c.append("a")
    c.commit("a")
    assert len(c.state.checkpoints) == 0 and c.state.checkpoints.held_slots() == []
    c.check()
    assert compute(c, "a", 130, 131) == []  # nor does it checkpoint again
    c.check()


def test_a_sequence_freed_between_state_batch_and_commit_releases_its_reservations(device):
    c = cache(num_checkpoint_slots=2, device=device)
    c.add_sequence("a", list(range(130)))
    c.add_sequence("b", list(range(1000, 1070)))
    batch = c.state_batch(["a", "b"], [0, 0], [130, 70])
    assert [r.num_tokens for r in batch.checkpoints] == [128, 64]
    c.free_sequence("a")  # its step aborted: the reservation for 128 goes back
    assert sorted(c.state.checkpoints.held_slots()) == [batch.checkpoints[1].slot]
    c.check()
    c.commit("b")
    c.free_sequence("b")
    assert c.state.checkpoints.lengths() == [64]
    assert c.states.num_free == c.states.num_slots - 1
    c.check()


def test_prefill_saves_a_checkpoint_at_the_last_interval_multiple_each_chunk_reaches(device):
    c = cache(device=device)
    c.add_sequence("a", list(range(300)))
    assert compute(c, "a", 0, 100) == [64]
    assert compute(c, "a", 100, 120) == []  # no multiple of 64 in (100, 120]
    assert compute(c, "a", 120, 300) == [256]  # not 128 or 192
    c.check()


def test_decode_saves_a_checkpoint_every_track_interval_only(device):
    c = cache(device=device)
    tokens = list(range(250))
    c.add_sequence("a", tokens)
    assert compute(c, "a", 0, 250) == [192]
    made = []
    for t in range(250, 330):
        c.append("a", token_ids=[t])
        made += compute(c, "a", t, t + 1)
    assert made == [256]  # 320 is a multiple of 64 but not of the track interval 256
    c.check()


def test_evicting_kv_pages_drops_the_checkpoints_that_needed_them(device):
    c = cache(device=device)
    cached_then_freed(c, list(range(200)))
    assert c.state.checkpoints.lengths() == [64, 128, 192]
    c.evict(c.num_cached_pages)
    assert len(c.state.checkpoints) == 0 and c.states.num_free == c.states.num_slots
    c.check()


def test_evicting_the_page_a_checkpoint_ends_on_drops_it_and_no_other(device):
    c = cache(device=device)
    cached_then_freed(c, list(range(200)))
    c.evict(c.num_cached_pages - 8)  # the pages past token 128 (the coldest, a tail first)
    assert c.state.checkpoints.lengths() == [64, 128]
    # with no tier, no hook asks for the evicted pages' keys: the tree chained none
    assert all(node.keys == () for node in c.prefix_cache._all_nodes())
    c.check()


def test_check_names_a_checkpoint_that_outlived_the_page_it_ends_on(device):
    c = cache(device=device)
    cached_then_freed(c, list(range(200)))
    c.prefix_cache.evict_hooks.clear()  # the state group no longer hears of evictions
    c.evict(c.num_cached_pages)
    with pytest.raises(AssertionError, match="checkpoint after 64 tokens: its KV ends on page "
                                             "None"):
        c.check()


def test_check_names_a_reservation_no_sequence_is_pending_on(device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    pending = c.state_batch(["a"], [0], [130]).checkpoints[0].slot
    c.check()
    reserved = sorted([pending, c.state.checkpoints.reserve()])
    with pytest.raises(AssertionError, match=re.escape(
            f"pending checkpoint slots [{pending}] differ from the reserved ones {reserved}")):
        c.check()


def test_a_prefix_without_a_checkpoint_is_computed_again_over_its_shared_pages(device):
    c = cache(device=device)
    _, pages = cached_then_freed(c, list(range(60)))  # 3 full pages, no checkpoint below 64
    assert c.add_sequence("b", list(range(60))) == 0
    assert c.pages("b")[:3] == pages[:3]
    slots = c.slot_mapping(["b"], [0], [60]).tolist()
    assert slots == [c.pool.padding_slot] * 48 + c.slots("b")[48:]
    c.check()


def test_checkpoints_beyond_the_capacity_evict_the_least_recently_used(device):
    c = cache(num_checkpoint_slots=2, device=device)
    cached_then_freed(c, list(range(200)))  # 64, 128, 192: the third evicts the first
    assert c.state.checkpoints.lengths() == [128, 192]
    assert c.add_sequence("b", list(range(150))) == 128  # a hit: 128 most recently used
    c.free_sequence("b")
    cached_then_freed(c, [1000 + t for t in range(70)], seq_id="c")  # its 64 evicts 192
    assert c.state.checkpoints.lengths() == [128, 64]
    c.check()


def test_one_prompt_prefilled_twice_in_one_step_keeps_one_checkpoint_slot(device):
    c = cache(device=device)
    tokens = list(range(130))
    c.add_sequence("a", tokens)
    c.add_sequence("b", tokens)
    batch = c.state_batch(["a", "b"], [0, 0], [130, 130])
    assert [r.num_tokens for r in batch.checkpoints] == [128, 128]
    c.commit("a")
    c.commit("b")  # the prefix has a checkpoint already: b's slot goes back
    assert c.state.checkpoints.lengths() == [128]
    assert c.state.checkpoints.held_slots() == [batch.checkpoints[0].slot]
    c.check()


def test_a_step_reserves_no_slot_for_a_checkpoint_another_sequence_committed(device):
    c = cache(device=device)
    tokens = list(range(130))
    c.add_sequence("a", tokens)
    c.add_sequence("b", tokens)  # before a's checkpoint: a hit of nothing
    assert compute(c, "a", 0, 130) == [128]
    assert compute(c, "b", 0, 130) == []
    assert c.state.checkpoints.lengths() == [128]
    c.check()


def test_prefills_past_the_checkpoint_capacity_reserve_only_what_it_holds(device):
    c = cache(num_checkpoint_slots=1, device=device)
    c.add_sequence("a", list(range(130)))
    c.add_sequence("b", list(range(1000, 1130)))
    batch = c.state_batch(["a", "b"], [0, 0], [130, 130])
    assert [(r.index, r.num_tokens) for r in batch.checkpoints] == [(0, 128)]
    c.check()


def test_failed_add_changes_nothing(device):
    c = cache(num_pages=16, device=device)
    cached_then_freed(c, list(range(130)))
    order = c.state.checkpoints.lengths()
    with pytest.raises(OutOfPages):
        c.add_sequence("b", list(range(300)))
    assert (c.state.checkpoints.lengths(), c.sequences(), c.num_cached_pages) == (order, [], 8)
    c.check()


def test_sequence_slots_are_not_taken_by_checkpoints(device):
    c = cache(device=device)
    c.add_sequence("a", [1])
    c.add_sequence("b", [2])
    with pytest.raises(OutOfStateSlots, match="0 free of 2"):
        c.add_sequence("c", [3])


def test_interval_not_a_multiple_of_the_page_size_is_refused(device):
    with pytest.raises(ValueError, match="checkpoint_interval 6 must be a multiple of "
                                         "page_size 4"):
        cache(page_size=4, interval=6, track=12, device=device)


@pytest.mark.parametrize(("starts", "ends"), [([0], [130]), ([0, 0], [130]), (None, [130, 70])])
def test_state_batch_with_ranges_not_one_per_sequence_is_refused_reserving_nothing(
        starts, ends, device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    c.add_sequence("b", list(range(1000, 1070)))
    free = c.states.num_free
    with pytest.raises(ValueError, match="starts and ends must each give one token index per "
                                         "sequence \\(2\\)"):
        c.state_batch(["a", "b"], starts, ends)
    assert c.states.num_free == free
    assert compute(c, "a", 0, 130) == [128]  # the checkpoint slots are all still there
    c.check()


@pytest.mark.parametrize(("start", "end"), [(0, 300), (-1, 64), (70, 64)])
def test_state_batch_with_a_range_outside_the_tokens_held_is_refused(start, end, device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    with pytest.raises(ValueError, match=f"sequence 'a' holds 130 tokens: its range must be "
                                         f"0 <= start <= end <= 130, got \\[{start}, {end}\\)"):
        c.state_batch(["a"], [start], [end])
    c.commit("a")
    c.check()
    assert compute(c, "a", 0, 130) == [128]


def test_state_batch_with_a_range_bound_that_is_not_an_int_is_refused(device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    free = c.states.num_free
    with pytest.raises(TypeError, match="sequence 'a': the start and end of its range must "
                                        "be ints, got bool False and bool True"):
        c.state_batch(["a"], [False], [True])
    assert c.states.num_free == free
    c.check()


def test_state_batch_listing_a_sequence_twice_is_refused(device):
    c = cache(device=device)
    c.add_sequence("a", list(range(130)))
    free = c.states.num_free
    with pytest.raises(ValueError, match="state_batch lists a sequence more than once"):
        c.state_batch(["a", "a"], [0, 0], [130, 130])
    assert c.states.num_free == free
    c.commit("a")
    c.check()
    assert compute(c, "a", 0, 130) == [128]


PAGE, INTERVAL, TRACK = 2, 4, 8


class HybridPrefixMachine(RuleBasedStateMachine):
    """Sequences over two token alphabets (so prefixes are shared) are added, computed in
    chunks (reserving and committing checkpoints), decoded across track intervals, forked
    and freed, while KV pages and checkpoints are evicted; check() after every step."""

    def __init__(self):
        super().__init__()
        self.cache = cache(num_pages=40, page_size=PAGE, interval=INTERVAL, track=TRACK,
                           num_checkpoint_slots=4, device="cpu")
        self.computed = {}  # seq id -> tokens computed
        self.next_id = 0

    @rule(base=st.integers(0, 1), n=st.integers(1, 30))
    def add(self, base, n):
        self._add([base * 100 + i for i in range(n)])

    @rule(base=st.integers(0, 1), n=st.integers(1, 30))
    def run_a_prompt_alone(self, base, n):
        """Add, compute, commit and free at once: what a short request does."""
        seq_id = self._add([base * 100 + i for i in range(n)])
        if seq_id is not None:
            self.cache.state_batch([seq_id], [self.computed[seq_id]], [n])
            self.cache.commit(seq_id)
            self.cache.free_sequence(seq_id)
            del self.computed[seq_id]

    def _add(self, tokens):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        prefix_cache = self.cache.prefix_cache
        n = len(tokens)
        kv = len(prefix_cache.match(pack_tokens(tokens), (n - 1) // PAGE).pages) * PAGE
        try:
            hit = self.cache.add_sequence(seq_id, tokens)
        except (OutOfPages, OutOfStateSlots):
            return None
        assert hit <= kv and hit % INTERVAL == 0
        self.computed[seq_id] = hit
        return seq_id

    @precondition(lambda self: any(n < self.cache.num_tokens(s)
                                   for s, n in self.computed.items()))
    @rule(data=st.data())
    def step(self, data):
        seq_id = data.draw(st.sampled_from([s for s, n in self.computed.items()
                                            if n < self.cache.num_tokens(s)]))
        start, total = self.computed[seq_id], self.cache.num_tokens(seq_id)
        end = data.draw(st.integers(start + 1, total))
        batch = self.cache.state_batch([seq_id], [start], [end])
        assert all(start < r.num_tokens <= end for r in batch.checkpoints)
        self.computed[seq_id] = end
        if end == total:
            self.cache.commit(seq_id)

    @precondition(lambda self: any(n == self.cache.num_tokens(s)
                                   for s, n in self.computed.items()))
    @rule(data=st.data())
    def decode(self, data):
        seq_id = data.draw(st.sampled_from([s for s, n in self.computed.items()
                                            if n == self.cache.num_tokens(s)]))
        try:
            self.cache.append(seq_id, token_ids=[data.draw(st.integers(0, 200))])
        except OutOfPages:
            return

    @precondition(lambda self: self.computed)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.computed)))
        child, self.next_id = self.next_id, self.next_id + 1
        try:
            self.cache.fork(parent, child)
        except OutOfStateSlots:
            return
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.computed)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.computed)))
        self.cache.free_sequence(seq_id)
        del self.computed[seq_id]

    @rule(n=st.integers(1, 6))
    def evict_pages(self, n):
        self.cache.evict(n)

    @rule(n=st.integers(1, 2))
    def evict_checkpoints(self, n):
        self.cache.state.checkpoints.evict(n)

    @invariant()
    def consistent(self):
        self.cache.check()
        assert self.cache.sequences() == list(self.computed)


TestHybridPrefixMachine = HybridPrefixMachine.TestCase
TestHybridPrefixMachine.settings = settings(max_examples=examples(60), stateful_step_count=40,
                                            deadline=None)
