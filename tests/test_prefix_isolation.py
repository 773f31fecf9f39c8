"""Cache salts: sequences share cached prefix pages only with sequences of the same salt, on
the device and through a tier, and a salt's part of the prefix tree leaves with its pages."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import examples
from hybrid_util import hybrid_cache
from kvpool.cache import KVCache
from kvpool.cache.tiers import HostTier
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout

PS = 4
PROMPT = list(range(100, 109))  # 9 tokens: two full pages can be served


def make_cache(device, num_pages=8, **kw) -> KVCache:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=PS)
    return KVCache(layout, num_pages, device=device, prefix_caching=True, **kw)


def run(cache, seq_id, salt=None, prompt=PROMPT) -> int:
    """Add, commit and free a sequence; returns the tokens the prefix cache served it."""
    hit = cache.add_sequence(seq_id, prompt, cache_salt=salt)
    cache.commit(seq_id)
    cache.free_sequence(seq_id)
    cache.check()
    return hit


def test_a_prefix_is_served_only_to_sequences_of_the_same_salt(device):
    cache = make_cache(device)
    assert run(cache, "a1", "alice") == 0
    assert run(cache, "b1", "bob") == 0  # the same prompt, another salt: nothing revealed
    assert run(cache, "u1") == 0  # unsalted sequences have their own tree too
    assert cache.prefix_hit(PROMPT, cache_salt="alice") == 8
    assert cache.prefix_hit(PROMPT, cache_salt="mallory") == 0
    assert run(cache, "a2", "alice") == 8
    assert run(cache, "b2", "bob") == 8
    assert run(cache, "u2") == 8
    assert cache.pages_to_add(PROMPT, cache_salt="carol") == 3


def test_every_salted_query_refuses_a_salt_that_is_not_a_str(device):
    cache = make_cache(device, max_tokens_per_seq=4)  # PROMPT is over it: can_add says no
    queries = [lambda salt: cache.prefix_hit(PROMPT, cache_salt=salt),
               lambda salt: cache.tokens_to_admit(PROMPT, 8, cache_salt=salt),
               lambda salt: cache.can_add(PROMPT, cache_salt=salt),
               lambda salt: cache.pages_to_add(PROMPT, cache_salt=salt)]
    for query in queries:
        for salt in (123, b"tenant", ["a"]):
            with pytest.raises(TypeError, match="cache_salt must be a str or None"):
                query(salt)


def test_a_fork_keeps_its_parents_salt(device):
    cache = make_cache(device)
    cache.add_sequence("a", PROMPT, cache_salt="alice")
    cache.fork("a", "a-child")
    cache.append("a-child", token_ids=[7, 7, 7])  # 12 tokens: three full pages
    cache.commit("a-child")
    assert cache.prefix_hit([*PROMPT, 7, 7, 7, 1], cache_salt="alice") == 12
    assert cache.prefix_hit([*PROMPT, 7, 7, 7, 1]) == 0
    cache.check()


def test_a_salts_root_leaves_the_tree_when_its_pages_are_reused(device):
    cache = make_cache(device, num_pages=3)
    run(cache, "a", "alice")  # two cached pages under alice's root
    cache.add_sequence("x", num_tokens=12)  # takes every page: alice's are evicted
    cache.commit("x")
    cache.free_sequence("x")
    run(cache, "u", prompt=list(range(9)))  # reuses the pages: the walk drops alice's nodes
    assert list(cache.prefix_cache._roots) == [b""]
    cache.check()


def test_tier_keys_are_salted(device):
    tier = HostTier(8)
    cache = make_cache(device, num_pages=3, tier=tier)
    run(cache, "a", "alice")
    cache.add_sequence("x", num_tokens=12)  # alice's two pages move to the tier
    cache.free_sequence("x")
    assert cache.stats().num_tier_stores == 2
    assert run(cache, "b", "bob") == 0
    assert run(cache, "u") == 0
    assert cache.stats().num_tier_loads == 0
    cache.add_sequence("x", num_tokens=12)  # bob's and the unsalted pages go too
    cache.free_sequence("x")
    assert run(cache, "a2", "alice") == 8
    assert cache.stats().num_tier_loads == 2


def test_a_grouped_cache_salts_every_group(device):
    windows = (None, 8)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=PS, layer_windows=windows)
    cache = KVCache(layout, (16, 8), device=device, prefix_caching=True)
    cache.add_sequence("a", PROMPT, cache_salt="alice")
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.prefix_hit(PROMPT, cache_salt="bob") == 0
    assert cache.can_add(PROMPT, cache_salt="bob")
    assert cache.add_sequence("b", PROMPT, cache_salt="bob") == 0
    assert cache.prefix_hit(PROMPT, cache_salt="alice") == 8
    cache.check()


def make_hybrid_cache(device) -> KVCache:
    """A hybrid cache checkpointing every page (PROMPT: a checkpoint after 8 tokens)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=PS)
    states = MambaLayout(num_layers=1, conv_dim=2, conv_kernel=2, num_heads=1, head_dim=2,
                         state_size=2, dtype=torch.float32)
    return hybrid_cache(layout, 16, states, 2, device=device, prefix_caching=True,
                        num_checkpoint_slots=2, checkpoint_interval=PS, track_interval=PS)


def prefill(cache, seq_id, salt=None) -> int:
    """Add PROMPT, compute it in one step (reserving its checkpoints), commit and free it;
    returns the checkpoints the step reserved."""
    cache.add_sequence(seq_id, PROMPT, cache_salt=salt)
    batch = cache.state_batch([seq_id], [0], [len(PROMPT)])
    cache.commit(seq_id)
    cache.free_sequence(seq_id)
    cache.check()
    return len(batch.checkpoints)


def test_a_salted_hybrid_sequence_shares_kv_of_its_salt_and_uses_no_checkpoint(device):
    cache = make_hybrid_cache(device)
    assert cache.add_sequence("a", PROMPT, cache_salt="alice") == 0
    cache.commit("a")
    pages = cache.pages("a")
    cache.free_sequence("a")
    assert len(cache.state.checkpoints) == 0
    assert cache.add_sequence("b", PROMPT, cache_salt="alice") == 0  # no checkpoint served
    assert cache.pages("b")[:8 // PS] == pages[:8 // PS]  # but the salt's KV pages shared
    assert cache.add_sequence("c", PROMPT) == 0
    assert set(cache.pages("c")).isdisjoint(pages)
    cache.check()


def test_a_salted_hybrid_sequence_is_not_served_a_checkpoint_of_the_same_content(device):
    cache = make_hybrid_cache(device)
    assert prefill(cache, "u") == 1  # an unsalted checkpoint after 8 tokens
    assert prefill(cache, "a1", "alice") == 0  # alice's own KV pages of the prompt
    assert cache.prefix_hit(PROMPT, cache_salt="alice") == 0
    assert cache.add_sequence("a2", PROMPT, cache_salt="alice") == 0
    cache.check()


def test_a_salted_hybrid_sequence_makes_no_checkpoint_over_unsalted_pages_of_its_prompt(device):
    cache = make_hybrid_cache(device)
    cache.add_sequence("u", PROMPT)  # unsalted KV pages of the prompt, no checkpoint
    cache.commit("u")
    cache.free_sequence("u")
    assert prefill(cache, "a", "alice") == 0
    assert len(cache.state.checkpoints) == 0
    assert cache.add_sequence("u2", PROMPT) == 0
    cache.check()


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, "alice", "bob"]),
                          st.integers(0, 12), st.booleans()), max_size=30))
def test_random_requests_only_ever_read_pages_of_their_own_salt(requests):
    """Each token's K value names its salt and its prefix, so a page served from another
    salt (on the device or through the tier) reads wrong; eviction is forced now and then."""
    cache = make_cache("cpu", num_pages=6, tier=HostTier(4))
    values: dict = {}

    def value(salt, tokens, pos):
        return float(values.setdefault((salt, tuple(tokens[:pos + 1])), len(values) + 1))

    for i, (salt, length, evict) in enumerate(requests):
        tokens = [5] * length + [i % 3]  # shared prefixes, of 0 to 3 full pages
        hit = cache.add_sequence(i, tokens, cache_salt=salt)
        slots = torch.tensor(cache.slots(i))
        k = cache.pool.k_cache(0).reshape(-1, 2)[slots, 0].tolist()
        assert k[:hit] == [value(salt, tokens, p) for p in range(hit)]
        fresh = torch.tensor([value(salt, tokens, p) for p in range(hit, len(tokens))])
        cache.pool.write(0, slots[hit:], fresh[:, None, None].expand(-1, 1, 2),
                         -fresh[:, None, None].expand(-1, 1, 2))
        cache.commit(i)
        cache.free_sequence(i)
        if evict:
            cache.add_sequence("fill", num_tokens=6 * PS)
            cache.free_sequence("fill")
        cache.check()
