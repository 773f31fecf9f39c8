"""MambaPool: the recurrent states of a hybrid model's Mamba layers, beside the KV pages. A
Mamba layer keeps one fixed-size state per sequence, overwritten in place at every token: the
last `conv_kernel - 1` inputs of its causal convolution and its SSM state."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvpool.devices import check_device
from kvpool.errors import (
    MAX_PAGES,
    InvalidStateSlot,
    OutOfMemory,
    OutOfPages,
    OutOfStateSlots,
    check_int,
)
from kvpool.memory.allocator import PageAllocator
from kvpool.numeric import check_int64

RESERVED_SLOTS = 1  # the padding slot, which padded rows of a CUDA-graph step use
MOST_SLOTS = MAX_PAGES - RESERVED_SLOTS  # slot ids, the padding slot's too, fit in int32


@dataclass(frozen=True, slots=True)
class MambaLayout:
    """Geometry of one state slot: for each of `num_layers` Mamba layers, a conv state of
    `conv_dim` channels x `conv_kernel - 1` past inputs and an SSM state of `num_heads` x
    `head_dim` x `state_size` elements, all of `dtype`."""

    num_layers: int
    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    state_size: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "conv_dim", "num_heads", "head_dim", "state_size"):
            check_int64(name, getattr(self, name), 1)  # tensor shapes are int64
        check_int64("conv_kernel", self.conv_kernel, 2)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")

    @property
    def conv_shape(self) -> tuple[int, int]:
        """Shape of one layer's conv state: (channels, past inputs)."""
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's SSM state: (heads, head_dim, state_size)."""
        return self.num_heads, self.head_dim, self.state_size

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one state slot over all Mamba layers."""
        elements = math.prod(self.conv_shape) + math.prod(self.ssm_shape)
        return self.num_layers * elements * self.dtype.itemsize


def slots_within(layout: MambaLayout, nbytes: int) -> int:
    """The num_slots of the largest MambaPool of `layout` that fits in `nbytes`, its reserved
    slots included (0 when not even one slot fits beside them, at most MOST_SLOTS)."""
    return min(max(nbytes // layout.bytes_per_slot - RESERVED_SLOTS, 0), MOST_SLOTS)


@dataclass(frozen=True, slots=True)
class StateStats:
    """Counters of a MambaPool (slots; cumulative where marked)."""

    num_slots: int
    num_free: int
    num_used: int
    peak_used: int
    num_allocated: int  # cumulative
    num_freed: int  # cumulative: slots that went back to the free list
    num_failed: int  # cumulative: allocations refused
    num_copies: int  # cumulative: slot-to-slot state copies
    num_reserved: int = RESERVED_SLOTS  # set aside beyond num_slots: never free or used


class MambaPool:
    """`num_slots` state slots per Mamba layer and the `padding_slot` after them, allocated
    once on `device`: `conv` `[layers, num_slots + 1, *conv_shape]` and `ssm` `[layers,
    num_slots + 1, *ssm_shape]`. A PageAllocator (lifo) hands out the slots and keeps their
    reference counts; the padding slot, which padded rows of a CUDA-graph step use, is never
    allocated or counted as used. Allocating a slot never touches its contents: a sequence's
    first step starts from a zero state without reading it."""

    def __init__(self, layout: MambaLayout, num_slots: int, *, device: str | torch.device):
        if not isinstance(layout, MambaLayout):
            raise TypeError(f"layout must be a MambaLayout, got {type(layout).__name__}")
        num_slots = check_int("num_slots", num_slots, 1, MOST_SLOTS)
        self.device = check_device(device)
        layers, rows = layout.num_layers, num_slots + RESERVED_SLOTS
        nbytes = rows * layout.bytes_per_slot
        try:
            self.conv = torch.zeros((layers, rows, *layout.conv_shape), dtype=layout.dtype,
                                    device=self.device)
            self.ssm = torch.zeros((layers, rows, *layout.ssm_shape), dtype=layout.dtype,
                                   device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation either way
            raise OutOfMemory(f"a state pool of {num_slots:,} slots and {RESERVED_SLOTS} "
                              f"reserved needs {nbytes:,} bytes on {self.device}, which cannot "
                              f"be allocated: {e}") from None
        self.allocator = PageAllocator(num_slots, thread_safe=False)
        self.layout = layout
        # Called with (src, dst) after every copy: the tensor-parallel ranks' pools repeat this
        # pool's copies (kvpool.engine.parallel).
        self.copy_listeners: list[Callable[[Sequence[int], Sequence[int]], None]] = []
        self._copies = 0

    @property
    def num_slots(self) -> int:
        """State slots in the pool, the padding slot not counted."""
        return self.allocator.num_pages

    @property
    def padding_slot(self) -> int:
        """The reserved slot (num_slots)."""
        return self.num_slots

    @property
    def num_free(self) -> int:
        """Slots on the free list."""
        return self.allocator.num_free

    @property
    def nbytes(self) -> int:
        """Bytes of the state tensors, the padding slot's included."""
        return (self.num_slots + RESERVED_SLOTS) * self.layout.bytes_per_slot

    def allocate(self) -> int:
        """A free slot, with reference count 1. Raises OutOfStateSlots (nothing changed)."""
        try:
            return self.allocator.allocate(1)[0]
        except OutOfPages:
            raise OutOfStateSlots(f"need 1 state slot, 0 free of {self.num_slots}") from None

    def share(self, slot: int) -> None:
        """One more holder of an allocated slot (reference count + 1)."""
        self.allocator.hold([self._check_held(slot)])

    def free(self, slot: int) -> bool:
        """One holder fewer; True if the slot went back to the free list."""
        return bool(self.allocator.drop([self._check_held(slot)]))

    def refcount(self, slot: int) -> int:
        """Holders of `slot` (0: free)."""
        return self.allocator.refcount(check_int("slot", slot, 0, self.num_slots - 1))

    def copy(self, src: int, dst: int) -> None:
        """Copy the state of slot `src` into slot `dst`, every layer (both held)."""
        self.copy_slots([self._check_held(src)], [self._check_held(dst)])
        self._copies += 1

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the states of slots src[i] -> dst[i], every layer, whoever holds them: a
        tensor-parallel worker repeats rank 0's copies, whose reference counts only rank 0
        keeps. TypeError for a slot id that is not an int (bools included), IndexError for
        one outside [0, num_slots); nothing copied."""
        if len(src) != len(dst):
            raise ValueError(f"copy_slots needs as many sources as destinations, "
                             f"got {len(src)} and {len(dst)}")
        for slot in (*src, *dst):
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise TypeError(f"state slots must be ints, got {type(slot).__name__} {slot!r}")
            if not 0 <= slot < self.num_slots:
                raise IndexError(f"state slots must lie in [0, {self.num_slots}), got {slot}")
        if src:
            src_rows = torch.tensor(src, device=self.device)
            dst_rows = torch.tensor(dst, device=self.device)
            self.conv[:, dst_rows] = self.conv[:, src_rows]
            self.ssm[:, dst_rows] = self.ssm[:, src_rows]
            for listener in self.copy_listeners:
                listener(src, dst)

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the state in `slot` (held), every layer: conv `[layers, *conv_shape]` and
        SSM `[layers, *ssm_shape]`."""
        self._check_held(slot)
        return self.conv[:, slot].clone(), self.ssm[:, slot].clone()

    def write(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store a state shaped and typed as `read` returns it into `slot` (held): TypeError
        for data that is not tensors of the pool's dtypes, ValueError for another shape,
        nothing changed."""
        self._check_held(slot)
        for name, x, rows in (("conv", conv, self.conv), ("ssm", ssm, self.ssm)):
            if not isinstance(x, torch.Tensor) or x.dtype != rows.dtype:
                got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(f"state data must be {rows.dtype} tensors, got a {got} {name} "
                                f"state")
            if x.shape != rows[:, slot].shape:
                raise ValueError(f"a {name} state of shape {tuple(rows[:, slot].shape)} was "
                                 f"expected, got {tuple(x.shape)}")
        conv, ssm = conv.to(self.conv.device), ssm.to(self.ssm.device)  # both before either
        self.conv[:, slot], self.ssm[:, slot] = conv, ssm

    def stats(self) -> StateStats:
        """The pool's counters now."""
        counts = self.allocator.stats()
        return StateStats(counts.num_pages, counts.num_free, counts.num_used, counts.peak_used,
                          counts.num_allocated, counts.num_freed, counts.num_failed,
                          self._copies)

    def check(self) -> None:
        """The allocator's invariants (every slot free or held, none twice), and the state
        tensors hold one row more, the padding slot; AssertionError naming what is broken."""
        self.allocator.check()
        rows = self.num_slots + RESERVED_SLOTS
        assert self.conv.shape[1] == self.ssm.shape[1] == rows, (
            f"the state tensors hold {self.conv.shape[1]} and {self.ssm.shape[1]} slots for "
            f"{self.num_slots} and {RESERVED_SLOTS} reserved")

    def _check_held(self, slot: int) -> int:
        """`slot`, if it is allocated; ValueError out of range, InvalidStateSlot if free."""
        if not self.refcount(slot):
            raise InvalidStateSlot(f"state slot {slot} is not allocated")
        return slot


class CheckpointRequest(NamedTuple):
    """Save sequence `index`'s state after its first `num_tokens` tokens into `slot`."""

    index: int  # in the step's batch
    num_tokens: int
    slot: int


@dataclass(slots=True)
class StateBatch:
    """The state slots of one step's sequences, in batch order (`slots` `[batch]` int64),
    the pool they index, and the checkpoints to save during the step: what a hybrid model's
    Mamba layers read and write."""

    pool: MambaPool
    slots: torch.Tensor
    checkpoints: list[CheckpointRequest] = field(default_factory=list)
