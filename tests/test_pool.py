"""KVPool: one tensor, per-layer views, writes by slot, page copies for CoW and tiers, and
the reserved padding page beside the allocator's pages."""

import pytest
import torch

from kvpool.errors import InvalidPage, OutOfMemory
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool, pages_within

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=4)


def make_pool(num_pages=5, *, device):
    pool = KVPool(LAYOUT, num_pages, device=device)
    pool.kv.zero_()
    return pool


def test_pool_is_one_tensor_of_the_documented_shape(device):
    pool = make_pool(device=device)
    assert pool.kv.shape == (3, 2, 5 + 1, 4, 2, 4)  # the padding page last
    assert pool.nbytes == 3 * 2 * 6 * 4 * 2 * 4 * 4 == 6 * LAYOUT.bytes_per_page
    assert (pool.num_pages, pool.num_reserved_pages) == (5, 1)


def test_the_padding_page_is_the_page_after_the_allocators(device):
    pool = make_pool(device=device)
    assert (pool.padding_page, pool.padding_slot) == (5, 20)
    pool.check()


def test_writes_reach_the_padding_page_and_page_calls_refuse_it(device):
    pool = make_pool(device=device)
    k = torch.ones(1, 2, 4, device=device)
    pool.write(0, torch.tensor([pool.padding_slot], device=device), k, -k)
    assert torch.equal(pool.k_cache(0)[pool.padding_page, 0], k[0])
    assert torch.count_nonzero(pool.kv[:, :, :5]) == 0
    for call in (lambda: pool.read_pages([5]), lambda: pool.scrub_pages([5]),
                 lambda: pool.copy_pages([0], [5])):
        with pytest.raises(InvalidPage, match=r"page ids must lie in \[0, 5\), got min 5"):
            call()


def test_pages_within_a_budget_leave_room_for_the_reserved_page(device):
    page = LAYOUT.bytes_per_page
    assert pages_within(LAYOUT, 10 * page) == 9
    assert pages_within(LAYOUT, 10 * page - 1) == 8
    assert pages_within(LAYOUT, 2 * page - 1) == pages_within(LAYOUT, -page) == 0
    assert KVPool(LAYOUT, pages_within(LAYOUT, 10 * page), device=device).nbytes == 10 * page


def test_layer_views_share_the_pool_storage(device):
    pool = make_pool(device=device)
    pool.k_cache(1)[2, 3] = 1.0
    pool.v_cache(2)[0, 0] = 2.0
    assert pool.kv[1, 0, 2, 3].eq(1).all() and pool.kv[2, 1, 0, 0].eq(2).all()
    assert pool.k_cache(0).shape == (6, 4, 2, 4)


def test_write_puts_each_token_at_its_slot(device):
    pool = make_pool(device=device)
    k = torch.arange(2 * 2 * 4, dtype=torch.float32, device=device).view(2, 2, 4)
    pool.write(1, torch.tensor([5, 18], device=device), k, -k)
    assert torch.equal(pool.k_cache(1)[1, 1], k[0])  # slot 5 = page 1, offset 1
    assert torch.equal(pool.v_cache(1)[4, 2], -k[1])  # slot 18 = page 4, offset 2
    assert torch.count_nonzero(pool.kv[0]) == 0 and torch.count_nonzero(pool.kv[2]) == 0


@pytest.mark.parametrize("slots", [[1.7], [True], [1]], ids=["float", "bool", "list"])
def test_write_refuses_slots_that_are_not_an_integer_tensor(device, slots):
    pool = make_pool(device=device)
    k = torch.ones(1, 2, 4, device=device)
    index = slots if slots == [1] else torch.tensor(slots, device=device)
    with pytest.raises(TypeError, match="slots must be an integer tensor"):
        pool.write(0, index, k, k)
    assert torch.count_nonzero(pool.kv) == 0


def test_copy_pages_copies_every_layer(device):
    pool = make_pool(device=device)
    pool.kv[:, :, 1] = torch.randn(3, 2, 4, 2, 4, device=device)
    pool.copy_pages([1], [3])
    assert torch.equal(pool.kv[:, :, 3], pool.kv[:, :, 1])
    assert torch.count_nonzero(pool.kv[:, :, 2]) == 0


def test_read_pages_then_write_pages_round_trips(device):
    pool = make_pool(device=device)
    pool.kv.normal_()
    data = pool.read_pages([4, 0])
    other = make_pool(device=device)
    other.write_pages([1, 2], data)
    assert torch.equal(other.kv[:, :, 1], pool.kv[:, :, 4])
    assert torch.equal(other.kv[:, :, 2], pool.kv[:, :, 0])


def test_write_pages_rejects_the_wrong_shape(device):
    pool = make_pool(device=device)
    with pytest.raises(ValueError, match=r"expected data of shape \(3, 2, 2, 4, 2, 4\)"):
        pool.write_pages([0, 1], torch.zeros(3, 2, 1, 4, 2, 4, device=device))


def test_scrub_pages_zeroes_only_those_pages(device):
    pool = make_pool(device=device)
    pool.kv.fill_(1.0)
    pool.scrub_pages([2])
    assert torch.count_nonzero(pool.kv[:, :, 2]) == 0
    assert pool.kv[:, :, 3].eq(1).all()


def test_out_of_range_page_ids_are_invalid_pages(device):
    pool = make_pool(device=device)
    with pytest.raises(InvalidPage, match=r"\[0, 5\).*max 5"):
        pool.copy_pages([0], [5])
    with pytest.raises(InvalidPage, match="min -1"):
        pool.read_pages([-1])


def test_page_calls_refuse_a_zero_dimensional_tensor_of_ids(device):
    pool = make_pool(device=device)
    pool.kv.fill_(1.0)
    for call in (pool.read_pages, pool.scrub_pages):
        with pytest.raises(ValueError, match=r"expected a flat list of page ids, got shape \(\)"):
            call(torch.tensor(1))
    assert pool.kv.eq(1.0).all()


@pytest.mark.parametrize(("layer", "error"), [(None, TypeError), (True, TypeError),
                                             ([1], TypeError), (1.0, TypeError),
                                             (-1, ValueError), (3, ValueError),
                                             (2**70, ValueError)])
def test_layer_calls_refuse_what_is_not_a_layer(device, layer, error):
    # A tensor index would take None (a new axis), a bool or a list (a copy), and wrap -1.
    pool = make_pool(device=device)
    k = torch.ones(1, 2, 4, device=device)
    for call in (lambda: pool.write(layer, torch.tensor([5]), k, k),
                 lambda: pool.k_cache(layer), lambda: pool.v_cache(layer),
                 lambda: pool.kv_scales(layer), lambda: pool.calibrate(layer, k, k)):
        with pytest.raises(error, match="layer"):
            call()
    assert not pool.kv.any()


@pytest.mark.parametrize("pages", [[1.9], [True], [float("nan")], [0, 2.5]])
def test_page_calls_refuse_ids_that_are_not_ints(device, pages):
    pool = make_pool(device=device)
    pool.kv.fill_(1.0)
    for call in (lambda: pool.scrub_pages(pages), lambda: pool.copy_pages(pages, [0] * len(pages)),
                 lambda: pool.read_pages(pages)):
        with pytest.raises(TypeError, match="page ids must be ints"):
            call()
    assert pool.kv.eq(1.0).all()


def test_copy_pages_needs_matching_lengths(device):
    with pytest.raises(ValueError, match="got 2 and 1"):
        make_pool(device=device).copy_pages([0, 1], [2])


@pytest.mark.parametrize(("bad", "error", "message"), [
    (0, ValueError, r"num_pages must be in \[1, 2147483646\], got 0"),
    (-3, ValueError, r"num_pages must be in \[1, 2147483646\], got -3"),
    # the padding page's id, num_pages, must fit an int32 page table too
    (2**31 - 1, ValueError, r"num_pages must be in \[1, 2147483646\], got 2147483647"),
    (2.5, TypeError, "num_pages must be an int, got float 2.5"),
    (True, TypeError, "num_pages must be an int, got bool True"),
])
def test_pool_size_must_be_a_positive_int32(bad, error, message, device):
    with pytest.raises(error, match=message):
        KVPool(LAYOUT, bad, device=device)


def test_a_pool_too_large_for_memory_names_the_bytes():
    huge = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, page_size=16)
    with pytest.raises(OutOfMemory, match=r"a pool of 2,000,000,000 pages and 1 reserved "
                                          r"needs 10,485,760,005,242,880 bytes on cpu"):
        KVPool(huge, 2_000_000_000, device="cpu")


MLA = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4,
               kind="mla")


def test_mla_pool_holds_one_latent_plane_that_is_both_k_and_v(device):
    pool = KVPool(MLA, 5, device=device)
    assert pool.kv.shape == (3, 1, 6, 4, 1, 4)
    assert pool.nbytes == 6 * MLA.bytes_per_page
    assert pool.k_cache(2).data_ptr() == pool.v_cache(2).data_ptr() == pool.kv[2, 0].data_ptr()


def test_mla_pool_writes_the_latent_alone_at_its_slots(device):
    pool = KVPool(MLA, 5, device=device)
    pool.kv.zero_()
    latent = torch.arange(2 * 4, dtype=torch.float32, device=device).view(2, 1, 4) + 1
    pool.write(1, torch.tensor([5, 18], device=device), latent)
    assert torch.equal(pool.k_cache(1)[1, 1], latent[0])
    assert torch.equal(pool.k_cache(1)[4, 2], latent[1])
    assert torch.count_nonzero(pool.kv) == 8


def test_mla_pool_refuses_a_v_and_an_mha_pool_needs_one(device):
    latent = torch.ones(1, 1, 4, device=device)
    with pytest.raises(ValueError, match="a mla pool writes the latent alone"):
        KVPool(MLA, 2, device=device).write(0, torch.tensor([0], device=device), latent, latent)
    with pytest.raises(ValueError, match="a mha pool writes both K and V"):
        make_pool(device=device).write(0, torch.tensor([0], device=device),
                                       torch.ones(1, 2, 4, device=device))


def test_mla_pool_copies_and_moves_pages_like_any_other(device):
    pool = KVPool(MLA, 5, device=device)
    pool.kv.copy_(torch.randn(pool.kv.shape, device=device))
    pool.copy_pages([0, 1], [3, 4])
    assert torch.equal(pool.kv[:, :, 3:5], pool.kv[:, :, 0:2])
    data = pool.read_pages([2])
    assert data.shape == (3, 1, 1, 4, 1, 4)
    pool.write_pages([0], data)
    assert torch.equal(pool.kv[:, :, 0], pool.kv[:, :, 2])
