"""KVPool: the physical KV storage, one tensor allocated once and never resized."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from kvpool.devices import check_device
from kvpool.errors import MAX_PAGES, InvalidPage, OutOfMemory, check_int
from kvpool.memory.fp8 import check_scale, is_fp8, quantize, scale_of
from kvpool.memory.layout import KVLayout

# One layer's scales, one per plane (K and V, or the MLA latent), and kv_scales' form of them
SCALE_NAMES = {"mha": ("k_scale", "v_scale"), "mla": ("latent_scale",)}
ROW_FORMS = {"mha": "kv_scales must be one (k_scale, v_scale) pair",
             "mla": "an mla layout's kv_scales must be one latent scale (a number)"}
RESERVED_PAGES = 1  # the padding page: padded rows of a CUDA-graph step and unread writes
MOST_PAGES = MAX_PAGES - RESERVED_PAGES  # the largest pool: its page ids fit in int32


def pages_within(layout: KVLayout, nbytes: int) -> int:
    """The num_pages of the largest pool of `layout` that fits in `nbytes`, its reserved
    pages included (0 when not even one page fits beside them, at most MOST_PAGES)."""
    return min(max(nbytes // layout.bytes_per_page - RESERVED_PAGES, 0), MOST_PAGES)


class KVPool:
    """`num_pages` pages of every layer, and the reserved `padding_page` (id num_pages, no
    sequence's), in one tensor on `device` `[num_layers, num_planes, num_pages + 1, page_size,
    num_kv_heads, head_dim]`: planes K and V ("mha"), or the one latent plane ("mla", which K
    and V views both show). Page-level calls take the allocator's ids, [0, num_pages).
    Allocating a page never touches its contents: readers only look at slots a sequence wrote.

    fp8 pages read back through `scales` `[num_layers, num_planes]` (float32, on the device).
    `kv_scales` gives them: one layer's scales for every layer, or one layer's per layer; one
    layer's are a (k_scale, v_scale) pair ("mha") or one number ("mla"). A layer without is
    calibrated by the first K/V written to it, and keeps its scales for the pool's lifetime."""

    def __init__(self, layout: KVLayout, num_pages: int, *, device: str | torch.device,
                 kv_scales=None):
        self.layout = layout
        # the padding page's id, num_pages, travels in int32 page tables too
        self.num_pages = check_int("num_pages", num_pages, 1, MOST_PAGES)
        per_layer = layer_scales(layout, kv_scales)
        self.device = check_device(device)
        shape = (layout.num_layers, layout.num_planes, num_pages + RESERVED_PAGES,
                 layout.page_size, layout.num_kv_heads, layout.head_dim)
        nbytes = (num_pages + RESERVED_PAGES) * layout.bytes_per_page
        try:
            self.kv = torch.empty(shape, dtype=layout.dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation either way
            raise OutOfMemory(f"a pool of {num_pages:,} pages and {RESERVED_PAGES} reserved "
                              f"needs {nbytes:,} bytes on {self.device}, which cannot be "
                              f"allocated: {e}") from None
        self.scales: torch.Tensor | None = None
        # Which layers have their scales, kept on the host: reading `scales` syncs.
        self._has_scales = [per_layer is not None] * layout.num_layers
        self._calibrating = True
        # Called with (src, dst) after every copy_pages: the tensor-parallel ranks' pools
        # repeat this pool's copies (kvpool.engine.parallel).
        self.copy_listeners: list[Callable[[Sequence[int], Sequence[int]], None]] = []
        if self.quantized:
            rows = per_layer or [(1.0,) * layout.num_planes] * layout.num_layers
            self.scales = torch.tensor(rows, dtype=torch.float32, device=self.device)

    @property
    def padding_page(self) -> int:
        """The reserved page (num_pages), which padded rows of a CUDA-graph step read."""
        return self.num_pages

    @property
    def padding_slot(self) -> int:
        """The padding page's first slot, where padded rows and unread writes put their K/V."""
        return self.padding_page * self.layout.page_size

    @property
    def num_reserved_pages(self) -> int:
        """Pages the pool holds beyond num_pages (the padding page)."""
        return RESERVED_PAGES

    @property
    def quantized(self) -> bool:
        """Whether the pages hold fp8 values that read back through per-layer scales."""
        return is_fp8(self.layout.dtype)

    @property
    def scales_ready(self) -> bool:
        """Whether every layer has its scales (always, for pages that are not fp8)."""
        return all(self._has_scales) or not self.quantized

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V scale, float32 views `[]` on the device (for "mla" both the
        latent's), or (None, None) when pages are not fp8."""
        layer = self._layer(layer)
        if self.scales is None:
            return None, None
        return self.scales[layer, 0], self.scales[layer, -1]

    def set_scales(self, layer: int, *scales: float) -> None:
        """Give `layer` its scales, one positive float per plane (`k_scale, v_scale`, or
        `latent_scale`). ValueError if the pages are not fp8 or the layer has its scales
        already (its pages may hold values stored under them)."""
        check_int("layer", layer, 0, self.layout.num_layers - 1)
        names = SCALE_NAMES[self.layout.kind]
        if len(scales) != len(names):
            raise TypeError(f"an {self.layout.kind} pool takes {', '.join(names)} for each "
                            f"layer, got {len(scales)} scales: {scales!r}")
        checked = [check_scale(name, x) for name, x in zip(names, scales, strict=True)]
        if not self.quantized:
            raise ValueError(f"scales apply to fp8 pages; this pool holds {self.layout.dtype}")
        if self._has_scales[layer]:
            raise ValueError(f"layer {layer} has its scales already "
                             f"({self.scales[layer].tolist()}); they cannot change")
        self._set_scales(layer, torch.tensor(checked))

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Take the layer's scales from the K and V (for "mla" the latent `k`) about to be
        written, if it has none yet and calibration is not paused (fp8 pages only). K/V of
        no token set none: they hold no value to size a scale by."""
        layer = self._layer(layer)
        scales = self._new_scales(layer, k, v)
        if scales is not None:
            self._set_scales(layer, scales)

    def _new_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor | None
                    ) -> torch.Tensor | None:
        """The scales `calibrate` would give the layer (one per plane), or None: it keeps
        its own (or has none, and K/V of no token set none)."""
        if self.quantized and self._calibrating and not self._has_scales[layer]:
            planes = self._check_planes(k, v)
            if k.numel():
                return torch.stack([scale_of(x) for x in planes])
        return None

    def _set_scales(self, layer: int, scales: torch.Tensor) -> None:
        self.scales[layer] = scales
        self._has_scales[layer] = True

    @contextmanager
    def calibration_paused(self) -> Iterator[None]:
        """Within this block writes set no scales: for K/V of no real tokens (the padding of
        a CUDA graph capture)."""
        calibrating, self._calibrating = self._calibrating, False
        try:
            yield
        finally:
            self._calibrating = calibrating  # as it was: a block may sit in another

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool tensor, the reserved page's included."""
        return self.kv.numel() * self.kv.element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer's K pages, a view `[num_pages + 1, page_size, num_kv_heads, head_dim]`."""
        return self.kv[self._layer(layer), 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer's V pages, shaped as `k_cache`'s (for "mla" the same latent plane)."""
        return self.kv[self._layer(layer), self.layout.num_planes - 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        """Write one layer's K/V `[n, num_kv_heads, head_dim]` at `slots` [n]; for "mla" `k` is
        the latent `[n, 1, latent_dim]` and `v` None. fp8 pages are written quantized.
        ValueError, before anything changes, for K/V of another shape; TypeError for slots
        that are not an integer tensor."""
        if not isinstance(slots, torch.Tensor) or slots.dtype == torch.bool or (
                slots.dtype.is_floating_point or slots.dtype.is_complex):
            raise TypeError(f"slots must be an integer tensor, got "
                            f"{slots.dtype if isinstance(slots, torch.Tensor) else type(slots)}")
        if slots.dim() != 1:
            raise ValueError(f"slots must be one-dimensional [n], got shape {tuple(slots.shape)}")
        planes = self._check_planes(k, v, len(slots))
        layer = self._layer(layer)
        flat = self.kv[layer].view(self.layout.num_planes, -1, self.layout.num_kv_heads,
                                   self.layout.head_dim)
        slots = slots.to(device=self.device, dtype=torch.long)
        if slots.device.type == "cpu":  # before scales are set; on a GPU the check would sync
            _check_within(slots, flat.shape[1], "slots", IndexError)
        scales = None
        if self.quantized:  # new scales are the layer's once the write is in
            scales = self._new_scales(layer, k, v)
            # index_copy_ has no fp8 kernel: copy the bytes.
            flat = flat.view(torch.uint8)
            planes = [quantize(x, scale).view(torch.uint8) for x, scale in zip(
                planes, self.scales[layer] if scales is None else scales, strict=True)]
        for plane, x in zip(flat, planes, strict=True):
            plane.index_copy_(0, slots, x.to(flat.dtype))
        if scales is not None:
            self._set_scales(layer, scales)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy pages src[i] -> dst[i] in every layer (copy-on-write, tier loads)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages needs as many sources as destinations, "
                             f"got {len(src)} and {len(dst)}")
        if src:
            self.kv[:, :, self._index(dst)] = self.kv[:, :, self._index(src)]
            for listener in self.copy_listeners:
                listener(src, dst)

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of the pages' KV, all layers: `[num_layers, num_planes, n, page_size, kvh, d]`."""
        return self.kv[:, :, self._index(pages)]

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Store `data` (shaped as `read_pages` returns it) into `pages`. fp8 pages take
        fp8 data only: other values would be stored without their scales."""
        expected = (*self.kv.shape[:2], len(pages), *self.kv.shape[3:])
        if tuple(data.shape) != expected:
            raise ValueError(f"write_pages expected data of shape {expected}, "
                             f"got {tuple(data.shape)}")
        if self.quantized and data.dtype != self.kv.dtype:
            raise TypeError(f"write_pages on {self.kv.dtype} pages takes data of that dtype "
                            f"(as read_pages returns it), got {data.dtype}")
        self.kv[:, :, self._index(pages)] = data.to(self.kv.device, self.kv.dtype)

    def _check_planes(self, k: torch.Tensor, v: torch.Tensor | None,
                      n: int | None = None) -> list[torch.Tensor]:
        """The planes `(k, v)` a write takes, checked: both for "mha", the latent `k` alone
        for "mla", each `[n, num_kv_heads, head_dim]` (any `n` when None). ValueError if not."""
        if (v is None) != (self.layout.kind == "mla"):
            raise ValueError(f"a {self.layout.kind} pool writes "
                             f"{'the latent alone' if v is not None else 'both K and V'}")
        planes = [k] if v is None else [k, v]
        shape = (self.layout.num_kv_heads, self.layout.head_dim)
        for name, x in zip("kv", planes, strict=False):
            if x.dim() != 3 or tuple(x.shape[1:]) != shape or n not in (None, x.shape[0]):
                raise ValueError(f"{name} must be [{'n' if n is None else n}, {shape[0]}, "
                                 f"{shape[1]}], got {list(x.shape)}")
        return planes

    def scrub_pages(self, pages: Sequence[int]) -> None:
        """Zero the pages in every layer, so freed KV cannot be read by the next owner."""
        self.kv[:, :, self._index(pages)] = 0

    def check(self) -> None:
        """The tensor holds num_pages and the reserved page, and the layers' scales are
        positive and finite; AssertionError naming what is broken."""
        assert self.kv.shape[2] == self.num_pages + RESERVED_PAGES, (
            f"the pool tensor holds {self.kv.shape[2]} pages for {self.num_pages} and "
            f"{RESERVED_PAGES} reserved")
        if self.scales is None:
            return
        for layer, row in enumerate(self.scales.tolist()):  # one copy, no kernel a layer
            assert not self._has_scales[layer] or all(x > 0 and math.isfinite(x) for x in row), (
                f"layer {layer} has scales {row}, not positive finite numbers")

    def _layer(self, layer: int) -> int:
        """`layer` if it is an int in [0, num_layers); else TypeError or ValueError naming
        it (a tensor index would take None, a bool or a list, and -1 wraps)."""
        if type(layer) is int and 0 <= layer < self.layout.num_layers:
            return layer
        return check_int("layer", layer, 0, self.layout.num_layers - 1)

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(pages)
        if index.numel() and (index.dtype == torch.bool or index.dtype.is_floating_point
                              or index.dtype.is_complex):
            raise TypeError(f"page ids must be ints, got {index.dtype} ids: "
                            f"{index.flatten()[:8].tolist()}")
        index = index.long()
        if index.ndim != 1:
            raise ValueError(f"expected a flat list of page ids, got shape {tuple(index.shape)}")
        _check_within(index, self.num_pages, "page ids", InvalidPage)
        return index.to(self.device)


def _check_within(index: torch.Tensor, bound: int, what: str, error: type[Exception]) -> None:
    """Raise `error` naming the extremes unless every value of `index` lies in [0, bound)."""
    if index.numel():
        lo, hi = (int(x) for x in torch.aminmax(index))
        if lo < 0 or hi >= bound:
            raise error(f"{what} must lie in [0, {bound}), got min {lo}, max {hi}")


def layer_scales(layout: KVLayout, kv_scales) -> list[tuple[float, ...]] | None:
    """`kv_scales` (see KVPool) as one checked tuple of scales per layer; None stays None."""
    if kv_scales is None:
        return None
    if not is_fp8(layout.dtype):
        raise ValueError(f"kv_scales apply to fp8 pages; the layout holds {layout.dtype}")
    names = SCALE_NAMES[layout.kind]
    rows = [kv_scales] * layout.num_layers if _is_row(kv_scales, len(names)) else kv_scales
    if not (isinstance(rows, (tuple, list)) and len(rows) == layout.num_layers
            and all(_is_row(row, len(names)) for row in rows)):
        raise ValueError(f"{ROW_FORMS[layout.kind]}, or one per layer ({layout.num_layers}); "
                         f"got {kv_scales!r}")
    if len(names) == 1:
        rows = [(row,) for row in rows]
    return [tuple(check_scale(f"{name} of layer {i}", x)
                  for name, x in zip(names, row, strict=True)) for i, row in enumerate(rows)]


def _is_row(x, num_planes: int) -> bool:
    """Whether `x` is one layer's scales: a number for one plane, else a tuple or list."""
    if num_planes == 1:
        return not isinstance(x, (tuple, list))
    return (isinstance(x, (tuple, list)) and len(x) == num_planes
            and not isinstance(x[0], (tuple, list)))
