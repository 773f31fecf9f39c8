"""Workspace: scratch memory allocated once at start-up and handed out again every step, a
bump allocator over one byte tensor: `alloc` carves the next aligned range, `reset` (once a
step) takes everything back. A step's scratch costs no allocation and is planned once."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvpool.devices import check_device
from kvpool.errors import KVPoolError, OutOfMemory
from kvpool.numeric import INT64_MAX

ALIGNMENT = 256  # bytes; what CUDA's own allocator aligns to, enough for any dtype and vector load


class WorkspaceFull(KVPoolError, MemoryError):
    """An `alloc` asked for more bytes than the workspace has left."""


class Workspace:
    """`nbytes` bytes on `device`, handed out by `alloc(shape, dtype)` until `reset()`."""

    def __init__(self, nbytes: int, *, device: str | torch.device):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"workspace size must be an int >= 0 bytes, got {nbytes!r}")
        self.device = check_device(device)
        if nbytes > INT64_MAX:
            raise OutOfMemory(f"a workspace of {nbytes:,} bytes on {self.device} cannot be "
                              f"allocated: more bytes than int64 counts")
        try:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation either way
            raise OutOfMemory(f"a workspace of {nbytes:,} bytes on {self.device} cannot be "
                              f"allocated: {e}") from None
        self.used = 0  # bytes handed out since the last reset, alignment padding included
        self.peak = 0  # the most bytes ever in use at once
        self.num_allocs = 0  # allocations since the last reset

    @property
    def nbytes(self) -> int:
        """Size of the workspace in bytes."""
        return self.buffer.numel()

    def alloc(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` in the workspace, valid
        until the next `reset`. Raises WorkspaceFull (nothing changed) if it does not fit;
        TypeError for a shape that is not a tuple (or torch.Size) of ints or a dtype that is
        not a torch.dtype, ValueError for a negative size."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if not isinstance(shape, tuple) or any(type(n) is not int or n < 0 for n in shape):
            _check_shape(shape)
        size = math.prod(shape) * dtype.itemsize
        start = -(-self.used // ALIGNMENT) * ALIGNMENT
        if start + size > self.nbytes:
            raise WorkspaceFull(
                f"workspace alloc of {size} bytes ({shape}, {dtype}) needs {start + size} bytes "
                f"in all, the workspace holds {self.nbytes} ({self.used} in use)")
        self.used = start + size
        self.peak = max(self.peak, self.used)
        self.num_allocs += 1
        return self.buffer[start:start + size].view(dtype).view(shape)

    @contextmanager
    def scope(self) -> Iterator[Workspace]:
        """Take back, on exit, what is allocated inside: scratch that one kernel call uses and
        the next one reuses. Work queued on one stream runs in order, so the next call's
        writes land after this call's reads."""
        used, num_allocs = self.used, self.num_allocs
        try:
            yield self
        finally:
            self.used, self.num_allocs = used, num_allocs

    def reset(self) -> None:
        """Take every allocation back (their tensors must no longer be used)."""
        self.used = 0
        self.num_allocs = 0

    def check(self) -> None:
        """The buffer is bytes, use and peak lie within it; AssertionError naming what broke."""
        assert self.buffer.dim() == 1 and self.buffer.dtype == torch.uint8, "buffer is not bytes"
        assert 0 <= self.used <= self.nbytes, f"used {self.used} outside [0, {self.nbytes}]"
        assert self.used <= self.peak <= self.nbytes, (
            f"peak {self.peak} below used {self.used} or above {self.nbytes}")
        assert self.num_allocs > 0 or self.used == 0, (
            f"no allocation but {self.used} bytes used")


def _check_shape(shape: object) -> None:
    """TypeError unless `shape` is a tuple (or torch.Size) of ints, ValueError for a negative
    one (what `alloc`'s one-pass test of plain ints did not let through)."""
    if not isinstance(shape, tuple) or any(isinstance(n, bool) or not isinstance(n, int)
                                           for n in shape):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__} {shape!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must be ints >= 0, got {shape!r}")
