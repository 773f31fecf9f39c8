"""KVCache behaviour, one rule per test, with exact page ids (a fresh allocator hands out
ids ascending from 0)."""

import pytest
import torch

from kvpool.cache import KVCache
from kvpool.cache.prefix_cache import PrefixCache, salt_key
from kvpool.cache.tiers import ROOT_KEY, PageKey
from kvpool.cache.tokens import pack_tokens
from kvpool.errors import (
    DuplicateSequence,
    InvalidPage,
    KVPoolError,
    OutOfPages,
    SequenceTooLong,
    UnknownSequence,
)
from kvpool.memory.allocator import PageAllocator
from kvpool.memory.layout import KVLayout

PS = 4


def make_cache(num_pages=8, *, device, **kw):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=PS)
    return KVCache(layout, num_pages, device=device, **kw)


def fill(cache, seq_id, start=0, value=None):
    """Write a distinct K value into every slot of the sequence from `start` on."""
    slots = torch.tensor(cache.slots(seq_id)[start:], device=cache.device)
    base = float(value if value is not None else hash(seq_id) % 1000)
    k = (base + torch.arange(len(slots), dtype=torch.float32, device=cache.device))
    k = k[:, None, None].expand(-1, 1, 2)
    for layer in range(2):
        cache.pool.write(layer, slots, k, -k)


def read(cache, seq_id, layer=0):
    """The K values of the sequence's tokens, read through its page table."""
    k = cache.pool.k_cache(layer).reshape(-1, 1, 2)
    return k[torch.tensor(cache.slots(seq_id), device=cache.device)][:, 0, 0].tolist()


def snapshot(cache):
    s = cache.stats()
    return (
        {sid: (cache.pages(sid), cache.num_tokens(sid)) for sid in cache.sequences()},
        [cache.allocator.refcount(p) for p in range(cache.allocator.num_pages)],
        (s.num_free_pages, s.num_cached_pages, s.num_used_pages, s.num_tokens,
         s.prefix_query_tokens, s.prefix_hit_tokens, s.num_evicted_pages, s.num_cow_copies),
        cache.pool.kv.clone(),
    )


def assert_unchanged(before, cache):
    after = snapshot(cache)
    assert before[:3] == after[:3]
    assert torch.equal(before[3].nan_to_num(), after[3].nan_to_num())
    cache.check()


# ---- page tables and slots ---------------------------------------------------------------

def test_add_sequence_takes_whole_pages_ascending(device):
    cache = make_cache(device=device)
    assert cache.add_sequence("a", num_tokens=9) == 0
    assert cache.pages("a") == [0, 1, 2]
    assert cache.num_tokens("a") == 9


def test_slots_follow_the_page_table(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=2)
    cache.add_sequence("b", num_tokens=6)
    assert cache.slots("b") == [4, 5, 6, 7, 8, 9]
    assert cache.append("a", 3) == [2, 3, 12]
    assert cache.pages("a") == [0, 3]


def test_append_within_a_page_takes_no_page(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=1)
    assert cache.append("a") == [1]
    assert cache.allocator.num_free == 7


def test_append_token_ids_sets_the_count(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", [1, 2])
    assert cache.append("a", token_ids=[3, 4, 5]) == [2, 3, 4]
    assert cache.num_tokens("a") == 5


def test_empty_sequence_holds_no_page(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=0)
    assert cache.pages("a") == []
    assert cache.append("a") == [0]


# ---- growing a batch of sequences in one call ---------------------------------------------


def test_append_batch_fills_each_partial_last_page_before_taking_new_pages(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=3)  # page 0, one slot left
    cache.add_sequence("b", num_tokens=4)  # page 1, full
    assert cache.append_batch(["a", "b"], [6, 2]) == [3, 8, 9, 10, 11, 12, 16, 17]
    assert cache.pages("a") == [0, 2, 3]
    assert cache.pages("b") == [1, 4]
    assert (cache.num_tokens("a"), cache.num_tokens("b")) == (9, 6)
    cache.check()


def test_append_batch_decode_takes_a_page_only_where_the_last_is_full(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=4)
    cache.add_sequence("b", num_tokens=5)
    cache.add_sequence("c", num_tokens=8)
    assert cache.append_batch(["a", "b", "c"]) == [5 * PS, 2 * PS + 1, 6 * PS]
    assert cache.pages("a") == [0, 5]
    assert cache.pages("b") == [1, 2]  # page 2 had room: no new page
    assert cache.pages("c") == [3, 4, 6]
    cache.check()


def test_append_batch_with_token_ids_keeps_the_sequences_cacheable(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", [1, 2, 3])
    cache.add_sequence("b", [5])
    assert cache.append_batch(["a", "b"], token_ids=[[4, 5], [6, 7, 8]]) == [3, 2 * PS, 5, 6, 7]
    cache.commit("a")
    cache.commit("b")
    cache.free_sequence("a")
    assert cache.add_sequence("c", [1, 2, 3, 4, 5]) == PS
    cache.check()


def test_append_batch_of_no_tokens_leaves_a_sequence_cacheable(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", list(range(2 * PS)))
    assert cache.append_batch(["a"], [0]) == []
    cache.commit("a")
    assert cache.prefix_hit(list(range(2 * PS + 1))) == 2 * PS
    cache.check()


@pytest.mark.parametrize("call", [
    lambda c: c.tokens_to_admit([1, "x"], 4),
    lambda c: c.tokens_to_admit("abc", 4),
    lambda c: c.can_add(None),
    lambda c: c.prefix_hit(None),
    lambda c: c.add_sequence("b", [1, 2], num_tokens="2"),
    lambda c: c.add_sequence("b", [1, 2], num_tokens=2.0),
], ids=["id-not-int", "str", "can_add-None", "prefix_hit-None", "count-str", "count-float"])
def test_prompt_queries_refuse_what_is_not_a_list_of_int_ids_by_type(call, device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", [1, 2, 3])
    with pytest.raises(TypeError, match="token"):
        call(cache)
    assert cache.sequences() == ["a"]
    cache.check()


def test_state_queries_on_a_cache_without_a_state_group_name_what_is_missing(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="no state group"):
        cache.state_slot("a")
    with pytest.raises(ValueError, match="no state group"):
        cache.state_batch(["a"])


def test_append_batch_copies_a_shared_partial_page_only_while_it_is_still_shared(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    fill(cache, "a", value=100)
    cache.fork("a", "b")
    assert cache.append_batch(["a", "b"]) == [2 * PS + 2, 1 * PS + 2]
    assert cache.pages("a") == [0, 2]  # a copied the shared page 1 first
    assert cache.pages("b") == [0, 1]  # b then held page 1 alone: no second copy
    assert read(cache, "a")[:6] == read(cache, "b")[:6] == [100, 101, 102, 103, 104, 105]
    assert cache.stats().num_cow_copies == 1
    assert cache.allocator.num_free == 5
    cache.check()


def test_append_batch_out_of_pages_changes_nothing(device):
    cache = make_cache(num_pages=4, device=device)
    cache.add_sequence("a", num_tokens=3)
    cache.add_sequence("b", num_tokens=4)
    before = snapshot(cache)
    with pytest.raises(OutOfPages):
        cache.append_batch(["a", "b"], [5, 5])  # a needs 2 pages, b 2: 4 > 2 free
    assert_unchanged(before, cache)


@pytest.mark.parametrize(("seq_ids", "kwargs", "error"), [
    (["a", "a"], {}, ValueError),
    (["a", "nobody"], {}, UnknownSequence),
    (["a", "b"], {"num_tokens": [1]}, ValueError),
    (["a", "b"], {"num_tokens": [1, -1]}, ValueError),
    (["a", "b"], {"num_tokens": [1, 2.0]}, TypeError),
    (["a", "b"], {"token_ids": [[1], [2**31]]}, ValueError),
    (["a", "b"], {"token_ids": [[1], [2]], "num_tokens": [1, 2]}, ValueError),
    (["a", "b"], {"num_tokens": [1, 30]}, SequenceTooLong),
])
def test_append_batch_bad_arguments_raise_and_change_nothing(seq_ids, kwargs, error, device):
    cache = make_cache(max_tokens_per_seq=20, device=device)
    cache.add_sequence("a", num_tokens=3)
    cache.add_sequence("b", num_tokens=4)
    before = snapshot(cache)
    with pytest.raises(error):
        cache.append_batch(seq_ids, **kwargs)
    assert_unchanged(before, cache)


def test_append_batch_with_token_granular_pages(device):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=1)
    cache = KVCache(layout, 16, device=device, prefix_caching=True)
    cache.add_sequence("a", [1, 2, 3])
    cache.add_sequence("b", [1, 2])
    assert cache.append_batch(["a", "b"], token_ids=[[4], [9, 9]]) == [5, 6, 7]
    assert cache.pages("a") == [0, 1, 2, 5]
    assert cache.pages("b") == [3, 4, 6, 7]
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.add_sequence("c", [1, 2, 3, 4, 8]) == 4  # every token but the last
    cache.check()


def test_page_tables_are_padded_int32(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=9)
    cache.add_sequence("b", num_tokens=1)
    tables = cache.page_tables(["b", "a"])
    assert tables.dtype == torch.int32 and tables.device.type == "cpu"
    assert tables.tolist() == [[3, 0, 0], [0, 1, 2]]


def test_slot_mapping_concatenates_token_ranges(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.add_sequence("b", num_tokens=3)
    mapping = cache.slot_mapping(["a", "b"], [4, 0], [6, 2])
    assert mapping.dtype == torch.int64 and mapping.device.type == "cpu"
    assert mapping.tolist() == [4, 5, 8, 9]


def test_slot_mapping_rejects_a_range_past_the_end(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=3)
    with pytest.raises(ValueError, match=r"\[0, 4\).*3 tokens"):
        cache.slot_mapping(["a"], [0], [4])


@pytest.mark.parametrize(("start", "end"), [(1.5, 4), (0, 2.0), (True, 4), (0, True)])
def test_slot_mapping_refuses_a_range_that_is_not_ints(device, start, end):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    with pytest.raises(TypeError, match="sequence 'a': start and end must be ints"):
        cache.slot_mapping(["a"], [start], [end])


def test_free_sequence_returns_its_pages(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=9)
    cache.free_sequence("a")
    assert cache.allocator.num_free == 8
    assert cache.sequences() == []
    cache.check()


# ---- fork and copy-on-write --------------------------------------------------------------

def test_fork_shares_every_page(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.fork("a", "b")
    assert cache.pages("b") == [0, 1]
    assert [cache.allocator.refcount(p) for p in (0, 1)] == [2, 2]
    assert sorted(cache.owners(1)) == ["a", "b"]
    cache.check()


def test_fork_then_append_copies_shared_partial_page(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    fill(cache, "a", value=100)
    cache.fork("a", "b")
    slots = cache.append("b")
    assert cache.pages("b") == [0, 2]  # page 1 was shared and partial: copied to page 2
    assert cache.pages("a") == [0, 1]
    assert slots == [2 * PS + 2]
    assert read(cache, "b")[:6] == read(cache, "a") == [100, 101, 102, 103, 104, 105]
    assert read(cache, "b", layer=1)[:6] == read(cache, "a", layer=1)
    assert cache.allocator.refcount(1) == 1 and cache.allocator.refcount(0) == 2
    assert cache.stats().num_cow_copies == 1
    cache.check()


def test_append_on_exclusive_page_copies_nothing(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    assert cache.append("a") == [6]
    assert cache.pages("a") == [0, 1]
    assert cache.stats().num_cow_copies == 0


def test_fork_then_append_on_full_page_takes_a_new_page_without_copy(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=8)
    cache.fork("a", "b")
    cache.append("b")
    assert cache.pages("b") == [0, 1, 2]
    assert cache.stats().num_cow_copies == 0


def test_after_one_side_copies_the_other_writes_in_place(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.fork("a", "b")
    cache.append("a")
    cache.append("b")
    assert cache.pages("a") == [0, 2]
    assert cache.pages("b") == [0, 1]
    assert cache.stats().num_cow_copies == 1


# ---- errors change nothing ---------------------------------------------------------------

def test_unknown_sequence_is_a_typed_error(device):
    cache = make_cache(device=device)
    for call in (lambda: cache.append("x"), lambda: cache.free_sequence("x"),
                 lambda: cache.fork("x", "y"), lambda: cache.commit("x"),
                 lambda: cache.pages("x")):
        with pytest.raises(UnknownSequence, match="'x'"):
            call()


def test_duplicate_sequence_is_a_typed_error_and_changes_nothing(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=5)
    cache.add_sequence("b", num_tokens=1)
    before = snapshot(cache)
    with pytest.raises(DuplicateSequence):
        cache.add_sequence("a", num_tokens=1)
    with pytest.raises(DuplicateSequence):
        cache.fork("a", "b")
    assert_unchanged(before, cache)


def test_sequence_too_long_names_the_limit_and_changes_nothing(device):
    cache = make_cache(max_tokens_per_seq=10, device=device)
    cache.add_sequence("a", num_tokens=9)
    before = snapshot(cache)
    with pytest.raises(SequenceTooLong, match="12 tokens.*limit of 10"):
        cache.append("a", 3)
    with pytest.raises(SequenceTooLong, match="11 tokens"):
        cache.add_sequence("b", num_tokens=11)
    assert_unchanged(before, cache)


def test_out_of_pages_on_add_names_the_numbers_and_changes_nothing(device):
    cache = make_cache(num_pages=4, device=device)
    cache.add_sequence("a", num_tokens=9)
    fill(cache, "a")
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free"):
        cache.add_sequence("b", num_tokens=5)
    assert_unchanged(before, cache)


def test_out_of_pages_on_copy_on_write_changes_nothing(device):
    cache = make_cache(num_pages=2, device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.fork("a", "b")
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="need 1 pages, 0 free"):
        cache.append("b")
    assert_unchanged(before, cache)


def test_reserve_is_kept_back(device):
    cache = make_cache(num_pages=4, reserve=1, device=device)
    cache.add_sequence("a", num_tokens=12)
    with pytest.raises(OutOfPages, match=r"1 reserved"):
        cache.append("a", 1)


def test_bad_counts_are_rejected(device):
    cache = make_cache(device=device)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        cache.add_sequence("a", num_tokens=-1)
    with pytest.raises(TypeError, match="num_tokens must be an int, got bool True"):
        cache.add_sequence("a", num_tokens=True)
    with pytest.raises(ValueError, match="disagrees"):
        cache.add_sequence("a", [1, 2], num_tokens=3)
    with pytest.raises(TypeError, match="sequence of ints"):
        cache.add_sequence("a", "hello")
    assert cache.sequences() == []


def test_bad_groups_budgets_and_pool_sizes_are_rejected_by_name(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", [1, 2, 3])
    for call in (lambda g: cache.pages("a", g), lambda g: cache.slots("a", g),
                 lambda g: cache.owners(0, g), lambda g: cache.page_tables(["a"], group=g),
                 lambda g: cache.slot_mapping(["a"], [0], [1], group=g)):
        with pytest.raises(ValueError, match=r"group must be in \[0, 0\], got -1"):
            call(-1)  # not the last group, as a tuple index would give
        with pytest.raises(ValueError, match=r"group must be in \[0, 0\], got 1"):
            call(1)
    with pytest.raises(ValueError, match="spare_pages must be >= 0, got -1"):
        cache.can_add([1, 2], spare_pages=-1)
    with pytest.raises(ValueError, match=r"entering must be in \[0, 2\], got 3"):
        cache.can_add([1, 2], entering=3)
    with pytest.raises(ValueError, match="budget must be >= 0, got -4"):
        cache.tokens_to_admit([1, 2, 3], -4)
    with pytest.raises(TypeError, match="num_pages must be an int or a sequence of ints, "
                                        "got float 4.0"):
        make_cache(4.0, device=device)
    assert cache.sequences() == ["a"]
    cache.check()


def test_bad_token_ids_name_the_position_and_change_nothing(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(6))
    cache.commit("a")
    before = snapshot(cache)
    with pytest.raises(TypeError, match=r"token id 2 is float 2\.5, expected an int"):
        cache.add_sequence("b", [0, 1, 2.5])
    with pytest.raises(ValueError, match=r"token id 1 is 2147483648, outside int32"):
        cache.add_sequence("b", [0, 2**31])
    with pytest.raises(TypeError, match="token id 0 is str"):
        cache.append("a", token_ids=["x"])
    with pytest.raises(TypeError, match="token id 0 is NoneType"):
        cache.pages_to_add([None])
    assert_unchanged(before, cache)
    assert cache.num_tokens("a") == 6 and cache.sequences() == ["a"]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize(("token_ids", "error", "message"), [
    ("abcd", TypeError, "token_ids must be a sequence of ints, got str"),
    ({1, 2}, TypeError, "token_ids must be a sequence of ints, got set"),
    ({1: 2}, TypeError, "token_ids must be a sequence of ints, got dict"),
    ([1, None], TypeError, "token id 1 is NoneType None, expected an int"),
    ([0.5], TypeError, "token id 0 is float 0.5, expected an int"),
    (torch.tensor([1.0, 2.0]), TypeError, "token id 0 is float 1.0, expected an int"),
    ([2**31], ValueError, "token id 0 is 2147483648, outside int32"),
])
def test_token_ids_are_checked_with_or_without_prefix_caching(prefix_caching, token_ids, error,
                                                              message, device):
    cache = make_cache(prefix_caching=prefix_caching, device=device)
    cache.add_sequence("a", prompt(2))
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        cache.add_sequence("b", token_ids)
    with pytest.raises(error, match=message):
        cache.append("a", token_ids=token_ids)
    assert_unchanged(before, cache)
    assert cache.sequences() == ["a"] and cache.num_tokens("a") == 2


def test_appending_zero_tokens_changes_nothing_and_keeps_caching(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(6))
    assert cache.append("a", 0) == []
    cache.append("a", token_ids=prompt(3, 6))
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.add_sequence("b", prompt(9)) == 8


def test_a_pool_past_int32_page_ids_is_refused_naming_the_limit(device):
    with pytest.raises(ValueError, match=r"num_pages must be in \[1, 2147483646\], "
                                         r"got 10000000000000"):
        make_cache(10**13, device=device)


def test_token_ids_may_be_any_sequence_of_integers(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", range(9))
    cache.commit("a")
    assert cache.add_sequence("b", tuple(range(9))) == 8
    assert cache.add_sequence("c", torch.arange(9).numpy()) == 8
    cache.append("c", token_ids=torch.tensor([7]).numpy())
    cache.check()


def test_errors_share_the_library_base_class(device):
    cache = make_cache(device=device)
    with pytest.raises(KVPoolError):
        cache.append("nope")


# ---- prefix cache ------------------------------------------------------------------------

def prompt(n, base=0):
    return list(range(base, base + n))


def test_committed_full_pages_are_served_to_a_later_prompt(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(10))
    fill(cache, "a", value=50)
    cache.commit("a")
    assert cache.add_sequence("b", prompt(10)) == 8
    assert cache.pages("b") == [0, 1, 3]
    assert read(cache, "b")[:8] == read(cache, "a")[:8]
    s = cache.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (20, 8)
    cache.check()


def test_a_last_token_appended_before_its_id_was_known_is_committed_with_its_id(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(7))
    cache.append("a", token_ids=[-1])  # a placeholder for a token still being sampled
    cache.set_last_token("a", prompt(8)[-1])
    cache.commit("a")
    assert cache.add_sequence("b", prompt(9)) == 8
    with pytest.raises(ValueError, match="outside int32"):
        cache.set_last_token("a", 2**40)
    cache.check()


def test_set_last_token_of_a_sequence_holding_no_token_is_refused_and_changes_nothing(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", [])
    with pytest.raises(ValueError, match="sequence 'a' holds no token"):
        cache.set_last_token("a", 5)
    assert cache.num_tokens("a") == 0
    cache.check()  # its ids are still as long as its tokens: none
    cache.append("a", token_ids=prompt(5))
    cache.commit("a")
    assert cache.prefix_hit(prompt(9)) == 4


def test_prefix_match_never_covers_the_last_token(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(8))
    cache.commit("a")
    assert cache.add_sequence("b", prompt(8)) == 4  # page 2 would hold the last token
    assert cache.pages("b") == [0, 2]


def test_uncommitted_pages_are_not_matched(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(10))
    assert cache.add_sequence("b", prompt(10)) == 0


def test_a_different_token_ends_the_match(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(12))
    cache.commit("a")
    other = prompt(12)
    other[5] = 99
    assert cache.add_sequence("b", other) == 4


def test_a_match_ends_at_the_first_different_page_of_a_run_though_later_pages_agree(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(12))  # one run of three pages
    cache.commit("a")
    cache.free_sequence("a")
    other = prompt(13)
    other[4:8] = [99] * 4  # the middle page differs, the third agrees again
    assert cache.prefix_hit(other) == 4
    assert cache.add_sequence("b", other) == 4
    assert cache.pages("b")[:2] == [0, 3]  # page 1 holds the K/V of other tokens
    cache.check()


def test_appended_token_ids_extend_the_key(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(3))
    cache.append("a", token_ids=[3, 4, 5])
    cache.commit("a")
    assert cache.add_sequence("b", prompt(7)) == 4


def test_append_without_token_ids_stops_caching_the_sequence(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(3))
    cache.append("a", 5)
    cache.commit("a")
    assert cache.prefix_cache.num_pages == 0


def test_freed_sequence_leaves_its_committed_pages_cached(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(10))
    cache.commit("a")
    cache.free_sequence("a")
    s = cache.stats()
    assert (s.num_free_pages, s.num_cached_pages, s.num_used_pages) == (6, 2, 0)
    assert [cache.allocator.refcount(p) for p in (0, 1)] == [0, 0]  # no sequence holds them
    assert cache.allocator.cached_pages() == [1, 0]  # the tail is the least worth keeping
    cache.check()


def test_same_content_computed_twice_at_once_is_cached_once(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(9))
    cache.add_sequence("b", prompt(9) + [7, 7, 7])
    cache.commit("a")
    cache.commit("b")
    # the tree holds a's copies; b keeps its own pages, uncached, to its end
    assert cache.pages("b") == [3, 4, 5]
    assert cache.prefix_cache.num_pages == 2
    cache.append("b", token_ids=[8, 8, 8, 8])
    cache.commit("b")
    assert cache.prefix_cache.num_pages == 2
    cache.free_sequence("b")
    assert cache.stats().num_cached_pages == 0  # b's pages went back to the free list
    cache.check()


def test_forked_child_holds_pages_its_parent_commits_later(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(9))
    cache.fork("a", "b")
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.stats().num_cached_pages == 0  # b still holds them
    cache.free_sequence("b")
    assert cache.stats().num_cached_pages == 2
    cache.check()


def test_a_fork_grows_its_own_copy_of_its_parents_token_ids(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("p", prompt(4))
    cache.append("p", token_ids=[100])  # the parent's ids are its own now, not the prompt's
    cache.fork("p", "c")
    cache.append("p", token_ids=[300, 301, 302])
    cache.append("c", token_ids=[200, 201, 202])
    cache.check()
    cache.commit("c")
    assert cache.prefix_hit([*prompt(4), 100, 200, 201, 202, 9]) == 8
    assert cache.prefix_hit([*prompt(4), 100, 300, 301, 302, 9]) == 4
    cache.commit("p")
    assert cache.prefix_hit([*prompt(4), 100, 300, 301, 302, 9]) == 8
    cache.check()


def test_eviction_runs_when_pages_run_out_least_recently_used_first(device):
    cache = make_cache(num_pages=5, prefix_caching=True, device=device)
    for sid, base in (("a", 0), ("b", 100)):
        cache.add_sequence(sid, prompt(8, base))
        cache.commit(sid)
        cache.free_sequence(sid)
    assert cache.add_sequence("hit", prompt(9, 0)) == 8  # a hit refreshes a's pages
    cache.free_sequence("hit")
    cache.add_sequence("c", num_tokens=9)
    # one free page and two evicted: b's pages, the least recently used, leaf first
    assert sorted(cache.pages("c")) == [2, 3, 4]
    assert cache.stats().num_evicted_pages == 2
    assert len(cache.prefix_cache.match(pack_tokens(prompt(8, 0)), 2).pages) == 2
    assert cache.prefix_cache.match(pack_tokens(prompt(8, 100)), 2).pages == []
    cache.check()


def test_children_are_evicted_before_parents(device):
    cache = make_cache(num_pages=4, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(12))
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("c", num_tokens=4)
    assert cache.pages("c") == [3]  # the free page first
    cache.add_sequence("d", num_tokens=4)
    assert cache.pages("d") == [2]  # then the deepest cached page
    cache.free_sequence("c")
    assert cache.add_sequence("e", prompt(9)) == 8
    cache.check()


def test_eviction_skips_cached_pages_a_live_sequence_holds(device):
    cache = make_cache(num_pages=4, prefix_caching=True, device=device)
    for sid, base in (("a", 0), ("b", 100)):
        cache.add_sequence(sid, prompt(5, base))
        cache.commit(sid)
        cache.free_sequence(sid)
    assert cache.add_sequence("c", prompt(5, 0)) == 4  # holds a's page, the oldest
    cache.add_sequence("d", num_tokens=8)  # one free page + one evicted: b's
    assert len(cache.prefix_cache.match(pack_tokens(prompt(5, 0)), 1).pages) == 1
    assert cache.prefix_cache.match(pack_tokens(prompt(5, 100)), 1).pages == []
    cache.check()


def test_pages_of_a_live_sequence_are_never_evicted(device):
    cache = make_cache(num_pages=4, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(12))
    cache.commit("a")
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free.*0 evictable"):
        cache.add_sequence("b", num_tokens=8)
    assert_unchanged(before, cache)


def test_a_prefix_hit_pins_the_pages_it_reuses(device):
    cache = make_cache(num_pages=3, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(9))
    cache.commit("a")
    cache.free_sequence("a")
    # b reuses both cached pages and needs one more: the only free page, no eviction
    assert cache.pages_to_add(prompt(10)) == 3
    assert cache.add_sequence("b", prompt(10)) == 8
    assert cache.pages("b") == [0, 1, 2]
    assert cache.stats().num_evicted_pages == 0


def test_clear_drops_every_evictable_page(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(8))
    cache.commit("a")
    cache.add_sequence("b", prompt(8, 50))
    cache.commit("b")
    cache.free_sequence("a")
    cache.prefix_cache.clear()
    s = cache.stats()
    assert (s.num_cached_pages, s.num_used_pages) == (0, 2)
    cache.free_sequence("b")
    cache.prefix_cache.clear()
    assert cache.allocator.num_free == 8
    cache.check()


# ---- runs of pages in one node -----------------------------------------------------------

def test_a_committed_prompt_is_one_node_and_a_hit_inside_it_refreshes_only_its_pages(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    pc = cache.prefix_cache
    assert (pc.num_nodes, pc.num_pages) == (1, 4)
    cache.free_sequence("a")
    assert cache.add_sequence("b", prompt(9)) == 8  # two of the node's four pages
    assert pc.num_nodes == 1
    cache.check()
    # The unused half was not refreshed by the hit: it goes first, from its end.
    assert pc.evict(1) == [3]
    assert pc.evict(1) == [2]
    assert pc.evict(1) == []  # the hit's pages are held by "b"
    cache.check()


def test_commits_of_a_growing_sequence_extend_its_own_node(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(5))
    cache.commit("a")
    for token in range(5, 17):
        cache.append("a", token_ids=[token])
        cache.commit("a")
    assert (cache.prefix_cache.num_nodes, cache.prefix_cache.num_pages) == (1, 4)
    cache.free_sequence("a")
    assert cache.add_sequence("b", prompt(17)) == 16
    cache.check()


def test_prompts_that_part_inside_a_node_share_its_head(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.add_sequence("b", prompt(8) + prompt(9, 100)) == 8
    cache.commit("b")
    assert cache.pages("b") == [0, 1, 4, 5, 6]
    assert cache.prefix_cache.num_nodes == 3  # [0, 1] -> [2, 3] and [4, 5]
    cache.free_sequence("b")
    assert cache.allocator.cached_pages() == [3, 2, 5, 4, 1, 0]
    cache.check()


def test_pages_a_fork_shares_before_its_parent_commits_become_evictable_with_both(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(9))
    cache.fork("a", "b")
    cache.commit("a")  # caches pages 0 and 1, which "b" holds outside its cached path
    cache.free_sequence("a")
    assert cache.stats().num_cached_pages == 0
    cache.free_sequence("b")
    assert cache.stats().num_cached_pages == 2
    assert cache.prefix_cache.clear() == [1, 0]
    cache.check()


def test_a_fork_taken_before_its_parent_commits_holds_the_cached_path(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(9))
    cache.fork("a", "b")
    cache.commit("a")
    cache.append("b", token_ids=prompt(4, 9))
    cache.commit("b")  # b's first two pages are the tree's: its third goes below them
    assert cache.prefix_cache.num_pages == 3
    assert cache.prefix_cache.num_nodes == 1
    cache.check()


# ---- an evicted page leaves the prefix cache at once -----------------------------------

def test_an_evicted_page_leaves_the_tree_at_once(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    cache.free_sequence("a")
    pc = cache.prefix_cache
    assert pc.evict(2) == [3, 2]
    assert (pc.num_pages, pc.num_nodes) == (2, 1)
    assert pc.match(pack_tokens(prompt(16)), 4).pages == [0, 1]
    assert not pc.holds_path([0, 1, 2])
    cache.check()
    assert cache.add_sequence("b", prompt(16)) == 8
    cache.check()


def test_a_node_whose_pages_are_all_evicted_leaves_the_tree(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    cache.free_sequence("a")
    pc = cache.prefix_cache
    assert pc.clear() == [3, 2, 1, 0]
    assert (pc.num_pages, pc.num_nodes) == (0, 0)
    assert cache.add_sequence("b", prompt(16)) == 0
    cache.check()


def test_pages_evicted_by_an_allocation_leave_the_tree_before_it_returns(device):
    cache = make_cache(num_pages=4, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("b", prompt(8, 100))  # evicts a's last two pages to hold them
    pc = cache.prefix_cache
    assert cache.pages("b") == [3, 2]
    assert (pc.num_pages, pc.num_nodes) == (2, 1)
    cache.check()
    cache.commit("b")
    assert (pc.num_pages, pc.num_nodes) == (4, 2)
    cache.check()
    cache.free_sequence("b")
    assert cache.add_sequence("c", prompt(16)) == 8
    cache.check()


def test_evicting_both_branches_below_a_shared_head_keeps_the_head(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(16))
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("b", prompt(8) + prompt(9, 100))  # parts from a after two pages
    cache.commit("b")
    cache.free_sequence("b")
    pc = cache.prefix_cache
    assert pc.num_nodes == 3
    assert pc.evict(4) == [3, 2, 5, 4]  # both branches below the shared head
    assert (pc.num_nodes, pc.num_pages) == (1, 2)
    cache.check()
    assert cache.add_sequence("c", prompt(8) + prompt(9, 100)) == 8
    cache.check()


def test_eviction_hooks_get_the_pages_and_their_keys_before_the_tree_drops_them(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(12))
    cache.commit("a")
    cache.free_sequence("a")
    pc = cache.prefix_cache
    keys = chain_keys(prompt(12))
    seen, calls = [], []
    key_of = pc._evicted_keys

    def counted(pages):
        calls.append(pages)
        return key_of(pages)
    pc._evicted_keys = counted

    def hook(pages, page_keys):
        seen.append((pages, page_keys(), page_keys(), pc.num_pages))
    pc.evict_hooks += [hook, lambda pages, page_keys: seen.append(page_keys())]
    assert pc.evict(2) == [2, 1]
    # both hooks saw the keys, computed once, while the tree still listed the pages
    assert seen == [([2, 1], [keys[2], keys[1]], [keys[2], keys[1]], 3), [keys[2], keys[1]]]
    assert calls == [[2, 1]] and pc.num_pages == 1
    pc.evict_hooks.clear()
    pc.evict_hooks.append(lambda pages, page_keys: seen.append(pages))
    assert pc.evict(1) == [0]
    assert seen[-1] == [0] and pc.num_pages == 0
    assert calls == [[2, 1]]  # a hook that does not ask for keys costs none
    cache.check()


def test_evicted_pages_leave_the_tree_even_when_an_eviction_hook_raises(device):
    cache = make_cache(num_pages=4, prefix_caching=True, device=device)
    for seq_id, tokens in (("a", prompt(9)), ("b", prompt(5, 100))):
        cache.add_sequence(seq_id, tokens)
        cache.commit(seq_id)
        cache.free_sequence(seq_id)

    def broken(pages, keys):
        raise RuntimeError("out of memory")
    cache.prefix_cache.evict_hooks.append(broken)
    with pytest.raises(RuntimeError, match="out of memory"):  # hits b's page, evicts a's last
        cache.add_sequence("c", prompt(4, 100) + prompt(5, 7))
    s = cache.stats()
    assert cache.sequences() == [] and (s.num_used_pages, s.num_cached_pages) == (0, 2)
    assert [cache.allocator.refcount(p) for p in range(4)] == [0, 0, 0, 0]
    cache.check()
    cache.prefix_cache.evict_hooks.clear()
    assert cache.add_sequence("a", prompt(9)) == 4  # its first page, still cached


def test_an_add_that_fails_in_its_second_page_group_leaves_the_first_as_it_was(
        monkeypatch, device):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=PS, layer_windows=(None, 8))
    cache = KVCache(layout, [8, 8], device=device, prefix_caching=True)  # two page groups
    cache.add_sequence("a", prompt(9))
    cache.commit("a")
    before = snapshot(cache)

    def broken(*args):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(cache.groups[1], "add", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.add_sequence("b", prompt(9))
    assert_unchanged(before, cache)


def chain_keys(tokens):
    """The tier keys of the full pages of a prompt of `tokens`, chained from the root."""
    keys, parent = [], ROOT_KEY
    for start in range(0, len(tokens) - PS + 1, PS):
        keys.append(PageKey.of(parent, tokens[start:start + PS]))
        parent = keys[-1].chain_key
    return keys


def test_the_keys_of_a_run_evicted_in_parts_and_split_are_its_prefixes_chain_keys(device):
    cache = make_cache(num_pages=8, prefix_caching=True, device=device)
    seen = []
    cache.prefix_cache.evict_hooks.append(lambda pages, keys: seen.extend(keys()))
    first = prompt(24)
    cache.add_sequence("a", first)
    cache.commit("a")
    cache.free_sequence("a")
    cache.evict(2)  # the run's last two pages, its keys computed on the way
    second = first[:8] + prompt(8, 100)  # splits the run after its second page
    cache.add_sequence("b", second)
    cache.commit("b")
    cache.free_sequence("b")
    cache.check()
    cache.evict(cache.num_cached_pages)
    keys = chain_keys(first) + chain_keys(second)[2:]
    assert sorted(seen, key=keys.index) == keys
    cache.check()


def test_check_names_a_page_the_tree_lists_after_the_allocator_evicted_it(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(8))
    cache.commit("a")
    cache.free_sequence("a")
    cache.allocator.on_evict = None  # the tree no longer hears of evictions
    cache.allocator.evict(1)
    with pytest.raises(AssertionError, match=r"the tree lists pages \[1\] the allocator"):
        cache.prefix_cache.check()


def test_check_names_a_reference_count_the_page_tables_do_not_hold(device):
    cache = make_cache(num_pages=12, device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.check()
    cache.allocator.share([1])  # a reference no page table holds
    with pytest.raises(AssertionError, match="page 1 counts 2, held by 1"):
        cache.check()


def test_a_salted_root_leaves_with_its_last_evicted_page(device):
    cache = make_cache(num_pages=12, prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(8), cache_salt="key")
    cache.commit("a")
    cache.free_sequence("a")
    assert cache.prefix_cache.clear() == [1, 0]
    cache.check()  # no empty salted root is left
    assert cache.add_sequence("b", prompt(8), cache_salt="key") == 0
    cache.commit("b")
    cache.check()


# ---- probes and stats --------------------------------------------------------------------

def test_probes_predict_what_calls_take(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(6))
    cache.fork("a", "b")
    assert cache.pages_to_append("b", 1) == 1  # the copy of the shared partial page
    assert cache.pages_to_append("b", 3) == 2
    assert cache.pages_to_add(num_tokens=9) == 3
    assert cache.num_available_pages == 6


def test_stats_count_shared_slots_once(device):
    cache = make_cache(device=device)
    cache.add_sequence("a", num_tokens=6)
    cache.fork("a", "b")
    s = cache.stats()
    assert (s.num_used_pages, s.num_tokens, s.num_sequences) == (2, 6, 2)
    assert s.kv_utilization == 6 / 8


def test_kv_utilization_leaves_cached_pages_out(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", prompt(5))
    cache.commit("a")
    cache.free_sequence("a")  # page 0 stays cached
    cache.add_sequence("b", [9] * 5)
    s = cache.stats()
    assert (s.num_used_pages, s.num_cached_pages, s.num_tokens) == (2, 1, 5)
    assert s.kv_utilization == 5 / 8


def test_a_fresh_cache_has_rates_of_0(device):
    s = make_cache(prefix_caching=True, device=device).stats()
    assert (s.prefix_query_tokens, s.prefix_hit_rate, s.kv_utilization) == (0, 0.0, 0.0)


def test_page_counts_for_the_engine_agree_with_stats(device):
    cache = make_cache(prefix_caching=True, device=device)
    cache.add_sequence("a", token_ids=list(range(9)))
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("b", num_tokens=5)
    s = cache.stats()
    assert (cache.num_pages, cache.num_free_pages, cache.num_cached_pages) == (8, 4, 2)
    assert (s.num_pages, s.num_free_pages, s.num_cached_pages) == (8, 4, 2)
    assert cache.num_available_pages == 6
    assert cache.device == device


def test_scrub_on_free_zeroes_freed_pages(device):
    cache = make_cache(scrub_on_free=True, device=device)
    cache.add_sequence("a", num_tokens=4)
    fill(cache, "a", value=7)
    cache.free_sequence("a")
    assert torch.count_nonzero(cache.pool.kv[:, :, 0]) == 0


def test_scrub_on_free_zeroes_evicted_pages(device):
    cache = make_cache(num_pages=2, prefix_caching=True, scrub_on_free=True, device=device)
    cache.add_sequence("a", prompt(8))
    fill(cache, "a", value=7)
    cache.commit("a")
    cache.free_sequence("a")  # both pages stay cached, content kept
    assert torch.count_nonzero(cache.pool.kv[:, :, 1]) > 0
    cache.add_sequence("b", num_tokens=4)  # evicts page 1
    assert cache.pages("b") == [1]
    assert torch.count_nonzero(cache.pool.kv[:, :, 1]) == 0
    assert torch.count_nonzero(cache.pool.kv[:, :, 0]) > 0


def test_can_add_and_can_append_answer_what_the_calls_would_do_and_change_nothing(device):
    cache = KVCache(KVLayout(1, 1, 4, torch.float32, page_size=4), 4, device=device)
    assert cache.can_add(list(range(16))) and not cache.can_add(list(range(17)))
    assert not cache.can_add(list(range(13)), spare_pages=1)
    cache.add_sequence("a", list(range(12)))
    assert cache.can_append("a", 4) and not cache.can_append("a", 5)
    assert cache.num_tokens("a") == 12 and cache.num_free_pages == 1
    cache.check_fits(16)
    with pytest.raises(OutOfPages, match=r"^17 tokens need 5 pages of 4 tokens; the pool has 4$"):
        cache.check_fits(17)


def test_check_fits_leaves_out_the_reserved_pages_no_sequence_can_take(device):
    cache = KVCache(KVLayout(1, 1, 4, torch.float32, page_size=4), 8, reserve=1, device=device)
    cache.check_fits(28)
    with pytest.raises(OutOfPages, match=r"^29 tokens need 8 pages of 4 tokens; the pool has 8 "
                                         r"\(1 reserved\)$"):
        cache.check_fits(29)
    cache.add_sequence("a", list(range(28)))  # what check_fits takes, alone, fits
    cache.check()


def test_can_add_entering_by_chunks_asks_a_windowed_cache_for_the_entering_tokens_only(device):
    windowed = KVCache(KVLayout(1, 1, 4, torch.float32, page_size=4, layer_windows=(8,)), 4,
                       device=device)
    whole = KVCache(KVLayout(1, 1, 4, torch.float32, page_size=4), 4, device=device)
    prompt = list(range(40))  # 10 pages; the pools hold 4
    assert windowed.can_add(prompt, entering=16) and not windowed.can_add(prompt)
    assert not whole.can_add(prompt, entering=16)


def test_room_checks_say_no_past_the_length_limit(device):
    cache = make_cache(16, device=device, max_tokens_per_seq=10)
    assert not cache.can_add(list(range(20))) and cache.can_add(list(range(10)))
    cache.add_sequence("b", list(range(10)))
    assert not cache.can_append("b", 1) and cache.can_append("b", 0)
    with pytest.raises(SequenceTooLong):
        cache.append("b")


def test_arguments_that_are_no_page_range_or_sequence_are_typed_errors(device):
    cache = make_cache(16, device=device)
    cache.add_sequence("a", list(range(9)))
    for page in (-1, 16):
        with pytest.raises(ValueError, match=rf"page must be in \[0, 15\], got {page}"):
            cache.owners(page)
    with pytest.raises(ValueError, match="1 sequences, 2 starts, 1 ends"):
        cache.slot_mapping(["a"], [0, 1], [2])
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints, got the number"):
        cache.add_sequence("b", torch.tensor(5))
    for option in ({"tier": 5}, {"states": 3}):
        with pytest.raises(TypeError, match=f"{next(iter(option))} must be a"):
            make_cache(device=device, **option)
    cache.check()


def test_an_insert_under_a_new_salt_that_raises_adds_no_root():
    allocator = PageAllocator(8)
    index = PrefixCache(allocator, 2)
    fresh = allocator.allocate(1)
    for tokens, pages, error, message in (
            ([7], fresh, ValueError, "token_ids hold 1 tokens, fewer than 1 full pages"),
            ([7, 8], [5], InvalidPage, "cannot cache page 5: nobody holds it")):
        with pytest.raises(error, match=message):
            index.insert(pack_tokens(tokens), pages, salt=salt_key("alice"))
        assert list(index._roots) == [b""]
        index.check()
    assert index.insert(pack_tokens([7, 8]), fresh, salt=salt_key("alice")) == 1
    assert list(index._roots) == [b"", salt_key("alice")]
    index.check()


def test_the_prefix_index_refuses_bad_page_sizes_and_pages_and_changes_nothing():
    allocator = PageAllocator(8)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="page_size"):
            PrefixCache(allocator, bad)
    index = PrefixCache(allocator, 2)
    held = allocator.allocate(2)
    tokens = pack_tokens([1, 2, 3, 4])
    assert index.insert(tokens, held) == 2
    for pages, num_cached, error in (([held[0], -1], 1, InvalidPage),  # -1 must not wrap
                                     ([held[0], 100], 1, InvalidPage),
                                     ([held[0], 5], 1, InvalidPage),  # free: nobody holds it
                                     ([held[0], "x"], 1, TypeError),
                                     ([-1, held[1]], 1, ValueError),
                                     (held, -1, ValueError), (held, 3, ValueError)):
        with pytest.raises(error):
            index.insert(pack_tokens([1, 2, 9, 9]), pages, num_cached)
        allocator.check()
        index.check()
        assert index.num_pages == 2 and index.num_nodes == 1
    spare = allocator.allocate(1)
    for pages in ([held[1], held[0]], [held[1], *spare]):  # held[1] is at depth 2, not 1
        with pytest.raises(ValueError, match=rf"page {held[1]}, the last of the first 1 "
                                             r"\(num_cached\), is not page 0 of a path in "
                                             r"the tree"):
            index.insert(pack_tokens([1, 2, 9, 9]), pages, 1)
        allocator.check()
        index.check()
        assert index.num_pages == 2 and index.num_nodes == 1
    fresh = allocator.allocate(2)
    for tokens, pages, error, message in (
            ([7, 8, 9], fresh, ValueError, "token_ids hold 3 tokens, fewer than 2 full pages"),
            ([7, 8], held[1:], InvalidPage, "hold one the tree indexes already")):
        with pytest.raises(error, match=message):
            index.insert(pack_tokens(tokens), pages)
        allocator.check()
        index.check()
        assert index.num_pages == 2
