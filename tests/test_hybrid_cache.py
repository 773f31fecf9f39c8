"""KVCache with a Mamba state group: a sequence's KV pages and state slot live and die together;
fork copies the state; failures change nothing (random operation sequences: test_cache_props)."""

import pytest
import torch

from hybrid_util import hybrid_cache
from kvpool.errors import DuplicateSequence, OutOfPages, OutOfStateSlots, UnknownSequence
from kvpool.memory.layout import KVLayout
from kvpool.memory.state_pool import MambaLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=4)
STATES = MambaLayout(num_layers=2, conv_dim=3, conv_kernel=3, num_heads=1, head_dim=2,
                     state_size=2, dtype=torch.float32)


def cache(num_pages=8, num_slots=3, *, device):
    return hybrid_cache(LAYOUT, num_pages, STATES, num_slots, device=device)


def test_a_sequence_holds_its_pages_and_one_state_slot(device):
    c = cache(device=device)
    assert c.add_sequence("a", num_tokens=6) == 0
    assert (c.pages("a"), c.state_slot("a"), c.states.num_free) == ([0, 1], 0, 2)
    c.check()


def test_free_returns_the_pages_and_the_slot(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=6)
    c.free_sequence("a")
    assert (c.num_free_pages, c.states.num_free, c.sequences()) == (8, 3, [])
    c.check()


def test_append_batch_grows_every_sequence_as_appends_one_by_one_would_or_none(device):
    c = cache(num_pages=5, device=device)
    c.add_sequence("a", [1, 2, 3])
    c.add_sequence("b", [4, 5, 6, 7])
    assert c.append_batch(["a", "b"], token_ids=[[8], [9, 10]]) == [3, 8, 9]
    assert (c.num_tokens("a"), c.num_tokens("b"), c.pages("b")) == (4, 6, [1, 2])
    with pytest.raises(OutOfPages):
        c.append_batch(["a", "b"], [5, 3])  # 3 pages needed, 2 free
    assert (c.num_tokens("a"), c.num_tokens("b"), c.num_free_pages) == (4, 6, 2)
    c.check()


def test_fork_shares_pages_and_copies_the_state_into_a_new_slot(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=6)
    parent = c.state_slot("a")
    c.states.conv[:, parent] = torch.randn(2, 3, 2, device=device)
    c.states.ssm[:, parent] = torch.randn(2, 1, 2, 2, device=device)
    c.fork("a", "b")
    child = c.state_slot("b")
    assert c.pages("b") == c.pages("a") and child != parent
    assert torch.equal(c.states.conv[:, child], c.states.conv[:, parent])
    assert torch.equal(c.states.ssm[:, child], c.states.ssm[:, parent])
    c.check()


def test_out_of_state_slots_names_the_numbers_and_takes_no_pages(device):
    c = cache(num_slots=1, device=device)
    c.add_sequence("a", num_tokens=1)
    with pytest.raises(OutOfStateSlots, match="need 1 state slot, 0 free of 1"):
        c.add_sequence("b", num_tokens=4)
    assert (c.num_free_pages, c.sequences()) == (7, ["a"])
    c.check()


def test_out_of_pages_takes_no_state_slot(device):
    c = cache(num_pages=2, device=device)
    with pytest.raises(OutOfPages):
        c.add_sequence("a", num_tokens=9)
    assert c.states.num_free == 3
    c.check()


def test_fork_without_a_free_slot_shares_no_page(device):
    c = cache(num_slots=1, device=device)
    c.add_sequence("a", num_tokens=5)
    with pytest.raises(OutOfStateSlots):
        c.fork("a", "b")
    assert [c.allocator.refcount(p) for p in c.pages("a")] == [1, 1]
    c.check()


def test_duplicate_and_unknown_ids_are_refused(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=1)
    with pytest.raises(DuplicateSequence):
        c.add_sequence("a", num_tokens=1)
    with pytest.raises(UnknownSequence):
        c.free_sequence("b")
    with pytest.raises(UnknownSequence):
        c.fork("b", "c")
    c.check()


def test_state_batch_lists_the_slots_in_order(device):
    c = cache(device=device)
    c.add_sequence("a", num_tokens=1)
    c.add_sequence("b", num_tokens=1)
    batch = c.state_batch(["b", "a"])
    assert batch.pool is c.states and batch.slots.tolist() == [1, 0]
