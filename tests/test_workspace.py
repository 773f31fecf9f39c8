"""Workspace: a bump allocator over one tensor, reset per step."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import OutOfMemory
from kvpool.memory.workspace import ALIGNMENT, Workspace, WorkspaceFull


def test_alloc_returns_tensors_of_the_shape_and_dtype_inside_the_buffer(device):
    ws = Workspace(4096, device=device)
    a = ws.alloc((3, 5), torch.float32)
    b = ws.alloc((7,), torch.int64)
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((3, 5), torch.float32, (7,), torch.int64)
    assert a.is_contiguous() and b.is_contiguous()
    base = ws.buffer.data_ptr()
    assert a.data_ptr() == base and b.data_ptr() == base + ALIGNMENT
    assert ws.used == ALIGNMENT + 56


def test_allocations_do_not_overlap(device):
    ws = Workspace(4096, device=device)
    a, b = ws.alloc((10,), torch.float32), ws.alloc((10,), torch.float32)
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.tolist() == [1.0] * 10


def test_reset_hands_the_same_memory_out_again(device):
    ws = Workspace(1024, device=device)
    first = ws.alloc((16,), torch.float16).data_ptr()
    ws.reset()
    assert ws.used == 0 and ws.alloc((16,), torch.float16).data_ptr() == first


def test_reset_zeroes_the_bytes_used_and_the_allocation_count(device):
    ws = Workspace(1024, device=device)
    ws.alloc((8,), torch.uint8)
    ws.alloc((8,), torch.uint8)
    ws.reset()
    assert (ws.used, ws.num_allocs) == (0, 0)
    ws.check()


def test_the_buffer_is_allocated_once(device):
    ws = Workspace(1024, device=device)
    ptr = ws.buffer.data_ptr()
    for _ in range(3):
        ws.alloc((8,), torch.float32)
        ws.reset()
    assert ws.buffer.data_ptr() == ptr and ws.nbytes == 1024


def test_an_alloc_that_does_not_fit_names_the_numbers_and_changes_nothing(device):
    ws = Workspace(1024, device=device)
    ws.alloc((100,), torch.uint8)
    with pytest.raises(WorkspaceFull, match="800 bytes .* needs 1056 .* holds 1024 .100 in use"):
        ws.alloc((200,), torch.float32)
    assert (ws.used, ws.num_allocs, ws.peak) == (100, 1, 100)
    ws.check()


def test_peak_remembers_the_largest_step(device):
    ws = Workspace(4096, device=device)
    ws.alloc((1000,), torch.uint8)
    ws.reset()
    ws.alloc((10,), torch.uint8)
    assert (ws.used, ws.peak) == (10, 1000)


@pytest.mark.parametrize(("nbytes", "error"), [(-1, ValueError), (1.5, ValueError),
                                               (True, ValueError)])
def test_bad_sizes_are_refused(nbytes, error, device):
    with pytest.raises(error, match="workspace size"):
        Workspace(nbytes, device=device)


@pytest.mark.parametrize("nbytes", [2**63, 10**30])
def test_a_workspace_no_memory_can_hold_is_out_of_memory_naming_the_bytes(nbytes, device):
    with pytest.raises(OutOfMemory, match=f"a workspace of {nbytes:,} bytes"):
        Workspace(nbytes, device=device)


def test_bad_shapes_are_refused(device):
    with pytest.raises(ValueError, match="shape"):
        Workspace(64, device=device).alloc((2, -1), torch.float32)


@pytest.mark.parametrize(("shape", "dtype", "message"), [
    ((4,), "float32", "dtype must be a torch.dtype, got str 'float32'"),
    ((4,), None, "dtype must be a torch.dtype, got NoneType None"),
    (4, torch.float32, "shape must be a tuple of ints, got int 4"),
    (None, torch.float32, "shape must be a tuple of ints, got NoneType None"),
    ((2.0,), torch.float32, r"shape must be a tuple of ints, got tuple \(2.0,\)"),
    ((True,), torch.float32, r"shape must be a tuple of ints, got tuple \(True,\)"),
])
def test_alloc_names_a_shape_or_dtype_of_another_type_and_changes_nothing(shape, dtype, message,
                                                                          device):
    ws = Workspace(64, device=device)
    with pytest.raises(TypeError, match=message):
        ws.alloc(shape, dtype)
    assert (ws.used, ws.peak, ws.num_allocs) == (0, 0, 0)


def _overlap(a, b):
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 300),
                                                st.sampled_from([torch.uint8, torch.bfloat16,
                                                                 torch.float32, torch.int64]))),
                max_size=30))
def test_random_allocs_and_resets_keep_the_invariants(ops):
    ws = Workspace(2048, device="cpu")
    live = []
    for op in ops:
        if op is None:
            ws.reset()
            live = []
        else:
            n, dtype = op
            used = ws.used
            fits = -(-used // ALIGNMENT) * ALIGNMENT + n * dtype.itemsize <= ws.nbytes
            try:
                t = ws.alloc((n,), dtype)
            except WorkspaceFull:
                assert not fits and ws.used == used
            else:
                assert fits and t.shape == (n,) and t.dtype == dtype
                if n > 0:  # an empty tensor has no address
                    assert (t.data_ptr() - ws.buffer.data_ptr()) % ALIGNMENT == 0
                    assert not any(_overlap(t, other) for other in live)
                    live.append(t)
        ws.check()


def test_scope_takes_back_what_was_allocated_inside_it(device):
    workspace = Workspace(4096, device=device)
    kept = workspace.alloc((16,), torch.int64)
    with workspace.scope():
        first = workspace.alloc((8,), torch.float32)
    with workspace.scope():
        second = workspace.alloc((8,), torch.float32)
    assert first.data_ptr() == second.data_ptr() != kept.data_ptr()
    assert workspace.used == 128 and workspace.num_allocs == 1
    workspace.check()


def test_scope_takes_back_what_was_allocated_inside_it_when_the_block_raises(device):
    workspace = Workspace(4096, device=device)
    workspace.alloc((16,), torch.int64)
    with pytest.raises(RuntimeError, match="kernel failed"), workspace.scope():
        workspace.alloc((512,), torch.uint8)
        raise RuntimeError("kernel failed")
    assert workspace.used == 128 and workspace.num_allocs == 1
    workspace.check()
