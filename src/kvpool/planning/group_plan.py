"""How a KV budget is split between the pools of a layout's layer groups: a full-attention pool
and sliding-window pools, as a KVCache of several page groups keeps them. Each window pool
gets `max_num_seqs` windows plus one prompt of `prefill_tokens` (docs/design-notes.md says
why), never more tokens than the full pool; the full pool gets the rest."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.memory.layout import KVLayout, LayerGroup
from kvpool.memory.pool import MOST_PAGES, RESERVED_PAGES
from kvpool.numeric import check_int64


def pages_held(context_len: int, window: int | None, page_size: int) -> int:
    """Pages a decoding sequence of `context_len` tokens holds in a pool of `window` (None:
    full attention, every page), which gives back the pages that leave it: the window's
    pages and one more."""
    pages = -(-context_len // page_size)
    return pages if window is None else min(pages, -(-window // page_size) + 1)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The pool of one layer group: `num_pages` pages of `page_size` tokens, and the pool's
    reserved page beside them."""

    group: LayerGroup
    num_pages: int
    page_size: int

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of this group's layers."""
        return self.group.bytes_per_token * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the pool, its reserved page included."""
        return (self.num_pages + RESERVED_PAGES) * self.bytes_per_page

    @property
    def max_tokens(self) -> int:
        """Token slots in the pool."""
        return self.num_pages * self.page_size

    def pages_per_sequence(self, context_len: int) -> int:
        """Pages a decoding sequence of `context_len` tokens holds in this pool."""
        return pages_held(context_len, self.group.window, self.page_size)


def split_budget(layout: KVLayout, budget_bytes: int, *, max_num_seqs: int,
                 prefill_tokens: int) -> tuple[GroupPlan, ...]:
    """The pools of `layout.groups` in `budget_bytes`, in group order; the full group (or,
    without one, the widest window) gets what the others leave. The pools' reserved pages
    take one page of every layer, as one pool's would: a budget of `num_pages` pages and a
    reserved one holds these."""
    check_int64("max_num_seqs", max_num_seqs, 1)
    check_int64("prefill_tokens", prefill_tokens, 0)
    ps, groups = layout.page_size, layout.groups
    budget = max(budget_bytes, 0)
    one_pool = min(budget // layout.bytes_per_page, MOST_PAGES)  # if every layer shared one
    rest = 0 if groups[0].window is None else len(groups) - 1
    pages = {}
    for g, group in enumerate(groups):
        if g != rest:
            window_pages = -(-group.window // ps) + 1
            pages[g] = min(max_num_seqs * window_pages + -(-prefill_tokens // ps), one_pool)
    spent = sum(pages[g] * groups[g].bytes_per_token * ps for g in pages)
    pages[rest] = min((budget - spent) // (groups[rest].bytes_per_token * ps), MOST_PAGES)
    return tuple(GroupPlan(group, pages[g], ps) for g, group in enumerate(groups))
