"""KVCache over two page groups: a full-attention pool and a sliding-window pool behind one
sequence API."""

import pytest
import torch

from kvpool.cache import HOLE, KVCache
from kvpool.errors import OutOfPages, SequenceTooLong
from kvpool.memory.layout import KVLayout

PAGE_SIZE = 4
WINDOW = 8
FULL, SLIDING = 0, 1  # group indexes: full attention comes first


def layout(windows=(None, WINDOW, WINDOW, None)) -> KVLayout:
    return KVLayout(num_layers=len(windows), num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    page_size=PAGE_SIZE, layer_windows=windows)


def cache(num_pages=(16, 8), *, device, **kwargs) -> KVCache:
    return KVCache(layout(), num_pages, device=device, **kwargs)


def held(c: KVCache, seq_id, group: int) -> list[int]:
    return [p for p in c.pages(seq_id, group) if p != HOLE]


def test_each_group_has_a_pool_of_its_layers_and_the_model_layers_map_to_them(device):
    c = cache(device=device)
    assert [pool.layout.num_layers for pool in c.kv_pools.pools] == [2, 2]
    assert [pool.num_pages for pool in c.kv_pools.pools] == [16, 8]
    assert c.kv_pools.where == ((FULL, 0), (SLIDING, 0), (SLIDING, 1), (FULL, 1))
    assert c.groups[SLIDING].window == WINDOW and c.groups[FULL].window is None


def test_each_groups_pool_sets_its_own_padding_page_apart(device):
    c = KVCache(layout(), (16, 8), device=device)
    pools = c.kv_pools.pools
    assert [(pool.padding_page, pool.padding_slot) for pool in pools] == [(16, 64), (8, 32)]
    assert c.kv_pools.nbytes == (16 + 1 + 8 + 1) * layout().groups[FULL].bytes_per_token * PAGE_SIZE
    stats = c.stats()
    assert (stats.num_pages, stats.num_used_pages, stats.num_reserved_pages) == (24, 0, 2)
    c.check()


def test_a_layout_of_one_group_given_by_pool_sizes_has_one_group_of_its_kind(device):
    c = KVCache(layout((WINDOW, WINDOW)), (8,), device=device)
    assert [g.window for g in c.groups] == [WINDOW] and c.kv_pools.where == ((0, 0), (0, 1))


def test_pool_sizes_must_name_every_group(device):
    with pytest.raises(ValueError, match="num_pages gives 1 pool sizes for 2 layer groups"):
        KVCache(layout(), (8,), device=device)


def test_pools_that_give_pages_back_are_refused_with_free_out_of_window_false(device):
    for windows, sizes in (((None, WINDOW, WINDOW, None), (16, 8)), ((WINDOW, WINDOW), (8,))):
        with pytest.raises(ValueError, match=r"free_out_of_window=False keeps every page in "
                                             r"one pool: give num_pages as one int"):
            KVCache(layout(windows), sizes, device=device, free_out_of_window=False)


def test_a_decoding_sequence_holds_every_page_in_the_full_pool_and_a_window_in_the_other(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=5)
    for _ in range(30):
        c.append("a")
        c.check()
        assert len(held(c, "a", SLIDING)) <= -(-WINDOW // PAGE_SIZE) + 1
    assert len(held(c, "a", FULL)) == -(-35 // PAGE_SIZE) == 9
    assert c.pages("a", SLIDING)[:6] == [HOLE] * 6


def test_append_returns_the_new_tokens_slots_in_the_first_group(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=4)
    slots = c.append("a", 2)
    assert slots == c.slots("a", FULL)[4:] and c.slots("a", SLIDING)[4:6] != [HOLE] * 2


def test_an_append_the_window_pool_cannot_take_changes_neither_pool(device):
    c = cache(num_pages=(16, 2), device=device)
    c.add_sequence("a", num_tokens=8)  # both window pages
    before = (c.pages("a", FULL), c.pages("a", SLIDING), c.stats())
    with pytest.raises(OutOfPages,
                       match=r"window 8 pool: need 1 pages, 0 free \(0 reserved\), 0 evictable"):
        c.append("a")
    assert (c.pages("a", FULL), c.pages("a", SLIDING), c.stats()) == before
    assert not c.can_append("a")


def test_append_batch_grows_every_sequence_in_every_group_or_none(device):
    c = cache(num_pages=(16, 3), device=device)
    c.add_sequence("a", num_tokens=4)
    c.add_sequence("b", num_tokens=4)
    with pytest.raises(OutOfPages, match="window 8 pool: need 2 pages, 1 free"):
        c.append_batch(["a", "b"])
    assert c.num_tokens("a") == c.num_tokens("b") == 4
    c.free_sequence("b")
    assert c.append_batch(["a"], [3]) == c.slots("a", FULL)[4:]
    c.check()


def test_append_batch_copies_a_partial_page_shared_by_forks_only_while_another_holds_it(device):
    c = cache(num_pages=(16, 3), device=device)
    c.add_sequence("a", num_tokens=6)  # two window pages, the second partial
    c.fork("a", "b")
    # a copies the shared partial page, b then holds the original alone: one page, not two
    c.append_batch(["a", "b"])
    assert c.groups[SLIDING].allocator.num_free == 0
    assert c.pages("a", SLIDING)[1] != c.pages("b", SLIDING)[1]
    c.check()


def test_a_prompt_entering_by_chunks_needs_room_for_all_of_it_in_the_full_pool_only(device):
    c = cache((6, 3), device=device)  # the full pool: 24 tokens; the window pool: 12
    prompt = list(range(40))
    assert c.can_add(prompt[:20], entering=8) and not c.can_add(prompt[:28], entering=8)
    assert not c.can_add(prompt[:20])  # all 20 tokens at once need 5 window pages of 3
    assert c.num_free_pages == 9 and c.sequences() == []


def test_check_fits_names_the_pool_a_sequence_overflows(device):
    c = cache(num_pages=(16, 4), device=device)
    c.check_fits(16)
    with pytest.raises(OutOfPages, match="^window 8 pool: 17 tokens need 5 pages of 4 tokens; "
                                         "the pool has 4$"):
        c.check_fits(17)


def test_can_add_asks_every_pool(device):
    c = cache(num_pages=(16, 3), device=device)
    assert c.can_add(list(range(12)))
    assert not c.can_add(list(range(13)))
    assert not c.can_add(list(range(12)), spare_pages=1)


def test_the_length_limit_applies_to_the_sequence_in_every_group(device):
    c = cache(max_tokens_per_seq=10, device=device)
    c.add_sequence("a", num_tokens=9)
    with pytest.raises(SequenceTooLong, match="would hold 11 tokens, over the limit of 10"):
        c.append("a", 2)
    c.check()


def test_stats_sum_the_pools_and_group_stats_give_each(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=20)
    full, window = c.group_stats()
    assert (full.num_used_pages, window.num_used_pages) == (5, 5)
    s = c.stats()
    assert (s.num_pages, s.num_used_pages, s.num_free_pages) == (24, 10, 14)
    assert s.num_tokens == 40  # 20 tokens in each pool
    assert c.num_pages == 24 and c.num_available_pages == 14


def prefill(c: KVCache, seq_id, tokens: list[int]) -> int:
    """Add a prompt, write nothing (the values do not matter here), commit it."""
    hit = c.add_sequence(seq_id, tokens)
    c.commit(seq_id)
    return hit


PROMPT = list(range(17))  # four full pages and one token


def test_a_prefix_hit_is_served_by_every_group(device):
    c = cache(prefix_caching=True, device=device)
    prefill(c, "a", PROMPT)
    c.free_sequence("a")
    assert prefill(c, "b", PROMPT) == 16
    assert c.stats().prefix_hit_tokens == 16 and c.stats().prefix_query_tokens == 34
    c.check()


def test_a_hit_is_bounded_by_the_group_that_evicted_its_pages(device):
    c = cache(prefix_caching=True, device=device)
    prefill(c, "a", PROMPT)
    c.free_sequence("a")
    c.groups[SLIDING].prefix_cache.evict(2)  # the window pool's last two cached pages
    assert prefill(c, "b", PROMPT) == 8
    full, window = c.group_stats()
    assert (full.prefix_hit_tokens, window.prefix_hit_tokens) == (16, 8)  # each group's match
    c.check()


def test_recomputed_tokens_of_a_longer_match_write_to_the_padding_page_not_the_shared_one(
        device):
    c = cache(prefix_caching=True, device=device)
    prefill(c, "a", PROMPT)
    c.free_sequence("a")
    c.groups[SLIDING].prefix_cache.evict(2)
    hit = prefill(c, "b", PROMPT)
    scratch = c.groups[FULL].pool.padding_slot
    full = c.slot_mapping(["b"], [hit], [17], group=FULL).tolist()
    window = c.slot_mapping(["b"], [hit], [17], group=SLIDING).tolist()
    assert full == [scratch] * 8 + c.slots("b", FULL)[16:]  # tokens 8-15 are shared pages
    assert window == c.slots("b", SLIDING)[8:]  # the window pool computes them anew


def test_a_window_sequence_that_dropped_pages_is_no_longer_matched_past_its_committed_prompt(
        device):
    c = cache(num_pages=(32, 16), prefix_caching=True, device=device)
    prefill(c, "a", PROMPT)
    for token in range(17, 40):
        c.append("a", token_ids=[token])
        c.commit("a")
    c.free_sequence("a")
    # the full pool caches all 39 tokens' pages; the window pool only the prompt's
    assert prefill(c, "b", list(range(40))) == 16
    c.check()


def test_fork_shares_the_pages_of_every_group(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=10)
    c.fork("a", "b")
    assert c.pages("b", FULL) == c.pages("a", FULL)
    assert c.pages("b", SLIDING) == c.pages("a", SLIDING)
    c.free_sequence("a")
    c.free_sequence("b")
    assert c.num_free_pages == 24
    c.check()


def test_set_last_token_records_the_id_in_every_group(device):
    c = cache(device=device, prefix_caching=True)
    c.add_sequence("a", list(range(7)))
    c.append("a", token_ids=[-1])
    c.set_last_token("a", 7)
    c.commit("a")
    assert c.prefix_hit(list(range(9))) == 8
