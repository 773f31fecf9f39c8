"""Checks of kernel inputs that must run on the host before any index is narrowed or used."""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def check_index_dtype(name: str, index: torch.Tensor) -> None:
    """Raise TypeError unless `index` holds integers (a float or bool tensor is no index)."""
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {index.dtype}")


def check_page_tables(page_tables: torch.Tensor, num_pages: int) -> None:
    """Raise TypeError for a non-integer page table, IndexError naming the first entry that is
    no page id in `[0, num_pages)`. Reads the table on the host (a sync on CUDA)."""
    check_index_dtype("page_tables", page_tables)
    if page_tables.numel() == 0:
        return
    lo, hi = torch.aminmax(page_tables)
    if lo < 0 or hi >= num_pages:
        bad = (page_tables < 0) | (page_tables >= num_pages)
        b, i = (int(x) for x in bad.nonzero()[0])
        raise IndexError(
            f"page table entry [{b}, {i}] is page id {int(page_tables[b, i])}, "
            f"outside the cache's [0, {num_pages})"
        )
