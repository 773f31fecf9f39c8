"""MambaPool: state slots handed out with a free list and reference counts, their copies,
and a random operation sequence against a reference model with check() after every step."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from depth import examples
from kvpool.errors import InvalidStateSlot, OutOfMemory, OutOfStateSlots
from kvpool.memory.state_pool import MambaLayout, MambaPool, slots_within

LAYOUT = MambaLayout(num_layers=3, conv_dim=10, conv_kernel=4, num_heads=2, head_dim=3,
                     state_size=5, dtype=torch.float32)


def pool(num_slots=4, *, device):
    return MambaPool(LAYOUT, num_slots, device=device)


def test_bytes_per_slot_counts_conv_and_ssm_states_of_every_layer(device):
    assert LAYOUT.bytes_per_slot == 3 * (10 * 3 + 2 * 3 * 5) * 4
    # the padding slot included
    assert pool(4, device=device).nbytes == (4 + 1) * LAYOUT.bytes_per_slot


def test_state_views_are_shaped_per_slot_the_padding_slot_last(device):
    p = pool(4, device=device)
    assert p.conv[1].shape == (4 + 1, 10, 3)
    assert p.ssm[2].shape == (4 + 1, 2, 3, 5)


def test_the_padding_slot_is_never_allocated_or_counted(device):
    p = pool(2, device=device)
    assert p.padding_slot == 2
    assert sorted([p.allocate(), p.allocate()]) == [0, 1]
    with pytest.raises(OutOfStateSlots):
        p.allocate()
    stats = p.stats()
    assert (stats.num_slots, stats.num_used, stats.num_free, stats.num_reserved) == (2, 2, 0, 1)
    with pytest.raises(ValueError, match="slot"):
        p.share(p.padding_slot)
    p.check()


def test_slots_within_a_budget_leave_room_for_the_padding_slot(device):
    slot = LAYOUT.bytes_per_slot
    assert slots_within(LAYOUT, 5 * slot) == 4 and slots_within(LAYOUT, 2 * slot - 1) == 0
    assert pool(slots_within(LAYOUT, 5 * slot), device=device).nbytes == 5 * slot


def test_fresh_pool_hands_out_slots_ascending_and_reuses_the_last_freed_first(device):
    p = pool(4, device=device)
    assert [p.allocate() for _ in range(3)] == [0, 1, 2]
    p.free(1)
    assert p.allocate() == 1


def test_exhausted_pool_names_the_numbers_and_changes_nothing(device):
    p = pool(2, device=device)
    p.allocate(), p.allocate()
    with pytest.raises(OutOfStateSlots, match="need 1 state slot, 0 free of 2"):
        p.allocate()
    assert (p.num_free, p.stats().num_failed) == (0, 1)
    p.check()


def test_shared_slot_returns_to_the_free_list_with_its_last_holder(device):
    p = pool(device=device)
    slot = p.allocate()
    p.share(slot)
    assert p.free(slot) is False and p.refcount(slot) == 1
    assert p.free(slot) is True and p.refcount(slot) == 0


def test_double_free_is_refused(device):
    p = pool(device=device)
    p.free(p.allocate())
    with pytest.raises(InvalidStateSlot, match="state slot 0 is not allocated"):
        p.free(0)
    p.check()


def test_slot_out_of_range_is_a_value_error(device):
    with pytest.raises(ValueError, match=r"slot must be in \[0, 3\], got 4"):
        pool(device=device).share(4)


def test_copy_copies_every_layers_conv_and_ssm_state(device):
    p = pool(device=device)
    src, dst = p.allocate(), p.allocate()
    p.conv[:, src] = torch.randn(3, 10, 3, device=device)
    p.ssm[:, src] = torch.randn(3, 2, 3, 5, device=device)
    p.copy(src, dst)
    assert torch.equal(p.conv[:, dst], p.conv[:, src])
    assert torch.equal(p.ssm[:, dst], p.ssm[:, src])
    assert p.stats().num_copies == 1


def test_copy_into_a_free_slot_is_refused(device):
    p = pool(device=device)
    with pytest.raises(InvalidStateSlot):
        p.copy(p.allocate(), 3)


def test_copy_slots_of_unequal_lengths_is_refused_copying_nothing(device):
    p = pool(device=device)
    p.conv[:, 0], p.ssm[:, 0] = 1.0, 2.0
    conv, ssm = p.conv.clone(), p.ssm.clone()
    with pytest.raises(ValueError, match="as many sources as destinations, got 1 and 2"):
        p.copy_slots([0], [1, 2])
    assert torch.equal(p.conv, conv) and torch.equal(p.ssm, ssm)


def test_copy_slots_into_the_padding_slot_is_refused_naming_the_range(device):
    p = pool(device=device)
    p.conv[:, 0], p.ssm[:, 0] = 1.0, 2.0
    conv, ssm = p.conv.clone(), p.ssm.clone()
    with pytest.raises(IndexError, match=r"state slots must lie in \[0, 4\), got 4"):
        p.copy_slots([0], [p.padding_slot])
    assert torch.equal(p.conv, conv) and torch.equal(p.ssm, ssm)


def test_layout_rejects_a_conv_kernel_below_two_and_a_shape_past_int64():
    with pytest.raises(ValueError, match="conv_kernel must be in \\[2, "):
        MambaLayout(1, 4, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=f"conv_dim must be in \\[1, {2**63 - 1}\\], got {2**63}"):
        MambaLayout(1, 2**63, 4, 1, 1, 1)


@pytest.mark.parametrize("layout, num_slots, nbytes", [
    (MambaLayout(2**20, 2**20, 4, 2, 4, 8), 2**20, "6,917,676,362,333,421,568"),  # too big
    (MambaLayout(2**40, 2**40, 4, 2, 4, 8), 4, "36,267,774,589,142,562,682,961,920"),  # past int64
])
def test_a_pool_that_cannot_be_allocated_is_out_of_memory_naming_the_bytes(layout, num_slots,
                                                                           nbytes):
    with pytest.raises(OutOfMemory, match=f"needs {nbytes} bytes on cpu"):
        MambaPool(layout, num_slots, device="cpu")


def test_a_layout_that_is_not_a_mamba_layout_is_a_type_error():
    with pytest.raises(TypeError, match="layout must be a MambaLayout, got str"):
        MambaPool("x", 4, device="cpu")


@pytest.mark.parametrize("src, dst, bad", [
    ([0.5], [1], "float 0.5"),
    ([False, True], [0, 1], "bool False"),  # not a mask
    ([0], [True], "bool True"),
    (["a"], [1], "str 'a'"),
])
def test_copy_slots_refuses_slot_ids_that_are_not_ints_copying_nothing(device, src, dst, bad):
    p = pool(device=device)
    p.conv[:, 0], p.conv[:, 1] = 10.0, 11.0
    before = p.conv.clone()
    with pytest.raises(TypeError, match=f"state slots must be ints, got {bad}"):
        p.copy_slots(src, dst)
    assert torch.equal(p.conv, before)


def test_write_refuses_state_data_that_is_not_tensors(device):
    p = pool(device=device)
    slot = p.allocate()
    conv, ssm = p.read(slot)
    with pytest.raises(TypeError, match="state data must be torch.float32 tensors, got a "
                                        "list conv state"):
        p.write(slot, conv.tolist(), ssm)
    with pytest.raises(TypeError, match="got a list ssm state"):
        p.write(slot, conv + 1, ssm.tolist())
    assert torch.equal(p.conv[:, slot], conv)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float64])
def test_write_refuses_state_data_of_another_dtype_changing_neither_state(device, dtype):
    p = pool(device=device)
    slot = p.allocate()
    conv, ssm = p.read(slot)
    with pytest.raises(TypeError, match=f"state data must be torch.float32 tensors, got a "
                                        f"{dtype} ssm state"):
        p.write(slot, conv + 1, torch.full_like(ssm, 2**40, dtype=dtype))
    assert not p.conv.any() and not p.ssm.any()


def test_write_refuses_a_state_of_another_shape_even_one_that_broadcasts(device):
    p = pool(device=device)
    slot = p.allocate()
    conv, ssm = p.read(slot)
    with pytest.raises(ValueError, match=r"a conv state of shape \(3, 10, 3\) was expected, "
                                         r"got \(3, 10, 1\)"):
        p.write(slot, torch.ones(3, 10, 1, device=device), ssm)
    with pytest.raises(ValueError, match=r"a ssm state of shape \(3, 2, 3, 5\) was expected, "
                                         r"got \(3, 2, 1, 5\)"):
        p.write(slot, conv, torch.ones(3, 2, 1, 5, device=device))
    assert not p.conv.any() and not p.ssm.any()


def test_read_returns_copies_that_leave_the_pool_unchanged(device):
    p = pool(device=device)
    slot = p.allocate()
    conv, ssm = p.read(slot)
    conv += 1
    ssm += 1
    assert not p.conv.any() and not p.ssm.any()


class MambaPoolMachine(RuleBasedStateMachine):
    """The model: the reference count of each held slot, the free slots as a stack, and the
    counters stats() reports."""

    def __init__(self):
        super().__init__()
        self.pool = pool(6, device="cpu")
        self.refs = {}
        self.free = list(range(5, -1, -1))
        self.failed = 0
        self.allocated = self.freed = self.peak = 0

    @rule()
    def allocate(self):
        if not self.free:
            with pytest.raises(OutOfStateSlots):
                self.pool.allocate()
            self.failed += 1
            return
        expected = self.free.pop()
        assert self.pool.allocate() == expected
        self.refs[expected] = 1
        self.allocated += 1
        self.peak = max(self.peak, len(self.refs))

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        slot = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.share(slot)
        self.refs[slot] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_one(self, data):
        slot = data.draw(st.sampled_from(sorted(self.refs)))
        self.refs[slot] -= 1
        released = not self.refs[slot]
        if released:
            del self.refs[slot]
            self.free.append(slot)
            self.freed += 1
        assert self.pool.free(slot) is released

    @rule(slot=st.integers(0, 5))
    def free_unheld_is_refused(self, slot):
        if slot in self.refs:
            return
        with pytest.raises(InvalidStateSlot):
            self.pool.free(slot)

    @invariant()
    def agrees_with_the_model(self):
        self.pool.check()
        assert [self.pool.refcount(s) for s in range(6)] == [self.refs.get(s, 0)
                                                           for s in range(6)]
        stats = self.pool.stats()
        assert (stats.num_free, stats.num_used, stats.num_failed) == (
            len(self.free), len(self.refs), self.failed)
        assert (stats.num_allocated, stats.num_freed, stats.peak_used) == (
            self.allocated, self.freed, self.peak)


TestMambaPoolMachine = MambaPoolMachine.TestCase
TestMambaPoolMachine.settings = settings(max_examples=examples(60),
                                         stateful_step_count=30, deadline=None)
