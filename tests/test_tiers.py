"""Tiers below the pool, alone and under KVCache, one rule per test, with exact page ids
(a fresh allocator hands out ids ascending from 0; LIFO reuses the last freed first)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import torch

from kvpool.cache import KVCache, tiers
from kvpool.cache.tiers import (
    ROOT_KEY,
    STALE_WRITE_SECONDS,
    DiskTier,
    HostTier,
    PageKey,
    namespace_tag,
)
from kvpool.errors import OutOfMemory, OutOfPages
from kvpool.memory.layout import KVLayout

PS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, page_size=PS)
TIERS = {
    "host": lambda tmp_path: HostTier(8),
    "disk": lambda tmp_path: DiskTier(tmp_path / "tier", 8),
}


def make_cache(tier, num_pages=4, *, device):
    return KVCache(LAYOUT, num_pages, device=device, prefix_caching=True, tier=tier)


def prompt(n, base=0):
    return list(range(base, base + n))


def bound(tier, dtype=torch.float32, shape=(2, 2, PS, 1, 2), namespace="test"):
    """`tier` bound as a cache of LAYOUT would bind it (for tests of a tier alone)."""
    tier.bind(namespace, shape, dtype)
    return tier


def page(value, dtype=torch.float32):
    """One page of tier data `[num_layers, 2, page_size, kv_heads, head_dim]`."""
    return torch.full((2, 2, PS, 1, 2), float(value), dtype=dtype)


def fill(cache, seq_id, value):
    """Write distinct K (and -K) values into every slot of the sequence, in both layers."""
    slots = torch.tensor(cache.slots(seq_id), device=cache.device)
    for layer in range(2):
        k = (value + 1000 * layer + torch.arange(len(slots), dtype=torch.float32,
                                                 device=cache.device))
        k = k[:, None, None].expand(-1, 1, 2)
        cache.pool.write(layer, slots, k, -k)


def evict_prompt_to_tier(cache, tokens, value=100):
    """Commit `tokens` with distinct KV, free it, then let a sequence of unknown content take
    every page of the pool (overwriting them), which evicts the cached pages to the tier.
    Returns the original KV of the prompt's full pages."""
    cache.add_sequence("a", tokens)
    fill(cache, "a", value)
    full = len(tokens) // PS
    original = cache.pool.read_pages(cache.pages("a")[:full]).clone()
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("x", num_tokens=cache.allocator.num_pages * PS)
    fill(cache, "x", -5)
    cache.free_sequence("x")
    return original


# ---- tiers under KVCache -----------------------------------------------------------------

@pytest.mark.parametrize("kind", TIERS)
def test_page_evicted_from_the_device_comes_back_from_the_tier_with_identical_kv(
        kind, tmp_path, device):
    tier = TIERS[kind](tmp_path)
    cache = make_cache(tier, device=device)
    original = evict_prompt_to_tier(cache, prompt(9))
    assert len(tier) == 2
    assert cache.add_sequence("b", prompt(9)) == 8
    assert cache.pages("b") == [0, 1, 3]  # fresh pages, LIFO from x's freed ones
    assert torch.equal(cache.pool.read_pages([0, 1]), original)
    s = cache.stats()
    assert (s.num_evicted_pages, s.num_tier_stores, s.num_tier_loads) == (2, 2, 2)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (18, 8)
    cache.check()


def test_reloaded_pages_are_cached_on_the_device_again(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    cache.add_sequence("b", prompt(9))
    cache.free_sequence("b")
    assert cache.add_sequence("c", prompt(9)) == 8  # a device hit: no second load
    assert cache.pages("c")[:2] == [0, 1]
    assert cache.stats().num_tier_loads == 2
    assert tier.stats().num_hits == 2
    cache.check()


def test_tier_continues_the_device_match(device):
    tier = HostTier(8)
    cache = make_cache(tier, num_pages=5, device=device)
    cache.add_sequence("a", prompt(13))
    fill(cache, "a", 100)
    original = cache.pool.read_pages([1, 2]).clone()
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("x", num_tokens=16)  # one free page + two evicted: the leaves 2, 1
    assert [k.token_ids for k in tier] == [tuple(prompt(4, 8)), tuple(prompt(4, 4))]
    cache.free_sequence("x")
    assert cache.add_sequence("b", prompt(13)) == 12  # page 0 on the device, 1-2 from tier
    assert cache.pages("b")[0] == 0
    assert torch.equal(cache.pool.read_pages(cache.pages("b")[1:3]), original)
    assert cache.stats().num_tier_loads == 2
    cache.check()


def test_tier_never_serves_the_last_token(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(8))
    assert cache.add_sequence("b", prompt(8)) == 4  # page 1 would hold the last token
    assert cache.stats().num_tier_loads == 1


def test_same_page_tokens_under_another_prefix_are_not_served(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    other = prompt(4, 100) + prompt(5, 4)  # second page as a's, below another first page
    assert cache.add_sequence("b", other) == 0
    assert cache.stats().num_tier_loads == 0


def test_a_page_evicted_twice_is_stored_once(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    cache.add_sequence("b", prompt(9))
    cache.commit("b")
    cache.free_sequence("b")
    cache.add_sequence("x", num_tokens=16)
    assert len(tier) == 2
    assert cache.stats().num_tier_stores == 4
    cache.check()


def test_a_page_the_tier_cannot_store_is_lost_and_eviction_still_succeeds(tmp_path, device):
    tier = DiskTier(tmp_path / "tier", 8)
    cache = make_cache(tier, device=device)
    cache.add_sequence("a", prompt(9))
    cache.commit("a")
    cache.free_sequence("a")
    shutil.rmtree(tier.directory)
    tier.directory.write_text("")  # a file where the directory was: every write fails
    assert cache.add_sequence("x", num_tokens=16) == 0
    s = cache.stats()
    assert (s.num_evicted_pages, s.num_tier_stores) == (2, 0)
    assert (len(tier), tier.stats().num_dropped) == (0, 2)
    cache.check()
    cache.free_sequence("x")
    assert cache.add_sequence("b", prompt(9)) == 0


def test_pages_to_add_counts_tier_hits_as_fresh_pages(device):
    cache = make_cache(HostTier(8), device=device)
    evict_prompt_to_tier(cache, prompt(9))
    available = cache.num_available_pages
    assert cache.pages_to_add(prompt(9)) == 3
    cache.add_sequence("b", prompt(9))
    assert available - cache.num_available_pages == 3


def test_failed_add_sequence_with_a_tier_hit_changes_nothing(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    cache.add_sequence("y", num_tokens=8)  # two of the four pages: b's three do not fit
    # bytes, not floats: unwritten pages (the reserved padding page among them) may hold NaN
    before = (cache.stats(), [cache.allocator.refcount(p) for p in range(4)],
              cache.pool.kv.view(torch.uint8).clone(), list(tier), tier.stats(),
              tier.buffer.view(torch.uint8).clone())
    with pytest.raises(OutOfPages, match="need 3 pages, 2 free"):
        cache.add_sequence("b", prompt(9))
    after = (cache.stats(), [cache.allocator.refcount(p) for p in range(4)],
             cache.pool.kv.view(torch.uint8), list(tier), tier.stats(),
             tier.buffer.view(torch.uint8))
    assert before[:2] == after[:2] and before[3:5] == after[3:5]
    assert torch.equal(before[2], after[2]) and torch.equal(before[5], after[5])
    assert cache.sequences() == ["y"]
    cache.free_sequence("y")
    assert cache.add_sequence("b", prompt(9)) == 8  # the hit was real
    cache.check()


def test_a_tier_needs_prefix_caching(device):
    with pytest.raises(ValueError, match="prefix_caching=True"):
        KVCache(LAYOUT, 4, device=device, tier=HostTier(4))


# ---- HostTier ----------------------------------------------------------------------------

def keys(n):
    return [PageKey.of(ROOT_KEY, [i] * PS) for i in range(n)]


def test_tier_drops_the_least_recently_used_page_beyond_capacity():
    tier = bound(HostTier(2))
    k = keys(3)
    tier.put(k[0], page(0))
    tier.put(k[1], page(1))
    assert torch.equal(tier.get(k[0]), page(0))  # k0 is now the most recently used
    tier.put(k[2], page(2))
    assert list(tier) == [k[0], k[2]]
    assert k[1] not in tier and tier.get(k[1]) is None
    assert torch.equal(tier.get(k[2]), page(2))
    s = tier.stats()
    assert (s.num_pages, s.num_stored, s.num_hits, s.num_misses, s.num_evictions) == (
        2, 3, 2, 1, 1)
    tier.check()


def test_stats_are_a_snapshot_that_later_calls_leave_alone():
    tier = bound(HostTier(2))
    before = tier.stats()
    tier.put(keys(1)[0], page(0))
    tier.get(keys(2)[1])
    assert (before.num_pages, before.num_stored, before.num_misses) == (0, 0, 0)
    after = tier.stats()
    assert (after.capacity_pages, after.num_pages, after.num_stored, after.num_misses) == (
        2, 1, 1, 1)


def test_key_collision_is_a_miss():
    tier = bound(HostTier(4))
    key = PageKey.of(ROOT_KEY, [1, 2, 3, 4])
    tier.put(key, page(7))
    other_tokens = PageKey(key.chain_key, ROOT_KEY, (9, 9, 9, 9))
    other_parent = PageKey(key.chain_key, bytes(range(16)), key.token_ids)
    assert other_tokens not in tier and other_parent not in tier
    assert tier.get(other_tokens) is None and tier.get(other_parent) is None
    assert (tier.stats().num_hits, tier.stats().num_misses) == (0, 2)
    assert torch.equal(tier.get(key), page(7))


def test_host_tier_allocates_its_store_once_when_bound():
    tier = HostTier(3)
    assert tier.nbytes == 0
    bound(tier)
    store = tier.buffer.data_ptr()
    assert tier.nbytes == 3 * page(0).numel() * 4
    for i, k in enumerate(keys(5)):
        tier.put(k, page(i))
    assert tier.buffer.data_ptr() == store
    tier.check()


def test_host_tier_get_returns_a_copy():
    tier = bound(HostTier(1))
    k = keys(2)
    tier.put(k[0], page(1))
    data = tier.get(k[0])
    tier.put(k[1], page(2))  # reuses the only slot
    assert torch.equal(data, page(1))


def test_host_tier_rejects_a_page_of_another_shape_and_changes_nothing():
    tier = bound(HostTier(1))
    k = keys(2)
    tier.put(k[0], page(1))
    with pytest.raises(ValueError, match=r"shaped \(2, 2, 4, 1, 2\) \(torch.float32\), "
                                         r"got \(2, 2, 8, 1, 2\)"):
        tier.put(k[1], torch.zeros(2, 2, 8, 1, 2))
    assert list(tier) == [k[0]] and torch.equal(tier.get(k[0]), page(1))


def test_a_host_tier_put_whose_copy_fails_keeps_its_slot_free():
    tier = bound(HostTier(2))
    unreadable = page(0).to("meta")  # passes the checks; its copy raises
    for i in range(3):
        with pytest.raises(NotImplementedError):
            tier.put(keys(3)[i], unreadable)
        tier.check()
    assert not tier.store(keys(3)[0], unreadable)  # eviction's path: dropped
    tier.put(keys(3)[1], page(1))
    tier.put(keys(3)[2], page(2))
    assert len(tier) == 2
    tier.check()


def test_clear_empties_the_tier():
    tier = bound(HostTier(3))
    for i, k in enumerate(keys(3)):
        tier.put(k, page(i))
    tier.clear()
    assert len(tier) == 0 and list(tier) == []
    tier.put(keys(1)[0], page(5))
    tier.check()


@pytest.mark.parametrize(("capacity", "error", "message"), [
    (0, ValueError, rf"capacity_pages must be in \[1, {2**63 - 1}\], got 0"),
    (-3, ValueError, rf"capacity_pages must be in \[1, {2**63 - 1}\], got -3"),
    (2**63, ValueError, rf"capacity_pages must be in \[1, {2**63 - 1}\], got {2**63}"),
    (2.5, TypeError, "capacity_pages must be an int, got float 2.5"),
    (True, TypeError, "capacity_pages must be an int, got bool True"),
    (None, TypeError, "capacity_pages must be an int, got NoneType None"),
])
def test_capacity_must_be_a_positive_int64(capacity, error, message, tmp_path):
    with pytest.raises(error, match=message):
        HostTier(capacity)
    with pytest.raises(error, match=message):
        DiskTier(tmp_path, capacity)


@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.parametrize("key", [None, "x", (1, 2), ROOT_KEY,
                                 PageKey([1], ROOT_KEY, (1, 2))])  # its chain key unhashable
def test_a_key_that_is_not_a_page_key_is_a_miss(kind, key, tmp_path):
    tier = bound(TIERS[kind](tmp_path))
    tier.put(keys(1)[0], page(1))
    assert key not in tier
    assert tier.get(key) is None
    assert (tier.stats().num_hits, tier.stats().num_misses) == (0, 1)


@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.parametrize(("key", "data", "error", "message"), [
    ((1, 2), page(2), TypeError, r"tier keys must be PageKeys, got tuple \(1, 2\)"),
    (None, page(2), TypeError, "tier keys must be PageKeys, got NoneType None"),
    (PageKey(5, ROOT_KEY, (1, 2, 3, 4)), page(2), ValueError,
     "does not hold the chain key of its parent key and token ids"),
    (PageKey.of(ROOT_KEY, [1, 2, 3, 4]), page(2).tolist(), TypeError,
     "tier pages must be tensors, got list"),
])
def test_put_refuses_a_bad_key_or_data_and_changes_nothing(kind, key, data, error, message,
                                                          tmp_path):
    tier = bound(TIERS[kind](tmp_path))
    k = keys(1)[0]
    tier.put(k, page(1))
    with pytest.raises(error, match=message):
        tier.put(key, data)
    assert not tier.store(key, data)  # dropped and counted, as any page put refuses
    assert list(tier) == [k] and torch.equal(tier.get(k), page(1))
    assert (tier.stats().num_stored, tier.stats().num_dropped) == (1, 1)
    tier.check()


@pytest.mark.parametrize("kind", TIERS)
@pytest.mark.parametrize(("namespace", "shape", "dtype", "error", "message"), [
    ("ns", (2, 2, PS, 1, 2), "float32", TypeError,
     "dtype must be a torch.dtype, got str 'float32'"),
    ("ns", (2, 2, PS, 1, 2), None, TypeError, "dtype must be a torch.dtype, got NoneType"),
    ("ns", (2, -2, PS, 1, 2), torch.float32, ValueError,
     r"page_shape sizes must be in \[1, \d+\], got -2"),
    ("ns", (2, 0, PS, 1, 2), torch.float32, ValueError,
     r"page_shape sizes must be in \[1, \d+\], got 0"),
    ("ns", (2, 2.0, PS, 1, 2), torch.float32, TypeError,
     "page_shape sizes must be an int, got float 2.0"),
    ("ns", 8, torch.float32, TypeError, "page_shape must be a sequence of ints, got int 8"),
    (123, (2, 2, PS, 1, 2), torch.float32, TypeError, "namespace must be a str, got int 123"),
])
def test_bind_refuses_a_bad_namespace_shape_or_dtype_and_stays_unbound(
        kind, namespace, shape, dtype, error, message, tmp_path):
    tier = TIERS[kind](tmp_path)
    with pytest.raises(error, match=message):
        tier.bind(namespace, shape, dtype)
    assert tier.namespace is None
    bound(tier).put(keys(1)[0], page(1))  # still binds, then stores
    assert torch.equal(tier.get(keys(1)[0]), page(1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pin_memory_needs_cuda():
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        HostTier(4, pin_memory=True)


def test_chain_keys_are_the_same_in_every_process():
    code = ("from kvpool.cache.tiers import ROOT_KEY, PageKey; "
            "print(PageKey.of(ROOT_KEY, [1, 2, 3, 4]).chain_key.hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=hashed_at_random()).stdout
    assert bytes.fromhex(out) == PageKey.of(ROOT_KEY, [1, 2, 3, 4]).chain_key


def hashed_at_random():
    """The environment of a subprocess with its own hash seed, importing this kvpool."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONHASHSEED": "random",
            "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


# Two first pages whose Python tuple hashes are equal (found by a birthday search on
# CPython's 64-bit tuple hash), and a page to follow either.
COLLIDING = ([110789, 78346, 8299, 92345, *range(1000, 1012)],
             [5016, 123353, 43506, 0, *range(1000, 1012)])
AFTER = list(range(11, 27))


def test_pages_whose_tuple_hashes_collide_get_different_chain_keys():
    first, second = (PageKey.of(ROOT_KEY, ids) for ids in COLLIDING)
    assert hash(tuple(COLLIDING[0])) == hash(tuple(COLLIDING[1]))
    assert first.chain_key != second.chain_key
    assert (PageKey.of(first.chain_key, AFTER).chain_key
            != PageKey.of(second.chain_key, AFTER).chain_key)


def test_a_tier_never_serves_a_page_computed_after_another_prefix_whose_hash_collides(device):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                      page_size=16)
    cache = KVCache(layout, 4, device=device, prefix_caching=True, tier=HostTier(8))
    cache.add_sequence("a", COLLIDING[0] + AFTER + [99])  # its pages go to the tier
    cache.commit("a")
    cache.free_sequence("a")
    cache.add_sequence("x", num_tokens=4 * 16)
    cache.free_sequence("x")
    cache.add_sequence("b0", COLLIDING[1] + [1])  # the colliding first page, on the device
    cache.commit("b0")
    cache.free_sequence("b0")
    assert cache.add_sequence("b", COLLIDING[1] + AFTER + [99]) == 16  # its own first page
    assert cache.stats().num_tier_loads == 0
    cache.check()


def test_a_salted_roots_key_is_the_same_in_every_process():
    from kvpool.cache.prefix_cache import _salted_root, salt_key

    code = ("from kvpool.cache.prefix_cache import _salted_root, salt_key; "
            "print(_salted_root(salt_key('alice')).base_key.hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=hashed_at_random()).stdout
    assert bytes.fromhex(out) == _salted_root(salt_key("alice")).base_key


def test_an_unsalted_page_spelling_a_salt_never_loads_that_salts_pages_from_the_tier(device):
    import hashlib

    ps = 33  # a page of 33 ids holds -2 (which hashes as -1 does) and a salt's 32 bytes
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      page_size=ps)
    cache = KVCache(layout, 4, device=device, prefix_caching=True, tier=HostTier(16))
    victim = list(range(100, 100 + ps))
    cache.add_sequence("v", victim + [1], cache_salt="alice")
    cache.commit("v")
    cache.free_sequence("v")
    cache.add_sequence("fill", num_tokens=4 * ps)  # alice's page goes to the tier
    cache.free_sequence("fill")
    crafted = [-2, *hashlib.sha256(b"alice").digest()]
    cache.add_sequence("a0", crafted + [7])
    cache.commit("a0")
    cache.free_sequence("a0")
    assert cache.add_sequence("a", crafted + victim + [1]) == ps  # its own page, not alice's
    assert cache.stats().num_tier_loads == 0
    cache.check()


# ---- DiskTier ----------------------------------------------------------------------------

def page_files(directory):
    return sorted(f.name for f in directory.iterdir() if f.suffix == ".kvpage")


def test_disk_tier_round_trip_and_clear_removes_files(tmp_path):
    tier = bound(DiskTier(tmp_path, 4), torch.float16)
    k = keys(2)
    tier.put(k[0], page(1, torch.float16))
    tier.put(k[1], page(2, torch.float16))
    assert page_files(tmp_path) == sorted([tier.path(k[0]).name, tier.path(k[1]).name])
    data = tier.get(k[0])
    assert data.dtype == torch.float16 and torch.equal(data, page(1, torch.float16))
    tier.check()
    tier.clear()
    assert page_files(tmp_path) == [] and len(tier) == 0


def test_disk_tier_eviction_removes_the_file(tmp_path):
    tier = bound(DiskTier(tmp_path, 1))
    k = keys(2)
    tier.put(k[0], page(1))
    tier.put(k[1], page(2))
    assert page_files(tmp_path) == [tier.path(k[1]).name]
    assert tier.stats().num_evictions == 1


def test_disk_tier_stores_a_view_as_its_own_page(tmp_path):
    tier = bound(DiskTier(tmp_path, 2), shape=(2, 2, 256, 1, 2))
    pages = torch.arange(2 * 2 * 3 * 256 * 2, dtype=torch.float32).view(2, 2, 3, 256, 1, 2)
    tier.put(keys(1)[0], pages[:, :, 1])
    assert torch.equal(tier.get(keys(1)[0]), pages[:, :, 1])
    assert tier.path(keys(1)[0]).stat().st_size < 2 * pages[:, :, 1].numel() * 4


def test_disk_tier_reopened_rebuilds_its_index(tmp_path):
    (tmp_path / "notes.txt").write_text("not a page")
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(3)
    for i in range(3):
        tier.put(k[i], page(i))
    again = bound(DiskTier(tmp_path, 4))
    assert list(again) == k
    assert torch.equal(again.get(k[1]), page(1))
    assert (tmp_path / "notes.txt").exists()
    again.check()


def test_disk_tier_reopened_smaller_drops_the_least_recently_used(tmp_path):
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(3)
    for i in range(3):
        tier.put(k[i], page(i))
    tier.get(k[0])
    smaller = bound(DiskTier(tmp_path, 2))
    assert list(smaller) == [k[2], k[0]]
    assert page_files(tmp_path) == sorted(tier.path(x).name for x in (k[0], k[2]))


def test_disk_tier_reopened_keeps_the_recency_order_of_a_clock_that_did_not_move(tmp_path,
                                                                                 monkeypatch):
    """A coarse clock stamps many uses alike: each use is stamped after the last one."""
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(3)
    for i in range(3):
        tier.put(k[i], page(i))
    tier.get(k[0])
    assert list(bound(DiskTier(tmp_path, 4))) == [k[1], k[2], k[0]]


def test_disk_tier_reopened_removes_a_page_file_named_for_another_key(tmp_path):
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(2)
    tier.put(k[0], page(0))
    shutil.copy(tier.path(k[0]), tier.path(k[1]))  # k[0]'s record under k[1]'s name
    again = bound(DiskTier(tmp_path, 4))
    assert list(again) == [k[0]] and page_files(tmp_path) == [tier.path(k[0]).name]
    assert again.stats().num_corrupt == 1
    assert torch.equal(again.get(k[0]), page(0))
    again.check()


def test_damaged_disk_page_is_a_miss_and_forgotten(tmp_path):
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(1)[0]
    tier.put(k, page(1))
    tier.path(k).write_bytes(b"garbage")
    assert tier.get(k) is None
    assert k not in tier and page_files(tmp_path) == []
    assert (tier.stats().num_misses, tier.stats().num_corrupt) == (1, 1)


def test_a_record_whose_checked_header_nests_too_deep_is_a_miss(tmp_path):
    # A header with a valid CRC-32 (easy to forge) that json cannot parse without
    # recursing past Python's limit: a miss counted corrupt, and a folder that still binds.
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(1)[0]
    tier.put(k, page(1))
    header = b"[" * 100_000 + b"]" * 100_000
    tier.path(k).write_bytes(tiers._PREFIX.pack(tiers._MAGIC, len(header), zlib.crc32(header))
                             + header)
    assert tier.get(k) is None
    assert (tier.stats().num_misses, tier.stats().num_corrupt) == (1, 1)
    tier.path(k).write_bytes(tiers._PREFIX.pack(tiers._MAGIC, len(header), zlib.crc32(header))
                             + header)
    again = bound(DiskTier(tmp_path, 4))
    assert list(again) == [] and page_files(tmp_path) == []


def test_a_record_of_format_version_1_is_a_miss(tmp_path, monkeypatch):
    # Version 1 named pages by 64-bit tuple hashes, which collide on demand.
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(1)[0]
    tier.put(k, page(1))
    monkeypatch.setattr(tiers, "_FORMAT_VERSION", 1)
    record = tiers.page_record("test", k, page(2))
    monkeypatch.undo()
    tier.path(k).write_bytes(record)
    assert tier.get(k) is None
    assert (tier.stats().num_misses, tier.stats().num_corrupt) == (1, 1)


def test_a_record_whose_checked_header_claims_a_payload_of_the_wrong_length_is_a_miss(tmp_path):
    # Header and payload CRC-32s are easy to forge: only the length of one page is read.
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(1)[0]
    tier.put(k, page(1))
    record = tiers.page_record("test", k, page(1))
    header_len = tiers._PREFIX.unpack(record[:tiers._PREFIX.size])[1]
    header = json.loads(record[tiers._PREFIX.size:tiers._PREFIX.size + header_len])
    payload = bytes(12)
    header.update(payload_bytes=len(payload), payload_crc32=zlib.crc32(payload))
    raw = json.dumps(header).encode()
    tier.path(k).write_bytes(tiers._PREFIX.pack(tiers._MAGIC, len(raw), zlib.crc32(raw))
                             + raw + payload)
    assert tier.get(k) is None
    assert (tier.stats().num_misses, tier.stats().num_corrupt) == (1, 1)


def test_disk_tier_binds_past_a_page_file_gone_while_it_lists_them(tmp_path):
    tier = bound(DiskTier(tmp_path, 4))
    k = keys(2)
    for i in range(2):
        tier.put(k[i], page(i))
    gone = tier.path(PageKey.of(ROOT_KEY, [9] * PS))
    gone.symlink_to(tmp_path / "nothing")  # listed, but stat() finds no file
    again = bound(DiskTier(tmp_path, 4))
    assert list(again) == k
    again.check()


def test_disk_tier_directory_must_be_usable(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        DiskTier(file, 4)
    with pytest.raises(ValueError, match="cannot create tier directory"):
        DiskTier(file / "sub", 4)
    DiskTier(tmp_path / "new" / "dir", 4)
    assert (tmp_path / "new" / "dir").is_dir()


# ---- a tier never serves another namespace's page or a damaged one; eviction never fails --

def test_a_disk_tier_reused_by_a_cache_of_another_dtype_misses(tmp_path, device):
    first = make_cache(DiskTier(tmp_path, 8), device=device)
    evict_prompt_to_tier(first, prompt(9))
    half = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16, page_size=PS)
    second = KVCache(half, 4, device=device, prefix_caching=True, tier=DiskTier(tmp_path, 8))
    assert second.add_sequence("b", prompt(9)) == 0
    assert second.stats().num_tier_loads == 0
    assert make_cache(DiskTier(tmp_path, 8),
                      device=device).add_sequence("c", prompt(9)) == 8  # still there


def test_a_disk_tier_reused_by_another_model_of_the_same_layout_misses(tmp_path, device):
    def cache_of(model):
        return KVCache(LAYOUT, 4, device=device, prefix_caching=True,
                       tier=DiskTier(tmp_path, 8), model_fingerprint=model)
    evict_prompt_to_tier(cache_of("llama weights a"), prompt(9))
    assert cache_of("llama weights b").add_sequence("b", prompt(9)) == 0
    assert cache_of("llama weights a").add_sequence("b", prompt(9)) == 8


def first_page_file(tier):
    return tier.path(next(k for k in tier if k.token_ids == tuple(prompt(PS))))


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "truncated"])
def test_a_damaged_page_file_is_a_miss_removed_and_counted(tmp_path, damage, device):
    tier = DiskTier(tmp_path, 8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    path = first_page_file(tier)
    raw = bytearray(path.read_bytes())
    if damage == "truncated":
        raw = raw[:len(raw) // 2]
    else:
        raw[-5 if damage == "payload bit" else 30] ^= 0x04
    path.write_bytes(bytes(raw))
    assert cache.add_sequence("b", prompt(9)) == 0
    assert not path.exists()
    assert (tier.stats().num_corrupt, len(tier)) == (1, 1)
    cache.check()


def test_a_host_tier_belongs_to_one_layout(device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    wider = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PS)
    with pytest.raises(ValueError, match="cannot share it"):
        KVCache(wider, 4, device=device, prefix_caching=True, tier=tier)
    evict_prompt_to_tier(cache, prompt(9))
    assert cache.add_sequence("b", prompt(9)) == 8
    cache.check()


def test_a_host_tier_larger_than_memory_is_refused_when_the_cache_is_built(device):
    big = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, page_size=16)
    tier = HostTier(10**7)
    with pytest.raises(OutOfMemory, match=r"HostTier of 10,000,000 pages needs "
                                          r"52,428,800,000,000 bytes"):
        KVCache(big, 4, device=device, prefix_caching=True, tier=tier)
    assert tier.namespace is None and tier.nbytes == 0
    huge = HostTier(2**62)  # its bytes pass int64: counted exactly all the same
    with pytest.raises(OutOfMemory, match=r"HostTier of 4,611,686,018,427,387,904 pages needs "
                                          r"24,178,516,392,292,583,494,123,520 bytes"):
        KVCache(big, 4, device=device, prefix_caching=True, tier=huge)


def test_a_store_failing_with_any_error_drops_the_page_and_eviction_succeeds(monkeypatch, device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    cache.add_sequence("a", prompt(9))
    cache.commit("a")
    cache.free_sequence("a")

    def broken(key, data):
        raise RuntimeError("the device is gone")
    monkeypatch.setattr(tier, "_write", broken)
    assert cache.add_sequence("x", num_tokens=16) == 0
    assert (cache.stats().num_evicted_pages, tier.stats().num_dropped, len(tier)) == (2, 2, 0)
    cache.free_sequence("x")
    assert cache.allocator.num_free == 4
    cache.check()


def test_evicted_pages_the_device_fails_to_read_are_dropped_and_eviction_succeeds(
        monkeypatch, device):
    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    cache.add_sequence("a", prompt(9))
    cache.commit("a")
    cache.free_sequence("a")

    def out_of_memory(pages):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(cache.pool, "read_pages", out_of_memory)
    assert cache.add_sequence("x", num_tokens=16) == 0
    s = cache.stats()
    assert (s.num_evicted_pages, s.num_tier_stores) == (2, 0)
    assert (len(tier), tier.stats().num_dropped) == (0, 2)
    cache.check()


def test_evicted_pages_go_to_the_tier_a_chunk_at_a_time(monkeypatch, device):
    from kvpool.cache import pages

    tier = HostTier(8)
    cache = make_cache(tier, device=device)
    cache.add_sequence("a", prompt(13))
    fill(cache, "a", 100)
    original = cache.pool.read_pages(cache.pages("a")[:3]).clone()
    cache.commit("a")
    cache.free_sequence("a")
    monkeypatch.setattr(pages, "STORE_CHUNK_BYTES", 2 * LAYOUT.bytes_per_page)
    reads, read = [], cache.pool.read_pages
    monkeypatch.setattr(cache.pool, "read_pages", lambda ids: reads.append(ids) or read(ids))
    cache.add_sequence("x", num_tokens=4 * PS)  # evicts a's three pages, the coldest first
    assert reads == [[2, 1], [0]] and len(tier) == 3
    cache.free_sequence("x")
    assert cache.add_sequence("b", prompt(13)) == 12
    assert torch.equal(read(cache.pages("b")[:3]), original)


def cache_with_a_device_and_a_tier_hit(device):
    """A cache where prompt(9) would find its first page on the device and its second in
    the tier."""
    cache = make_cache(HostTier(8), device=device)
    evict_prompt_to_tier(cache, prompt(9))
    cache.add_sequence("c", prompt(5))  # its first page back on the device, the second not
    cache.commit("c")
    cache.free_sequence("c")
    return cache


def break_the_load(cache, fault, error, monkeypatch):
    def broken(*args):
        raise error
    if fault == "write":
        monkeypatch.setattr(cache.pool, "write_pages", broken)
    else:
        cache.page_groups[0].load_listeners.append(broken)


@pytest.mark.parametrize("fault", ["write", "listener"])
def test_a_tier_load_that_fails_is_a_miss_and_the_sequence_computes_those_tokens(
        fault, monkeypatch, device):
    cache = cache_with_a_device_and_a_tier_hit(device)
    break_the_load(cache, fault, RuntimeError("out of memory"), monkeypatch)
    with pytest.warns(RuntimeWarning, match="loading 1 prefix pages from the tier failed "
                                            r"\(RuntimeError: out of memory\)"):
        assert cache.add_sequence("b", prompt(9)) == 4  # the device's hit alone
    assert cache.stats().num_tier_loads == 1  # c's load, not b's
    assert len(cache.pages("b")) == 3
    cache.commit("b")  # its pages, computed again, are cached as any others
    cache.free_sequence("b")
    cache.check()


@pytest.mark.parametrize("fault", ["write", "listener"])
def test_an_add_whose_tier_load_is_interrupted_gives_back_every_page_it_took(fault, monkeypatch,
                                                                             device):
    cache = cache_with_a_device_and_a_tier_hit(device)
    before = (cache.stats(), [cache.allocator.refcount(p) for p in range(4)],
              cache.allocator.cached_pages())
    break_the_load(cache, fault, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        cache.add_sequence("b", prompt(9))  # a device hit, a tier hit, a new page
    assert (cache.stats(), [cache.allocator.refcount(p) for p in range(4)],
            cache.allocator.cached_pages()) == before
    assert cache.sequences() == []
    cache.check()


def read_only_file_system(*args, **kwargs):
    raise PermissionError(13, "Read-only file system")


def test_a_disk_tier_that_cannot_write_serves_what_it_can_read(tmp_path, monkeypatch, device):
    # What a read-only mount does to every write, provoked the same way whoever runs the
    # test (root may write through permission bits)
    tier = DiskTier(tmp_path, 8)
    cache = make_cache(tier, device=device)
    original = evict_prompt_to_tier(cache, prompt(9))
    for module, name in ((os, "utime"), (tempfile, "mkstemp"), (Path, "unlink")):
        monkeypatch.setattr(module, name, read_only_file_system)
    assert cache.add_sequence("b", prompt(9)) == 8
    assert torch.equal(cache.pool.read_pages(cache.pages("b")[:2]), original)
    cache.commit("b")
    cache.free_sequence("b")
    cache.add_sequence("x", num_tokens=16)  # evicts b's pages: the tier cannot take them
    assert (tier.stats().num_dropped, len(tier)) == (2, 2)  # but keeps serving its files
    cache.free_sequence("x")
    assert cache.add_sequence("c", prompt(9)) == 8
    assert torch.equal(cache.pool.read_pages(cache.pages("c")[:2]), original)
    tier.check()
    cache.check()


def filled_disk_tier(directory, n):
    """A DiskTier of 4 pages in `directory` holding pages 0..n-1, and their keys."""
    tier = bound(DiskTier(directory, 4))
    k = keys(n)
    for i in range(n):
        tier.put(k[i], page(i))
    return tier, k


def test_a_disk_tier_reopened_where_it_cannot_write_keeps_the_temporary_and_its_pages(
        tmp_path, monkeypatch):
    _, k = filled_disk_tier(tmp_path, 2)
    interrupted = stale_temporary(tmp_path, "test")
    monkeypatch.setattr(Path, "unlink", read_only_file_system)
    again = bound(DiskTier(tmp_path, 4))
    assert list(again) == k and torch.equal(again.get(k[1]), page(1))
    assert interrupted.exists()


def test_a_disk_tier_that_cannot_remove_files_misses_a_damaged_page_and_binds_within_capacity(
        tmp_path, monkeypatch):
    tier, k = filled_disk_tier(tmp_path, 3)
    tier.path(k[0]).write_bytes(b"damaged")
    monkeypatch.setattr(Path, "unlink", read_only_file_system)
    assert tier.get(k[0]) is None and list(tier) == k[1:]
    tier.check()
    again = bound(DiskTier(tmp_path, 1))  # two readable pages, room for one
    assert list(again) == k[2:] and torch.equal(again.get(k[2]), page(2))


def stale_temporary(directory, namespace, age=STALE_WRITE_SECONDS + 1):
    """A temporary page file of `namespace`, as a write `age` seconds ago left it."""
    path = directory / f".kvpage-{namespace_tag(namespace)}-{age}.tmp"
    path.write_bytes(b"half a page")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_binding_removes_only_its_namespaces_stale_temporaries(tmp_path):
    """An interrupted write's temporary goes; a live replica's (young) and another
    namespace's stay."""
    stale = stale_temporary(tmp_path, "test")
    young = stale_temporary(tmp_path, "test", age=1)
    other = stale_temporary(tmp_path, "other model")
    bound(DiskTier(tmp_path, 4))
    assert (stale.exists(), young.exists(), other.exists()) == (False, True, True)


def test_a_disk_tier_on_a_directory_without_write_permission_serves_what_it_can_read(tmp_path,
        device):
    tier = DiskTier(tmp_path / "tier", 8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    tier.directory.chmod(0o555)
    try:
        probe = tier.directory / "probe"
        try:
            probe.write_text("")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("this process writes through permission bits (root)")
        assert cache.add_sequence("b", prompt(9)) == 8
        cache.commit("b")
        cache.free_sequence("b")
        cache.add_sequence("x", num_tokens=16)
        assert (tier.stats().num_dropped, len(tier)) == (2, 2)
        cache.free_sequence("x")
        assert cache.add_sequence("c", prompt(9)) == 8
        cache.check()
    finally:
        tier.directory.chmod(0o755)


def test_a_disk_tier_whose_directory_is_deleted_misses_then_stores_again(tmp_path, device):
    tier = DiskTier(tmp_path / "tier", 8)
    cache = make_cache(tier, device=device)
    evict_prompt_to_tier(cache, prompt(9))
    shutil.rmtree(tier.directory)
    cache.check()
    assert cache.add_sequence("b", prompt(9)) == 0
    fill(cache, "b", 7)
    cache.commit("b")
    cache.free_sequence("b")
    cache.add_sequence("x", num_tokens=16)  # evicts b's pages into the directory, made again
    assert len(page_files(tier.directory)) == 2
    cache.free_sequence("x")
    assert cache.add_sequence("c", prompt(9)) == 8
    cache.check()


def test_evicting_from_a_path_thousands_of_nodes_deep_stores_every_page(device):
    # A fork at every token, parent and child going on differently, makes a path of one-page
    # nodes; a tier names their pages by chain keys no add_sequence computed on the way.
    n = 1_200
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                      page_size=1)
    cache = KVCache(layout, 2 * n + 8, device=device, prefix_caching=True,
                    tier=HostTier(4 * n))
    cache.add_sequence("x", [0])
    cache.commit("x")
    for i in range(1, n):
        cache.fork("x", i)
        cache.append("x", token_ids=[i])
        cache.commit("x")
        cache.append(i, token_ids=[-i])
        cache.commit(i)
    cache.free_sequence("x")
    for i in range(n - 1, 0, -1):
        cache.free_sequence(i)
    cached = cache.num_cached_pages
    assert cache.evict(cached) == cached
    assert cache.tier.stats().num_stored == cached
    cache.check()


def test_token_ids_in_a_tensor_hit_the_tier(device):
    cache = make_cache(HostTier(8), device=device)
    evict_prompt_to_tier(cache, prompt(9))
    assert cache.add_sequence("b", torch.tensor(prompt(9))) == 8
    assert cache.stats().num_tier_loads == 2


# ---- the engine's model fingerprint: pages are shared only by the same model ---------------

def test_the_fingerprint_tells_apart_any_weight_and_the_config_but_not_a_reload():
    import dataclasses

    from kvpool.engine.tiers import weights_fingerprint
    from kvpool.models.loader import load_model

    def fingerprint(change=None):
        model = load_model("tiny", device="cpu").model
        if change is not None:
            with torch.no_grad():
                change(model)
        return weights_fingerprint(model)

    def rope(model):
        model.config = dataclasses.replace(model.config, rope_theta=model.config.rope_theta / 2)

    def last_row(model):  # a row no sample of a few thousand values would reach
        model.model.embed_tokens.weight[-1, 0] += 1.0

    def two_weights_swapped(model):
        w = model.model.layers[0].mlp.down_proj.weight
        w[0, 0], w[1, 1] = w[1, 1].clone(), w[0, 0].clone()

    base = fingerprint()
    assert fingerprint() == base
    changed = [fingerprint(change) for change in (rope, last_row, two_weights_swapped)]
    assert base not in changed and len(set(changed)) == 3


@pytest.mark.parametrize("buffer", ["beta", "eps"])
def test_the_fingerprint_tells_apart_models_that_differ_only_in_a_checkpoint_buffer(buffer):
    """xIELU's beta and eps, like DeepSeek-V3's router correction bias, come from the
    checkpoint but are buffers, not parameters."""
    from kvpool.engine.tiers import weights_fingerprint
    from kvpool.models.layers import XIELU

    def fingerprint(changed=None):
        model = XIELU(torch.float32)
        model.config = "an xIELU"
        with torch.no_grad():
            for name, value in (("alpha_p", 0.8), ("alpha_n", 0.8), ("beta", 0.5),
                                ("eps", -1e-6)):
                getattr(model, name).fill_(value)
            if changed is not None:
                getattr(model, changed).mul_(2)
        return weights_fingerprint(model)

    assert fingerprint() == fingerprint() != fingerprint(buffer)


def test_the_fingerprint_tells_apart_weights_swapped_within_a_row_or_a_column_and_a_dtype():
    """Swapping two weights of one row keeps its row sums, of one column its column sums:
    each is told apart by the other sums. The same values in another dtype are another
    model (it computes other KV)."""
    from kvpool.engine.tiers import weights_fingerprint
    from kvpool.models.loader import load_model

    def fingerprint(change=None):
        model = load_model("tiny", device="cpu").model
        with torch.no_grad():
            w = model.model.layers[0].mlp.down_proj.weight
            w[0, 0], w[0, 1], w[1, 0] = 0.25, 0.5, 0.75  # three distinct weights
            if change is not None:
                change(model)
        return weights_fingerprint(model)

    def in_a_row(model):
        w = model.model.layers[0].mlp.down_proj.weight
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()

    def in_a_column(model):
        w = model.model.layers[0].mlp.down_proj.weight
        w[0, 0], w[1, 0] = w[1, 0].clone(), w[0, 0].clone()

    base = fingerprint()
    changed = [fingerprint(in_a_row), fingerprint(in_a_column)]
    assert base not in changed and len(set(changed)) == 2
    half = load_model("tiny", device="cpu").model.half()
    rounded = weights_fingerprint(half)
    assert weights_fingerprint(half.float()) != rounded  # equal values, another dtype


def test_the_fingerprint_is_the_same_whatever_the_chunk_the_weights_are_summed_in(monkeypatch):
    from kvpool.engine import tiers as engine_tiers
    from kvpool.models.loader import load_model

    model = load_model("tiny", device="cpu").model
    whole = engine_tiers.weights_fingerprint(model)
    for chunk in (1, 7, 64):  # a row at a time, and chunks of several rows
        monkeypatch.setattr(engine_tiers, "SUM_CHUNK", chunk)
        assert engine_tiers.weights_fingerprint(model) == whole
    with torch.no_grad():
        model.model.embed_tokens.weight[-1, 0] += 1.0  # the last row, in the last chunk
    assert engine_tiers.weights_fingerprint(model) != whole


# ---- the engine's tier: sized in whole pages of its layout ---------------------------------

@pytest.mark.parametrize("option", ["host_tier_memory", "disk_tier_memory"])
def test_the_engines_tier_holds_the_whole_pages_its_memory_fits(option, tmp_path):
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.tiers import make_tier

    page_bytes = 1000
    disk = {"disk_tier": str(tmp_path / "tier")} if option == "disk_tier_memory" else {}
    expected_type = DiskTier if disk else HostTier
    for nbytes, pages in ((page_bytes, 1), (3 * page_bytes - 1, 2), (3 * page_bytes, 3)):
        tier = make_tier(EngineConfig(**disk, **{option: nbytes}), page_bytes)
        assert type(tier) is expected_type and tier.capacity_pages == pages
    with pytest.raises(ValueError, match=rf"{option} of 999 bytes holds no page of 1,000 bytes"):
        make_tier(EngineConfig(**disk, **{option: page_bytes - 1}), page_bytes)
    assert make_tier(EngineConfig(), page_bytes) is None


def test_the_engine_counts_tier_misses_and_loads_apart_from_stores_and_drops(device):
    """A prompt seen first misses in the tier, pages evicted by others are stored, and the
    prompt seen again loads them back; a host tier with room drops nothing."""
    from kvpool import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    llm = LLM("tiny", num_pages=10, device=device, enforce_eager=True,
              host_tier_memory=2**22)
    prompt = list(range(1, 70))  # 4 full pages of 16 tokens and a partial one
    fillers = [[(37 * i + 11 * j) % 250 + 5 for j in range(70)] for i in range(3)]
    for p in [prompt, *fillers, prompt]:
        llm.generate([p], greedy, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_tier_misses > 0 and stats.num_tier_dropped == 0
    assert stats.num_tier_loads == 4 and stats.num_tier_stores > stats.num_tier_loads
