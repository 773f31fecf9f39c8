"""KVPool: the physical KV storage, one tensor allocated once and never resized."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.errors import MAX_PAGES, InvalidPage, OutOfMemory, check_int
from kvpool.layout import KVLayout


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class KVPool:
    """`num_pages` pages of K and V for every layer, in one tensor shaped
    `[num_layers, num_planes, num_pages, page_size, num_kv_heads, head_dim]`: planes K and V
    (layout kind "mha"), or the one latent plane (kind "mla", whose K and V views are both
    that plane).

    Allocating a page never touches its contents: a fresh or reused page holds whatever
    bits were there, and readers only look at the slots a sequence has written.
    """

    def __init__(self, layout: KVLayout, num_pages: int, *, device=None):
        self.layout = layout
        self.num_pages = check_int("num_pages", num_pages, 1, MAX_PAGES)
        self.device = torch.device(device) if device is not None else default_device()
        shape = (layout.num_layers, layout.num_planes, num_pages, layout.page_size,
                 layout.num_kv_heads, layout.head_dim)
        nbytes = num_pages * layout.bytes_per_page
        try:
            self.kv = torch.empty(shape, dtype=layout.dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation either way
            raise OutOfMemory(f"a pool of {num_pages:,} pages needs {nbytes:,} bytes on "
                              f"{self.device}, which cannot be allocated: {e}") from None

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool tensor."""
        return self.kv.numel() * self.kv.element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer's K pages, a view `[num_pages, page_size, num_kv_heads, head_dim]`."""
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer's V pages, a view `[num_pages, page_size, num_kv_heads, head_dim]` (for "mla",
        the latent plane, as `k_cache`)."""
        return self.kv[layer, self.layout.num_planes - 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        """Write one layer's K/V `[n, num_kv_heads, head_dim]` for n tokens at `slots` [n];
        for "mla" `k` is the latent and `v` must be None."""
        if (v is None) != (self.layout.kind == "mla"):
            raise ValueError(f"a {self.layout.kind} pool writes "
                             f"{'the latent alone' if v is not None else 'both K and V'}")
        flat = self.kv[layer].view(self.layout.num_planes, -1, self.layout.num_kv_heads,
                                   self.layout.head_dim)
        slots = slots.to(device=self.device, dtype=torch.long)
        for plane, x in zip(flat, (k, v) if v is not None else (k,), strict=True):
            plane.index_copy_(0, slots, x.to(flat.dtype))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy pages src[i] -> dst[i] in every layer (copy-on-write, tier loads)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages needs as many sources as destinations, "
                             f"got {len(src)} and {len(dst)}")
        if not src:
            return
        self.kv[:, :, self._index(dst)] = self.kv[:, :, self._index(src)]

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of the pages' KV in every layer: `[num_layers, num_planes, n, page_size,
        kvh, d]`."""
        return self.kv[:, :, self._index(pages)]

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Store `data` (shaped as `read_pages` returns it) into `pages`."""
        expected = (*self.kv.shape[:2], len(pages), *self.kv.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"write_pages expected data of shape {expected}, "
                             f"got {tuple(data.shape)}")
        if pages:
            self.kv[:, :, self._index(pages)] = data.to(self.kv.device, self.kv.dtype)

    def scrub_pages(self, pages: Sequence[int]) -> None:
        """Zero the pages in every layer, so freed KV cannot be read by the next owner."""
        if pages:
            self.kv[:, :, self._index(pages)] = 0

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(pages, dtype=torch.long)
        if index.ndim != 1:
            raise ValueError(f"expected a flat list of page ids, got shape {tuple(index.shape)}")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.num_pages):
            raise InvalidPage(f"page ids must lie in [0, {self.num_pages}), "
                             f"got min {int(index.min())}, max {int(index.max())}")
        return index.to(self.device)
