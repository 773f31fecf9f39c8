"""KVCache over layers that all attend through a sliding window: the pages that fall out of
the window go back as sequences grow, and prefix caching stays whole."""

from __future__ import annotations

import pytest
import torch

from kvpool.cache import HOLE, KVCache
from kvpool.errors import OutOfPages
from kvpool.memory.layout import KVLayout

WINDOW, PAGE_SIZE = 8, 4
HELD = -(-WINDOW // PAGE_SIZE) + 1  # pages a decoding sequence holds at most


def cache(num_pages=16, windows=(WINDOW, WINDOW), *, device, **kwargs) -> KVCache:
    layout = KVLayout(len(windows), 1, 2, torch.float32, PAGE_SIZE, layer_windows=windows)
    return KVCache(layout, num_pages, device=device, **kwargs)


def held(c: KVCache, seq_id) -> list[int]:
    return [page for page in c.pages(seq_id) if page != HOLE]


def test_a_decoding_sequence_holds_at_most_its_window_plus_one_page(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=3)
    for _ in range(40):
        c.append("a")
        assert len(held(c, "a")) <= HELD
        c.check()
    assert c.num_tokens("a") == 43 and len(c.pages("a")) == 11
    assert c.num_free_pages == 16 - len(held(c, "a"))


def test_an_append_gives_back_exactly_the_pages_before_its_first_tokens_window(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=20)  # pages 0-4
    c.append("a", 6)  # first new token at 20 attends to 13..20: pages 0-2 are out
    assert c.pages("a")[:4] == [HOLE, HOLE, HOLE, c.pages("a")[3]]
    assert len(held(c, "a")) == 4


def test_stats_count_only_the_tokens_of_pages_still_held(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=20)
    c.append("a", 6)  # pages 0-2 go back: 14 of the 26 tokens are in the 4 pages held
    s = c.stats()
    assert (s.num_used_pages, s.num_tokens) == (4, 14)
    assert s.kv_utilization == 14 / 16


def test_one_pool_of_layers_with_different_windows_keeps_the_widest(device):
    c = cache(windows=(4, 16), device=device)
    assert c.page_groups[0].window == 16
    c.add_sequence("a", num_tokens=20)
    c.append("a")  # token 20 attends to 5..20 in the 16-token layer: only page 0 goes
    assert c.pages("a")[0] == HOLE and HOLE not in c.pages("a")[1:]
    c.check()


def test_scrub_on_free_zeroes_the_pages_given_back_out_of_the_window(device):
    c = cache(scrub_on_free=True, device=device)
    c.add_sequence("a", num_tokens=12)
    slots = torch.tensor(c.slots("a"), device=c.device)
    k = torch.full((len(slots), 1, 2), 7.0, device=c.device)
    for layer in range(2):
        c.pool.write(layer, slots, k, -k)
    first, kept = c.pages("a")[:2]
    c.append("a")  # token 12 attends to 5..12: page 0 goes back
    assert c.pages("a")[0] == HOLE
    assert torch.count_nonzero(c.pool.kv[:, :, first]) == 0
    assert torch.count_nonzero(c.pool.kv[:, :, kept]) > 0


def test_page_tables_show_given_back_pages_as_page_0(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 1)
    pages = c.pages("a")
    assert pages[0] == HOLE
    assert c.page_tables(["a"]).tolist() == [[0, *pages[1:]]]


def test_slots_of_given_back_tokens_are_holes(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 1)
    assert c.slots("a")[:PAGE_SIZE] == [HOLE] * PAGE_SIZE
    assert HOLE not in c.slots("a")[PAGE_SIZE:]


def test_slot_mapping_of_given_back_tokens_is_refused(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 1)
    with pytest.raises(ValueError, match=r"\[2, 13\) .* first 4 tokens"):
        c.slot_mapping(["a"], [2], [13])


def test_a_layout_with_a_full_layer_gives_nothing_back(device):
    c = cache(windows=(WINDOW, None), device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 20)
    assert HOLE not in c.pages("a") and c.groups[0].window is None


def test_free_out_of_window_false_keeps_every_page(device):
    c = cache(free_out_of_window=False, device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 20)
    assert HOLE not in c.pages("a")


def test_fork_and_free_after_a_drop_give_every_page_back(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=12)
    c.append("a", 1)
    c.fork("a", "b")
    c.append("b", 4)
    c.check()
    c.free_sequence("a")
    c.free_sequence("b")
    c.check()
    assert c.num_free_pages == 16


def prefilled(c: KVCache, seq_id, tokens: list[int]) -> None:
    c.add_sequence(seq_id, tokens)
    c.commit(seq_id)


def test_the_first_drop_of_a_cached_sequence_copies_its_tree_pages_in_the_window(device):
    c = cache(prefix_caching=True, device=device)
    prompt = list(range(16))
    prefilled(c, "a", prompt)  # 4 pages, all in the tree
    tree = c.pages("a")
    for i, page in enumerate(tree):
        c.pool.kv[:, :, page] = i + 1
    # the token at 16 attends to 9..16: pages 0-1 go, tree pages 2-3 are copied
    assert c.pages_to_append("a") == 1 + 2
    c.append("a", token_ids=[7])
    pages = c.pages("a")
    assert pages[:2] == [HOLE, HOLE] and set(pages[2:4]).isdisjoint(tree)
    assert torch.equal(c.pool.kv[:, :, pages[2:4]], c.pool.kv[:, :, tree[2:4]])
    assert c.num_cached_pages == 4  # the tree keeps its pages whole
    c.check()


def test_a_prefix_hit_after_a_drop_is_served_whole(device):
    c = cache(prefix_caching=True, device=device)
    prompt = list(range(16))
    prefilled(c, "a", prompt)
    c.append("a", token_ids=[7] * 9)
    assert c.add_sequence("b", prompt + [1]) == 16
    c.check()


def test_check_fits_counts_the_copies_of_a_window_that_is_not_a_page_multiple(device):
    """A window of 7 tokens spans parts of 2 pages of 4: a lone 13-token sequence's first
    drop copies its 2 tree pages in the window beside its 4 pages."""
    small = cache(num_pages=5, windows=(7,), prefix_caching=True, device=device)
    with pytest.raises(OutOfPages, match=r"^13 tokens need 6 pages of 4 tokens; the pool "
                                         r"has 5$"):
        small.check_fits(13)
    c = cache(num_pages=6, windows=(7,), prefix_caching=True, device=device)
    c.check_fits(13)
    prefilled(c, "a", list(range(12)))
    c.append("a", token_ids=[99])
    c.check()


def test_with_steps_bounded_a_sequence_of_any_length_fits_once_its_window_and_two_steps_do(
        device):
    """Window 8, pages of 4, at most 4 tokens a step: an append holds the window, its own 4
    tokens and the 4 before, (8 + 2 * 4 - 3) // 4 + 2 = 5 pages; a first drop under prefix
    caching copies up to 2 more beside them."""
    small = cache(num_pages=4, max_tokens_per_step=4, device=device)
    small.check_fits(16)  # 4 pages: what fits without giving any back
    with pytest.raises(OutOfPages, match=r"^17 tokens need 5 pages of 4 tokens; the pool has 4$"):
        small.check_fits(17)
    with pytest.raises(OutOfPages, match=r"^1000000 tokens need 5 pages of 4 tokens; the pool "
                                         r"has 5 \(1 reserved\)$"):
        cache(num_pages=5, max_tokens_per_step=4, reserve=1, device=device).check_fits(10**6)
    c = cache(num_pages=5, max_tokens_per_step=4, device=device)
    c.check_fits(10**6)
    c.add_sequence("a", num_tokens=4)
    for _ in range(100):  # to 404 tokens, 20 times the pool's
        c.append("a", 4)
        assert len(held(c, "a")) <= 5
        c.check()
    cached = cache(num_pages=6, max_tokens_per_step=4, prefix_caching=True, device=device)
    with pytest.raises(OutOfPages, match=r"^1000000 tokens need 7 pages of 4 tokens; the pool "
                                         r"has 6$"):
        cached.check_fits(10**6)
    cache(num_pages=7, max_tokens_per_step=4, prefix_caching=True, device=device).check_fits(10**6)


def test_with_steps_bounded_a_prefix_hit_leaves_room_for_the_first_drop(device):
    """A hit is held whole until the sequence's first drop, which takes two steps' pages and
    the copies of its window beside it: in 9 pages, hits stop at 9 - 2 - 2 = 5 pages. The
    tree's path grows a page with each prompt entering on its hit and one step more."""
    c = cache(num_pages=9, max_tokens_per_step=4, prefix_caching=True, device=device)
    prompt = list(range(100))
    for i in range(6):
        c.add_sequence(i, prompt, entering=c.tokens_to_admit(prompt, 4))
        c.commit(i)
        c.free_sequence(i)
        c.check()
    assert c.prefix_cache.num_pages == 6
    assert c.prefix_hit(prompt) == 5 * PAGE_SIZE
    assert c.add_sequence("long", prompt, entering=c.tokens_to_admit(prompt, 4)) == 20
    unbounded = cache(num_pages=9, prefix_caching=True, device=device)
    for i in range(6):
        unbounded.add_sequence(i, prompt, entering=unbounded.tokens_to_admit(prompt, 4))
        unbounded.commit(i)
        unbounded.free_sequence(i)
    assert unbounded.prefix_hit(prompt) == 6 * PAGE_SIZE


def test_tokens_to_admit_are_the_prefix_hit_and_the_budget(device):
    c = cache(num_pages=32, prefix_caching=True, device=device)
    prompt = list(range(40))
    prefilled(c, "a", prompt[:20])
    c.free_sequence("a")
    assert c.prefix_hit(prompt) == 20
    assert c.tokens_to_admit(prompt, 4) == 24
    assert c.tokens_to_admit(prompt, 100) == 40
    assert c.tokens_to_admit(list(range(100, 140)), 4) == 4


def test_a_first_drop_whose_copies_do_not_fit_changes_nothing(device):
    c = cache(num_pages=4, prefix_caching=True, device=device)
    prefilled(c, "a", list(range(16)))
    before = (c.pages("a"), c.stats(), c.pool.kv.view(torch.uint8).clone())  # NaN-safe bytes
    with pytest.raises(OutOfPages):
        c.append("a", token_ids=[7])
    assert (c.pages("a"), c.stats()) == before[:2]
    assert torch.equal(c.pool.kv.view(torch.uint8), before[2])
    c.check()


def test_a_sequence_whose_fork_committed_its_pages_copies_them_at_its_first_drop(device):
    """The fork's commit puts pages the parent holds into the prefix index: when the parent
    drops the first of them, it must not keep holding the later ones."""
    c = cache(prefix_caching=True, device=device)
    c.add_sequence("a", list(range(11)))  # pages 0-2
    c.fork("a", "b")
    c.commit("b")  # pages 0-1 are indexed, and held by "a" too
    c.free_sequence("b")
    c.append("a", 1)  # token 11 attends to 4..11: page 0 goes back, page 1 is copied
    assert c.pages("a")[0] == HOLE and not c.allocator.is_cached(c.pages("a")[1])
    c.check()


def test_a_fork_that_commits_after_its_parent_dropped_pages_leaves_the_parent_whole(device):
    c = cache(prefix_caching=True, device=device)
    c.add_sequence("a", list(range(11)))  # pages 0-2
    c.fork("a", "b")
    c.append("a", 1)  # token 11 attends to 4..11: page 0 goes back, pages 1-2 copied
    c.commit("b")  # indexes "b"'s pages 0-1, which "a" no longer holds
    c.free_sequence("b")
    c.append("a", 8)
    c.check()
