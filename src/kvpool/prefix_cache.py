"""PrefixCache: a radix tree over committed full pages, keyed by the pages' token ids.

Each node below the root is one page: its key is the `page_size` token ids the page holds,
and the path from the root spells the whole prefix. The tree holds one reference on every
page it caches; a page whose only reference is the tree's is evictable. Eviction takes
least recently used leaves first (children before parents) from a heap with lazy deletion,
so evicting k pages costs O(k log n), never a scan of the tree. Each node also carries the
chain key of its whole prefix (see tiers.py), under which a tier stores it once evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.allocator import PageAllocator
from kvpool.tiers import ROOT_KEY, PageKey, chain_key


@dataclass(slots=True, eq=False)
class PrefixNode:
    """One cached page: `key` is its token ids, `page` its page id."""

    key: tuple[int, ...]
    page: int
    parent: PrefixNode | None
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)
    last_access: int = 0  # logical clock of the last match, insert or release
    heap_access: int = -1  # last_access of this node's live heap entry, -1 if none
    chain_key: int = ROOT_KEY  # names the whole prefix through this page

    def page_key(self) -> PageKey:
        """The key a tier stores this page under."""
        return PageKey(self.chain_key, self.parent.chain_key, self.key)


class PrefixCache:
    """Radix tree of committed full pages with LRU eviction of unreferenced leaves.

    The tree only moves its own references through `allocator`; `KVCache` tells it when a
    sequence takes (`lock`) or gives back (`release`) the pages of a path. `on_evict`, if
    given, receives each batch of evicted nodes before their pages go back to the free list
    (to copy them to a tier).
    """

    def __init__(self, allocator: PageAllocator, page_size: int, *,
                 on_evict: Callable[[list[PrefixNode]], None] | None = None):
        self.allocator = allocator
        self.on_evict = on_evict
        self._refcounts = allocator.refcounts  # read-only view, read on every hot path
        self.page_size = page_size
        self.root = PrefixNode(key=(), page=-1, parent=None)
        self._node_of_page: dict[int, PrefixNode] = {}
        self._heap: list[tuple[int, int, PrefixNode]] = []  # (last_access, page, node)
        self._clock = 0
        self.num_evictable = 0  # cached pages whose only reference is the tree's
        self.num_evicted = 0

    @property
    def num_pages(self) -> int:
        """Pages the tree holds a reference on (evictable or also used by sequences)."""
        return len(self._node_of_page)

    def cached_pages(self) -> list[int]:
        """Ids of every page the tree caches."""
        return list(self._node_of_page)

    def node_of(self, page: int) -> PrefixNode | None:
        """The node caching `page`, or None."""
        return self._node_of_page.get(page)

    def match(self, token_ids: Sequence[int], max_pages: int) -> list[PrefixNode]:
        """The cached path spelling the longest prefix of `token_ids`, at most `max_pages`
        pages. Changes nothing."""
        nodes = []
        node = self.root
        ps = self.page_size
        for start in range(0, max_pages * ps, ps):
            node = node.children.get(tuple(token_ids[start:start + ps]))
            if node is None:
                break
            nodes.append(node)
        return nodes

    def num_pinned_by(self, nodes: Sequence[PrefixNode]) -> int:
        """How many of `nodes` are evictable now, i.e. would stop being so if locked."""
        refcounts = self._refcounts
        return [refcounts[n.page] for n in nodes].count(1)

    def lock(self, nodes: Sequence[PrefixNode]) -> None:
        """A sequence takes a reference on each node's page (a prefix hit)."""
        if not nodes:
            return
        self.num_evictable -= self.num_pinned_by(nodes)
        self.allocator.share([n.page for n in nodes])
        self._clock += 1
        for n in nodes:
            n.last_access = self._clock

    def insert(self, node: PrefixNode, token_ids: Sequence[int], pages: list[int],
               first: int, last: int) -> tuple[PrefixNode, list[int]]:
        """Cache logical pages [first, last) of a live sequence whose page table is `pages`
        (`node` is the cached page before `first`); the tree takes a reference on each.

        Where the tree already caches the same tokens in another page, the sequence switches
        to the cached page (updating `pages` in place) and drops its own copy. Returns the
        deepest node reached and the ids of dropped copies that went back to the free list."""
        ps = self.page_size
        refcounts = self._refcounts
        added: list[int] = []
        switched: list[PrefixNode] = []
        dropped: list[int] = []
        self._clock += 1
        for i in range(first, last):
            key = tuple(token_ids[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = PrefixNode(key, pages[i], node, {}, self._clock,
                                   chain_key=chain_key(node.chain_key, key))
                node.children[key] = child
                self._node_of_page[pages[i]] = child
                added.append(pages[i])
            elif child.page != pages[i]:
                switched.append(child)
                dropped.append(pages[i])
                pages[i] = child.page
            node = child
        self.num_evictable -= [refcounts[n.page] for n in switched].count(1)
        self.allocator.share(added + [n.page for n in switched])
        for n in switched:
            n.last_access = self._clock
        return node, self.allocator.free(dropped)

    def release(self, pages: Sequence[int]) -> None:
        """A sequence has given back its references on `pages`: count the cached ones that
        only the tree holds now, and offer those that are leaves for eviction."""
        refcounts = self._refcounts
        node_of_page = self._node_of_page
        self._clock += 1
        for page in pages:
            if refcounts[page] == 1:
                node = node_of_page.get(page)
                if node is not None:
                    self.num_evictable += 1
                    node.last_access = self._clock
                    if not node.children:
                        self._offer(node)

    def evict(self, num_pages: int) -> list[int]:
        """Evict up to `num_pages` evictable pages, least recently used leaves first; returns
        the page ids, which went back to the allocator's free list."""
        refcounts = self._refcounts
        victims: list[PrefixNode] = []
        while len(victims) < num_pages and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if node.heap_access != access:
                continue  # stale: superseded by a newer entry, or the node is gone
            node.heap_access = -1
            if node.children or refcounts[node.page] != 1:
                continue  # in use again, or has grown children: offered again later
            self._remove(node)
            victims.append(node)
        self.num_evicted += len(victims)
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        return self.allocator.free([n.page for n in victims])

    def clear(self) -> list[int]:
        """Evict every evictable page; returns the freed page ids."""
        return self.evict(self.num_evictable)

    def _remove(self, node: PrefixNode) -> None:
        parent = node.parent
        del parent.children[node.key]
        del self._node_of_page[node.page]
        self.num_evictable -= 1
        if parent is not self.root and not parent.children:
            self._offer(parent)

    def _offer(self, node: PrefixNode) -> None:
        """Push `node` on the eviction heap if it is an evictable leaf without a live entry."""
        if node.children or node.heap_access == node.last_access:
            return
        if self._refcounts[node.page] != 1:
            return
        node.heap_access = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.page, node))
        if len(self._heap) > 2 * len(self._node_of_page) + 64:
            self._compact()

    def _compact(self) -> None:
        # Stale entries pile up as nodes are re-used; rebuild from the live ones.
        self._heap = [e for e in self._heap if e[2].heap_access == e[0]]
        heapq.heapify(self._heap)

    def check(self) -> None:
        """Tree invariants: node index consistent, evictable count exact, and every
        evictable leaf reachable from the eviction heap."""
        seen = 0
        evictable = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, f"page {child.page} misplaced"
                assert len(key) == self.page_size, f"page {child.page} key has {len(key)} tokens"
                assert self._node_of_page.get(child.page) is child, (
                    f"page {child.page} missing from the page index")
                assert child.chain_key == chain_key(node.chain_key, key), (
                    f"page {child.page} has a stale chain key")
                rc = self.allocator.refcount(child.page)
                assert rc >= 1, f"cached page {child.page} has refcount {rc}"
                if rc == 1:
                    evictable += 1
                    if not child.children:
                        assert child.heap_access == child.last_access, (
                            f"evictable leaf page {child.page} is not on the eviction heap")
                seen += 1
                stack.append(child)
        assert seen == len(self._node_of_page), (
            f"page index holds {len(self._node_of_page)} pages, tree {seen}")
        assert evictable == self.num_evictable, (
            f"num_evictable={self.num_evictable}, counted {evictable}")
