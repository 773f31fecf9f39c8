"""PrefixCache: a radix tree over committed full pages, keyed by the pages' token ids.

Each node below the root holds a run of one or more pages (`pages`) and their token ids
(`tokens`, packed as in tokens.py, `page_size` ids per page); the path from the root spells
the whole prefix. A node is entered by its first page's packed ids, so a lookup hashes one
page per node and compares the rest of the node's ids in one memcmp: matching a long cached
prefix costs a few Python operations per node, not per page or per token. A node splits where two
prefixes part, and where a match ends inside it, so that every page of a node was last
used at the same time.

The tree holds one allocator reference on every page it caches. A sequence holds the pages of
its cached path (the committed prefix it matched or inserted) through the nodes instead: each
node counts the sequences whose path runs through it (`lock_ref`), so taking or giving back a
path costs one step per node, not per page. Pages a sequence holds past its path keep their
own allocator references. A cached page is evictable when no path runs through its node and
no sequence holds it past its path (its reference count is 1, the tree's).

Eviction takes pages from the tail of the least recently used leaf first (children before
parents, so a node empties from its end), from a heap on which every evictable leaf is queued
(no node twice). A hit refreshes a node by stamping its `last_access` only; the heap catches
up lazily, when a refreshed node reaches the top and goes back in under its new time. So a
hit never touches the heap, and evicting k pages costs O(k + log n) per leaf touched, never
a scan of the tree.

A tier names a page by the chain key of its whole prefix (see tiers.py); chain keys are
computed only when a tier asks.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool.allocator import PageAllocator
from kvpool.tiers import ROOT_KEY, PageKey, chain_key
from kvpool.tokens import TOKEN_BYTES, pack_tokens, unpack_tokens


@dataclass(slots=True, eq=False)
class PrefixNode:
    """A run of cached pages: `pages[i]` holds the ids packed in page i of `tokens` (each
    page `page_size * TOKEN_BYTES` bytes)."""

    key: bytes  # the first page's packed ids: this node's entry in parent.children
    tokens: bytearray
    pages: list[int]
    parent: PrefixNode | None
    children: dict[bytes, PrefixNode] = field(default_factory=dict)
    last_access: int = 0  # logical clock of the last match, insert or release
    queued: bool = False  # on the eviction heap (under a time <= last_access)
    lock_ref: int = 0  # live sequences whose cached path runs through this node
    num_shared: int = 0  # pages also held by some sequence past its path (refcount > 1)
    base_key: int | None = ROOT_KEY  # chain key of the prefix before pages[0]; None: unknown


class PrefixMatch(NamedTuple):
    """The cached pages spelling a prefix: `pages`, the last `depth` of which are the first
    pages of `node` (the root and 0 when nothing matched)."""

    pages: list[int]
    node: PrefixNode
    depth: int



class PrefixCache:
    """Radix tree of committed full pages with LRU eviction of unreferenced leaves.

    `KVCache` tells the tree when a sequence takes a path (`lock` on a hit, `insert` on a
    commit, `share` on a fork) or gives it back (`release`). `on_evict`, if
    given, receives the evicted page ids and their tier keys before the pages go back to the
    free list (to copy them to a tier).
    """

    def __init__(self, allocator: PageAllocator, page_size: int, *,
                 on_evict: Callable[[list[int], list[PageKey]], None] | None = None):
        self.allocator = allocator
        self.on_evict = on_evict
        self._refcounts = allocator.refcounts  # read-only view, read on every hot path
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self.root = PrefixNode(key=b"", tokens=bytearray(), pages=[], parent=None)
        self._node_of_page: list[PrefixNode | None] = [None] * allocator.num_pages
        self.num_pages = 0  # pages the tree holds a reference on (evictable or also used)
        self._heap: list[tuple[int, int, PrefixNode]] = []  # (access time, push no., node)
        self._pushes = 0
        self._clock = 0
        self.num_evictable = 0  # cached pages whose only reference is the tree's
        self.num_evicted = 0

    @property
    def num_nodes(self) -> int:
        """Nodes below the root (each a run of pages)."""
        return sum(1 for _ in self._nodes())

    def cached_pages(self) -> list[int]:
        """Ids of every page the tree caches."""
        return [page for page, node in enumerate(self._node_of_page) if node is not None]

    def match(self, token_ids: bytes | Sequence[int], max_pages: int) -> PrefixMatch:
        """The cached pages spelling the longest prefix of `token_ids` (ids, or ids packed
        by `pack_tokens`), at most `max_pages` pages. Changes nothing."""
        if type(token_ids) is not bytes:
            token_ids = pack_tokens(token_ids)
        pb = self._page_bytes
        node, depth = self.root, 0
        pages: list[int] = []
        start, limit = 0, max_pages * pb
        while start < limit:
            child = node.children.get(token_ids[start:start + pb])
            if child is None:
                break
            tokens = child.tokens
            end = start + len(tokens)
            if end <= limit and token_ids[start:end] == tokens:
                depth = len(child.pages)
                pages += child.pages
            else:  # the match ends inside this node: count its matching pages
                depth = _common_pages(token_ids, start, tokens, min(end, limit), pb)
                pages += child.pages[:depth]
                end = limit  # stop
            node, start = child, end
        return PrefixMatch(pages, node, depth)

    def num_pinned_by(self, match: PrefixMatch) -> int:
        """How many of the matched pages are evictable now, i.e. would stop being so if
        locked."""
        refcounts = self._refcounts
        node, depth = match.node, match.depth
        pinned = 0
        while node is not self.root:
            if not node.lock_ref:  # a node on a live path has no evictable page
                if depth == len(node.pages):
                    pinned += depth - node.num_shared
                else:
                    pinned += [refcounts[p] for p in node.pages[:depth]].count(1)
            node = node.parent
            depth = len(node.pages)
        return pinned

    def lock(self, match: PrefixMatch) -> PrefixNode:
        """A sequence takes the matched pages as its cached path (a prefix hit), which
        refreshes them. Returns the node whose last page is the last matched page."""
        node = match.node
        if not match.pages:
            return node
        if match.depth < len(node.pages):
            node = self._split(node, match.depth)
        self._lock_path(node)
        return node

    def share(self, pages: list[int], node: PrefixNode, num_path_pages: int) -> None:
        """A fork: another sequence takes the same page table `pages`, whose first
        `num_path_pages` are a cached path ending with `node`'s last page."""
        if num_path_pages:
            self._lock_path(node)
        # Past the path the parent holds its pages itself: any cached one among them has a
        # reference count above 1 already, so no node's evictable pages change.
        self.allocator.retain(pages[num_path_pages:])

    def insert(self, node: PrefixNode, token_ids: bytes | bytearray, pages: list[int],
               first: int, last: int) -> tuple[PrefixNode, int, list[int]]:
        """Cache logical pages [first, last) of a live sequence whose page table is `pages`
        and whose cached path ends with `node`'s last page; `token_ids` are its ids from
        page `first` on, packed. The tree takes over the sequence's reference on each new page.

        Where the tree already caches the same tokens in another page, the sequence switches
        to the cached page (updating `pages` in place) and drops its own copy. A copy that
        another sequence shares too (a fork) is not switched: caching stops before it, since
        the tree would otherwise hang that sequence's later pages below a page it does not
        hold, out of eviction's reach. Returns the node holding the last cached page, the
        index of the first page left uncached (`last` unless caching stopped), and the ids of
        dropped copies that went back to the free list."""
        pb = self._page_bytes
        refcounts = self._refcounts
        clock = self._clock = self._clock + 1
        dropped: list[int] = []
        i, t = first, 0  # the page, and its first token's offset in token_ids (bytes)
        while i < last:
            child = node.children.get(bytes(token_ids[t:t + pb]))
            if child is None:
                node = self._add(node, token_ids[t:(last - first) * pb], pages, i, last)
                i = last
                break
            span = min(len(child.pages), last - i)  # pages that may match; the first does
            depth = span if span == 1 else _common_pages(token_ids, t, child.tokens,
                                                         t + span * pb, pb)
            mine = pages[i:i + depth]
            stop = False
            theirs = child.pages[:depth]
            if mine != theirs and max(map(refcounts.__getitem__, mine)) > 1:
                keep = next((j for j, (own, cached) in enumerate(zip(mine, theirs, strict=True))
                             if own != cached and refcounts[own] > 1), depth)
                if keep == 0:
                    break
                stop = keep < depth
                depth, mine = keep, mine[:keep]
            if depth < len(child.pages):
                child = self._split(child, depth)
            # The path now runs through child: the sequence holds its pages through the node,
            # and gives back its own references on those positions (its copies, or the same
            # pages if a fork sibling cached them).
            child.lock_ref += 1
            if child.lock_ref == 1:
                self.num_evictable -= len(child.pages) - child.num_shared
            child.last_access = clock
            dropped += mine
            pages[i:i + depth] = child.pages
            node, i, t = child, i + depth, t + depth * pb
            if stop:
                break
        return node, i, self._release_unlocked(dropped) if dropped else []

    def release(self, pages: list[int], node: PrefixNode, num_path_pages: int) -> list[int]:
        """A sequence whose page table is `pages` ends: it gives back its cached path (the
        first `num_path_pages`, ending with `node`'s last page), which is refreshed, and its
        references on the rest. Returns the ids that went back to the free list."""
        freed = self._release_unlocked(pages[num_path_pages:]) \
            if len(pages) > num_path_pages else []
        if num_path_pages:
            clock = self._clock = self._clock + 1
            root, up = self.root, node
            while up is not root:
                up.lock_ref -= 1
                if not up.lock_ref:
                    self.num_evictable += len(up.pages) - up.num_shared
                up.last_access = clock
                up = up.parent
            if not node.queued:
                self._offer(node)
        return freed

    def evict(self, num_pages: int) -> list[int]:
        """Evict up to `num_pages` evictable pages, least recently used leaves first and each
        leaf from its end; returns the page ids, which went back to the allocator's free
        list."""
        refcounts = self._refcounts
        node_of_page = self._node_of_page
        heap = self._heap
        victims: list[int] = []
        keys: list[PageKey] = []
        want = num_pages
        while want > 0 and heap:
            access, _, node = heap[0]
            if access != node.last_access:  # used since it was queued: requeue, and look again
                self._pushes += 1
                heapq.heapreplace(heap, (node.last_access, self._pushes, node))
                continue
            pages = node.pages
            keep = len(pages)
            if not (node.children or node.lock_ref):  # else: offered again when that ends
                stop = max(keep - want, 0)
                if not node.num_shared:
                    keep = stop  # every page is the tree's alone
                while keep > stop and refcounts[pages[keep - 1]] == 1:
                    keep -= 1
            if keep < len(pages):
                taken = pages[keep:]
                taken.reverse()  # from the end: eviction order
                if self.on_evict is not None:
                    keys += reversed(self._page_keys(node)[keep:])
                del pages[keep:], node.tokens[keep * self._page_bytes:]
                for page in taken:
                    node_of_page[page] = None
                victims += taken
                want -= len(taken)
                if keep and refcounts[pages[-1]] == 1:
                    break  # trimmed to what was asked; the rest keeps its place on the heap
            heapq.heappop(heap)
            node.queued = False
            if not pages:
                self._remove(node)
        self.num_pages -= len(victims)
        self.num_evictable -= len(victims)
        self.num_evicted += len(victims)
        if victims and self.on_evict is not None:
            self.on_evict(victims, keys)
        return self.allocator.release(victims)

    def clear(self) -> list[int]:
        """Evict every evictable page; returns the freed page ids."""
        return self.evict(self.num_evictable)

    def chain_key(self, node: PrefixNode, depth: int) -> int:
        """The chain key naming the prefix through the first `depth` pages of `node`."""
        if depth == 0:
            return self._base_key(node)
        return self._chain_keys(node)[depth - 1]

    # ---- internals ---------------------------------------------------------------------

    def _lock_path(self, node: PrefixNode) -> None:
        """One more sequence's path runs through `node` and its ancestors, refreshed."""
        clock = self._clock = self._clock + 1
        root = self.root
        while node is not root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self.num_evictable -= len(node.pages) - node.num_shared
            node.last_access = clock
            node = node.parent

    def _release_unlocked(self, pages: list[int]) -> list[int]:
        """Drop a sequence's own references on `pages` (not through a path); a cached page
        left with only the tree's reference is no longer shared, and evictable if no path
        runs through its node. Returns the ids that went back to the free list."""
        freed = self.allocator.release(pages)
        refcounts = self._refcounts
        node_of_page = self._node_of_page
        for page in pages:
            if refcounts[page] == 1:
                owner = node_of_page[page]
                if owner is not None:
                    owner.num_shared -= 1
                    if not owner.lock_ref:
                        self.num_evictable += 1
                        if not owner.children:
                            self._offer(owner)
        return freed

    def _add(self, parent: PrefixNode, new_tokens: bytes | bytearray, pages: list[int],
             first: int, last: int) -> PrefixNode:
        """Cache the sequence's pages [first, last), holding `new_tokens` (packed ids), below
        `parent`, the end of its path: in `parent` itself when that is a leaf on no other path
        (the run grows), else in a new child. Returns the node holding the last page."""
        new_pages = pages[first:last]
        # The sequence's references become the tree's, and it holds the pages through the
        # node; pages a fork sibling holds too stay shared.
        refcounts = self._refcounts
        shared = len(new_pages) - [refcounts[p] for p in new_pages].count(1)
        if parent is not self.root and not parent.children and parent.lock_ref == 1:
            parent.pages += new_pages  # a leaf on this sequence's path only: the run grows
            parent.tokens += new_tokens
            node = parent
        else:
            node = PrefixNode(bytes(new_tokens[:self._page_bytes]), bytearray(new_tokens),
                              new_pages, parent, lock_ref=1,
                              base_key=ROOT_KEY if parent is self.root else None)
            parent.children[node.key] = node
        node.num_shared += shared
        node.last_access = self._clock
        node_of_page = self._node_of_page
        for page in new_pages:
            node_of_page[page] = node
        self.num_pages += len(new_pages)
        return node

    def _split(self, node: PrefixNode, depth: int) -> PrefixNode:
        """Split `node` after its first `depth` pages into a new parent holding those and
        `node` holding the rest (so references to `node` keep pointing at its last page, and
        its heap entry stays valid). Returns the new parent."""
        cut = depth * self._page_bytes
        head = PrefixNode(node.key, node.tokens[:cut], node.pages[:depth], node.parent,
                          last_access=node.last_access, lock_ref=node.lock_ref,
                          base_key=node.base_key)
        refcounts = self._refcounts
        head.num_shared = len(head.pages) - [refcounts[p] for p in head.pages].count(1)
        node.num_shared -= head.num_shared
        node.parent.children[head.key] = head
        del node.tokens[:cut]
        del node.pages[:depth]
        node.key = bytes(node.tokens[:self._page_bytes])
        node.parent = head
        node.base_key = None
        head.children[node.key] = node
        node_of_page = self._node_of_page
        for page in head.pages:
            node_of_page[page] = head
        return head

    def _remove(self, node: PrefixNode) -> None:
        """Unlink an emptied leaf; its parent may become an evictable leaf."""
        parent = node.parent
        del parent.children[node.key]
        if parent is not self.root and not parent.children:
            self._offer(parent)

    def _offer(self, node: PrefixNode) -> None:
        """Queue `node` for eviction if it is a leaf whose last page is evictable and it is
        not queued yet."""
        if node.queued or node.children or node.lock_ref or self._refcounts[node.pages[-1]] != 1:
            return
        node.queued = True
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_access, self._pushes, node))

    def _base_key(self, node: PrefixNode) -> int:
        """The chain key of the prefix before `node`'s first page, computed once."""
        if node.base_key is None:
            node.base_key = self._chain_keys(node.parent)[-1]
        return node.base_key

    def _chain_keys(self, node: PrefixNode) -> list[int]:
        """The chain key through each of `node`'s pages ([ROOT_KEY] for the root)."""
        if node is self.root:
            return [ROOT_KEY]
        missing = []  # ancestors whose base key is unknown, nearest first
        up = node
        while up.base_key is None:
            missing.append(up)
            up = up.parent
        for n in reversed(missing):  # from the top down, each parent's keys once
            n.base_key = self._fold(n.parent)[-1] if n.parent is not self.root else ROOT_KEY
        return self._fold(node)

    def _fold(self, node: PrefixNode) -> list[int]:
        if node is self.root:
            return [ROOT_KEY]
        pb = self._page_bytes
        key, keys = node.base_key, []
        for i in range(len(node.pages)):
            key = chain_key(key, unpack_tokens(node.tokens[i * pb:(i + 1) * pb]))
            keys.append(key)
        return keys

    def _page_keys(self, node: PrefixNode) -> list[PageKey]:
        """The tier key of each of `node`'s pages."""
        pb = self._page_bytes
        parents = [self._base_key(node), *self._chain_keys(node)]
        return [PageKey(parents[i + 1], parents[i], unpack_tokens(node.tokens[i * pb:(i + 1) * pb]))
                for i in range(len(node.pages))]

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def check(self, path_ends: Sequence[PrefixNode] = ()) -> None:
        """Tree invariants: links, keys and the page index consistent, no empty node; each
        node's `lock_ref` equal to the paths through it (`path_ends`: the last node of each
        live sequence's path) and `num_shared` to its pages with other holders; the evictable
        count exact; the eviction heap holding each queued node of the tree once, under a time
        no later than its last access, and every evictable leaf queued."""
        pb = self._page_bytes
        refcounts = self._refcounts
        paths: Counter[int] = Counter()
        for end in path_ends:
            while end is not self.root:
                paths[id(end)] += 1
                end = end.parent
        seen = 0
        evictable = 0
        queued = {id(node): access for access, _, node in self._heap}
        assert len(queued) == len(self._heap), "a node is on the eviction heap twice"
        for node in self._nodes():
            where = f"node at page {node.pages[0] if node.pages else '?'}"
            assert node.pages, "an empty node is left in the tree"
            assert node.parent.children.get(node.key) is node, f"{where} is misplaced"
            assert type(node.key) is bytes and node.key == node.tokens[:pb], (
                f"{where} has a stale key")
            assert len(node.tokens) == pb * len(node.pages), (
                f"{where} has {len(node.tokens)} token bytes for {len(node.pages)} pages")
            assert node.lock_ref == paths[id(node)], (
                f"{where} has lock_ref {node.lock_ref}, {paths[id(node)]} paths run through it")
            counts = [refcounts[page] for page in node.pages]
            assert min(counts) >= 1, f"{where} caches a page with refcount {min(counts)}"
            assert node.num_shared == len(counts) - counts.count(1), (
                f"{where} has num_shared {node.num_shared}, "
                f"{len(counts) - counts.count(1)} pages with other holders")
            for page in node.pages:
                assert self._node_of_page[page] is node, (
                    f"page {page} missing from the page index")
            assert node.queued == (id(node) in queued), f"{where}: wrong queued flag"
            assert queued.pop(id(node), 0) <= node.last_access, (
                f"{where} is queued under a time after its last access")
            if not node.lock_ref:
                evictable += counts.count(1)
                if not node.children and counts[-1] == 1:
                    assert node.queued, f"evictable leaf {where} is not on the eviction heap"
            if node.base_key is not None and node.parent.base_key is not None:
                assert node.base_key == self._fold(node.parent)[-1], f"{where}: stale base key"
            seen += len(node.pages)
        assert not queued, f"{len(queued)} nodes on the eviction heap are not in the tree"
        indexed = len(self._node_of_page) - self._node_of_page.count(None)
        assert seen == indexed == self.num_pages, (
            f"page index holds {indexed} pages, num_pages={self.num_pages}, tree {seen}")
        assert evictable == self.num_evictable, (
            f"num_evictable={self.num_evictable}, counted {evictable}")


def _common_pages(token_ids: bytes | bytearray, start: int, tokens: bytearray, end: int,
                  pb: int) -> int:
    """How many whole pages (`pb` bytes each) of packed `tokens` equal
    `token_ids[start:end]` from the front (the first page is known to match)."""
    depth = 1
    for offset in range(pb, end - start, pb):
        if token_ids[start + offset:start + offset + pb] != tokens[offset:offset + pb]:
            break
        depth += 1
    return depth
