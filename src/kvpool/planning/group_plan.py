"""How a KV budget is split between the pools of a layout's layer groups (a full-attention pool
and sliding-window pools, as a KVCache of several page groups keeps them).

The rule: each window group's pool gets the pages of `max_num_seqs` sequences' windows (a
decoding sequence holds ceil(window / page_size) + 1 pages there) plus `prefill_tokens` of
prompt pages (the scheduler takes a windowed prompt's pages chunk by chunk, but a prompt
admitted with a prefix hit holds the hit's whole path until its next chunk gives the pages
before its window back, so one longest prompt must fit beside the windows), but never more
tokens than the full pool gets; the full pool gets the rest. A window pool so capped holds as
many tokens as the full pool: the pair then holds what one pool of every layer would."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import check_int
from kvpool.memory.layout import KVLayout, LayerGroup
from kvpool.memory.pool import RESERVED_PAGES


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
        """Pages a sequence of `context_len` tokens holds here while it decodes: all of them
        for full attention, its window and one more page for a window group."""
        pages = -(-context_len // self.page_size)
        if self.group.window is None:
            return pages
        return min(pages, -(-self.group.window // self.page_size) + 1)


def split_budget(layout: KVLayout, budget_bytes: int, *, max_num_seqs: int,
                 prefill_tokens: int) -> tuple[GroupPlan, ...]:
    """The pools of `layout.groups` in `budget_bytes` (see the module's rule), in group order.
    The full group (or, without one, the widest window) gets what the others leave. Each
    pool's reserved page comes on top: together they take one page of every layer, as one
    pool's would, so a budget that holds `num_pages` pages and a reserved one holds these."""
    check_int("max_num_seqs", max_num_seqs, 1)
    check_int("prefill_tokens", prefill_tokens, 0)
    ps, groups = layout.page_size, layout.groups
    budget = max(budget_bytes, 0)
    one_pool = budget // layout.bytes_per_page  # pages if every layer shared one pool
    rest = 0 if groups[0].window is None else len(groups) - 1
    pages = {}
    for g, group in enumerate(groups):
        if g != rest:
            window_pages = -(-group.window // ps) + 1
            want = max_num_seqs * window_pages + -(-prefill_tokens // ps)
            pages[g] = min(want, one_pool)
    spent = sum(pages[g] * groups[g].bytes_per_token * ps for g in pages)
    pages[rest] = (budget - spent) // (groups[rest].bytes_per_token * ps)
    return tuple(GroupPlan(group, pages[g], ps) for g, group in enumerate(groups))
