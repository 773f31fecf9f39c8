"""PrefixCache: a radix tree over committed full pages, keyed by the pages' token ids.

Each node below the root holds a run of pages (`pages`) and their token ids (`tokens`,
packed as in tokens.py, `page_size` ids per page); the path from the root spells the whole
prefix. A node is entered by its first page's packed ids and the rest of its ids compare in
one memcmp, so matching a long cached prefix costs a few Python operations per node, not per
page or token, and a 16-page prompt is one node and one bytes buffer.

The tree holds no reference on its pages: the allocator counts the sequences holding each
page and keeps a page whose count reaches 0 on its cached queue in least-recently-used order,
taking pages from its cold end when it runs out of free ones. A sequence holds every page of
its path from the root and gives its pages back tail first, so a page is always colder than
its parent: the coldest cached page is the last page of a leaf.

An evicted page leaves the tree at once: the allocator calls `_evicted` with the pages it
takes, coldest first, before it hands them out. First the `evict_hooks` run with the pages
and a function returning their tier keys, computed on the first call only (a tier stores the
pages by them; a state cache drops what depended on the pages and never asks). Then, even
if a hook raised, each page is cut from the end of its leaf (a leaf left empty goes, and a
salted root left with no child). No page is ever listed that the allocator has not marked as
the tree's.

A tier names a page by the chain key of its whole prefix (see tiers.py), computed only when
a tier asks, and then kept with the node: naming the pages of a long run one after another
costs a step each, not a walk from the run's first page.

A cache salt isolates the prefixes of whoever holds it: each salt has its own root (its key
the salt, its chain key derived from it), so a prompt matches only pages that prompts of the
same salt committed, and tier keys below it differ from every unsalted key. An unsalted
prompt uses `root`."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from types import MappingProxyType
from typing import NamedTuple

from kvpool.cache.tiers import KEY_BYTES, ROOT_KEY, PageKey, chain_key
from kvpool.cache.tokens import TOKEN_BYTES
from kvpool.errors import InvalidPage, check_int
from kvpool.memory.allocator import PageAllocator
from kvpool.numeric import check_int64


@dataclass(slots=True, eq=False)
class PrefixNode:
    """A run of cached pages: `pages[i]` holds the ids packed in page i of `tokens` (each
    page `page_size * TOKEN_BYTES` bytes)."""

    key: bytes  # its first page's packed ids: its entry in parent.children (a root: its salt)
    tokens: bytes  # immutable: the ids live in the object itself (one allocation, not two)
    pages: list[int]
    parent: PrefixNode | None
    start: int = 0  # pages on the path above it: the index of pages[0] in its prefix
    # A leaf's children: the shared empty LEAF (most nodes are leaves; a dict each would
    # cost 64 bytes), replaced by a dict of its own when it gains a child (`adopt`).
    children: Mapping[bytes, PrefixNode] = field(default_factory=lambda: LEAF)
    base_key: bytes | None = None  # chain key of the prefix before pages[0]; None: not known yet
    # keys[i]: the chain key of the prefix through pages[i], for the first len(keys) pages;
    # computed when a tier asks (an empty tuple, shared, until then).
    keys: list[bytes] | tuple[()] = ()

    def adopt(self, child: PrefixNode) -> None:
        """Make `child` a child of this node, under its key."""
        if self.children is LEAF:
            self.children = {}
        self.children[child.key] = child


LEAF: Mapping[bytes, PrefixNode] = MappingProxyType({})


class PrefixMatch(NamedTuple):
    """The cached pages spelling a prefix: `pages`, the last `depth` of which are the first
    pages of `node` (the root and 0 when nothing matched)."""

    pages: list[int]
    node: PrefixNode
    depth: int


class PrefixCache:
    """Radix tree of committed full pages: the longest cached prefix of a prompt (`match`),
    and a sequence's committed pages added (`insert`)."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = check_int64("page_size", page_size, 1)
        self._page_bytes = page_size * TOKEN_BYTES
        self.root = PrefixNode(b"", b"", [], None, base_key=ROOT_KEY)
        self._roots: dict[bytes, PrefixNode] = {b"": self.root}  # salt -> its root
        # The node listing each page; None for a page the tree does not list.
        self._node_of_page: list[PrefixNode | None] = [None] * allocator.num_pages
        # Called as hook(pages, keys) with the evicted pages, coldest first, before they leave
        # the tree and are written again; keys() returns their tier keys (computed once, for
        # the hooks that ask, and only while the hooks run). A hook must not raise, nor change
        # the tree: eviction runs inside allocations that have passed their checks.
        self.evict_hooks: list[Callable[[list[int], Callable[[], list[PageKey]]], None]] = []
        allocator.on_evict = self._evicted

    @property
    def num_pages(self) -> int:
        """Pages in the tree, held or cached. O(num_pages)."""
        return len(self._node_of_page) - self._node_of_page.count(None)

    @property
    def num_nodes(self) -> int:
        """Nodes below the roots (each a run of pages)."""
        return sum(1 for _ in self._all_nodes())

    def match(self, token_ids: bytes, max_pages: int, salt: bytes = b"") -> PrefixMatch:
        """The cached pages spelling the longest prefix of `token_ids` (packed by
        `pack_tokens`) under `salt` (see `salt_key`), at most `max_pages` pages. Changes
        nothing."""
        root = self._roots.get(salt)
        if root is None:  # nothing cached under this salt: match at a root not in the tree
            return PrefixMatch([], _salted_root(salt), 0)
        pages: list[int] = []
        node, depth = self._walk(token_ids, pages, 0, max_pages, root, 0)
        return PrefixMatch(pages, node, depth)

    def insert(self, token_ids: bytes, pages: list[int], num_cached: int = 0,
               salt: bytes = b"") -> int:
        """Add the full pages `pages` of a live sequence (whose packed ids start
        `token_ids`) past the longest prefix of them the tree holds already; the caller knows
        its first `num_cached` pages to be a path of the tree, and the search starts past
        them; `salt` is the sequence's (its root). Returns how many of its first pages are in
        the tree now: all, unless the tree holds the content of one of them in another page
        (an identical prompt computed at the same time); the sequence keeps its copies from
        there on uncached. ValueError for ids shorter than the pages, InvalidPage for a page
        nobody holds or the tree indexes already, nothing changed; the pages of one sequence
        are distinct (a page table lists a page once), which is not checked."""
        page_bytes = self._page_bytes
        if num_cached:
            node, depth = self._cached_node(pages, num_cached)
        else:  # a salt's root joins the tree with its first pages, once they pass the checks
            node, depth = self._roots.get(salt) or _salted_root(salt), 0
        path: list[int] = []  # the tree's pages spelling its content past them
        node, depth = self._walk(token_ids, path, num_cached, len(pages), node, depth)
        for i, page in enumerate(path, num_cached):
            if page != pages[i]:
                return i
        num_held = num_cached + len(path)
        if num_held == len(pages):
            return num_held
        new_pages = pages[num_held:]
        new_tokens = token_ids[num_held * page_bytes:len(pages) * page_bytes]
        node_of_page = self._node_of_page
        if len(new_tokens) < len(new_pages) * page_bytes:
            raise ValueError(f"token_ids hold {len(token_ids) // TOKEN_BYTES} tokens, fewer "
                             f"than {len(pages)} full pages of {self.page_size}")
        try:  # at C speed: an id that is no page is refused by name in mark_cached
            indexed = any(map(node_of_page.__getitem__, new_pages))
        except (IndexError, TypeError):
            indexed = False
        if indexed:
            raise InvalidPage(f"the pages to index, {new_pages}, hold one the tree indexes "
                              f"already (for other tokens)")
        self.allocator.mark_cached(new_pages)  # InvalidPage, before any change, if not held
        if depth < len(node.pages):
            node = self._split(node, depth)
        if node.parent is not None and not node.children:
            node.pages += new_pages  # the run grows
            node.tokens += new_tokens
        else:
            if node.parent is None:
                self._roots.setdefault(node.key, node)
            node = PrefixNode(new_tokens[:page_bytes], new_tokens, new_pages, node, num_held)
            node.parent.adopt(node)
        for page in new_pages:
            node_of_page[page] = node
        return len(pages)

    def _cached_node(self, pages: list[int], num_cached: int) -> tuple[PrefixNode, int]:
        """The node listing the last of the first `num_cached` of `pages`, which `insert`'s
        caller says are a path of the tree, and that page's depth in it; ValueError
        (TypeError for a non-int) if the tree does not list it there."""
        if type(num_cached) is not int or not 0 < num_cached <= len(pages):
            check_int("num_cached", num_cached, 0, len(pages))
        page = pages[num_cached - 1]
        node = (self._node_of_page[page] if type(page) is int
                and 0 <= page < len(self._node_of_page) else None)
        depth = num_cached - node.start if node is not None else 0
        if not 0 < depth <= len(node.pages) or node.pages[depth - 1] != page:
            raise ValueError(f"insert: page {page!r}, the last of the first {num_cached} "
                             f"(num_cached), is not page {num_cached - 1} of a path in the "
                             f"tree")
        return node, depth

    def evict(self, num_pages: int) -> list[int]:
        """Evict up to `num_pages` cached pages, coldest first; returns their ids, now free."""
        return self.allocator.evict(num_pages)

    def clear(self) -> list[int]:
        """Evict every cached page no sequence holds; returns the freed page ids."""
        return self.allocator.evict(self.allocator.num_cached)

    def chain_key(self, node: PrefixNode, depth: int) -> bytes:
        """The chain key naming the prefix through the first `depth` pages of `node`."""
        unknown = []  # it and the nodes above it whose base keys are not known yet
        while node.base_key is None:  # a loop, as a path may be thousands of nodes deep
            unknown.append(node)
            node = node.parent
        for child in reversed(unknown):  # each computed once, from the root down
            child.base_key = self._key(node, len(node.pages))
            node = child
        return self._key(node, depth)

    def _key(self, node: PrefixNode, depth: int) -> bytes:
        """`chain_key` of a node whose base key is known."""
        if depth == 0:
            return node.base_key
        if len(node.keys) < depth:
            if not node.keys:
                node.keys = []
            key = node.keys[-1] if node.keys else node.base_key
            for i in range(len(node.keys), depth):
                key = chain_key(key, self._packed(node, i))
                node.keys.append(key)
        return node.keys[depth - 1]

    def holds_path(self, pages: list[int]) -> bool:
        """Whether `pages` spell a path of live pages of the tree from the root."""
        if not pages:
            return True
        node = self._node_of_page[pages[-1]]
        if node is None:
            return False
        path = node.pages[:node.pages.index(pages[-1]) + 1]
        while node.parent.parent is not None:
            node = node.parent
            path[:0] = node.pages
        return path == pages

    # ---- internals ---------------------------------------------------------------------

    def _walk(self, token_ids: bytes, pages: list[int], done: int, max_pages: int,
              node: PrefixNode, depth: int) -> tuple[PrefixNode, int]:
        """Continue a match of `token_ids` past its first `done` pages, the last `depth` of
        them the first pages of `node`, up to `max_pages` pages in all, adding the pages it
        spells to `pages`; returns where it stopped: a node and a depth in it."""
        page_bytes = self._page_bytes
        start, limit = done * page_bytes, max_pages * page_bytes
        while start < limit:
            if depth == len(node.pages):  # past this node's run: enter a child
                child = node.children.get(token_ids[start:start + page_bytes])
                if child is None:
                    break
                node, depth = child, 0
            offset = depth * page_bytes
            end = start + len(node.tokens) - offset
            if end > limit:
                end = limit
            if node.tokens.startswith(token_ids[start:end], offset):
                more = (end - start) // page_bytes
            else:
                more = _common_pages(token_ids[start:end], node.tokens[offset:], page_bytes)
            pages += node.pages[depth:depth + more]
            depth, start = depth + more, start + more * page_bytes
            if depth < len(node.pages):
                break
        return node, depth

    def _packed(self, node: PrefixNode, i: int) -> bytes:
        """The packed ids of page i of `node`."""
        return node.tokens[i * self._page_bytes:(i + 1) * self._page_bytes]

    def _evicted(self, pages: list[int]) -> None:
        """The allocator's eviction listener: run the hooks, then cut `pages` (coldest first,
        each the last page of a leaf once the pages before it in the list are cut) from the
        tree. Pages of one leaf listed one after another (as a sequence queues its pages tail
        first, they mostly are) are cut at once."""
        try:
            if self.evict_hooks:
                keys = functools.cache(functools.partial(self._evicted_keys, pages))
                for hook in self.evict_hooks:
                    hook(pages, keys)
        finally:  # even past a hook that raised: the allocator frees the pages all the same
            node_of_page = self._node_of_page
            leaf, cut = None, 0
            for page in pages:
                node = node_of_page[page]
                node_of_page[page] = None
                if node is not leaf:
                    if cut:
                        self._cut(leaf, cut)
                    leaf, cut = node, 0
                cut += 1
            if cut:
                self._cut(leaf, cut)

    def _evicted_keys(self, pages: list[int]) -> list[PageKey]:
        """The tier keys of `pages`, listed as `_evicted` takes them: the k-th page of a node
        in the list is its k-th page from the end."""
        keys, listed = [], {}
        for page in pages:
            node = self._node_of_page[page]
            listed[node] = k = listed.get(node, 0) + 1
            i = len(node.pages) - k
            keys.append(PageKey.of_packed(self.chain_key(node, i), self._packed(node, i)))
        return keys

    def _cut(self, leaf: PrefixNode, n: int) -> None:
        """Cut the last `n` pages of `leaf`; a leaf left empty goes, and so does a salted root
        left with no child."""
        if n < len(leaf.pages):
            del leaf.pages[-n:]
            leaf.tokens = leaf.tokens[:-n * self._page_bytes]
            if len(leaf.keys) > len(leaf.pages):
                del leaf.keys[len(leaf.pages):]
            return
        siblings = leaf.parent.children
        del siblings[leaf.key]
        if not siblings and leaf.parent.parent is None and leaf.parent is not self.root:
            del self._roots[leaf.parent.key]

    def _split(self, node: PrefixNode, depth: int) -> PrefixNode:
        """Split `node` after its first `depth` pages into a new parent holding those and
        `node` holding the rest. Returns the new parent."""
        cut = depth * self._page_bytes
        head = PrefixNode(node.key, node.tokens[:cut], node.pages[:depth], node.parent,
                          node.start, base_key=node.base_key, keys=node.keys[:depth])
        node.parent.children[head.key] = head
        node.tokens = node.tokens[cut:]
        del node.pages[:depth]
        node.key = node.tokens[:self._page_bytes]
        node.parent = head
        node.start += depth
        node.base_key = None
        node.keys = node.keys[depth:]
        head.adopt(node)
        for page in head.pages:
            self._node_of_page[page] = head
        return head

    def _all_nodes(self) -> Iterator[PrefixNode]:
        """Every node below every root."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def check(self) -> None:
        """Tree invariants: links, keys and the page index consistent, no empty node, each
        page listed once; the tree's pages exactly the pages the allocator marks as the
        tree's, held or cached (so every cached page, and no evicted one); along every path a
        page is held whenever the page after it is, and is warmer when both are cached (so
        that eviction always takes a leaf's last page)."""
        page_bytes = self._page_bytes
        cached = self.allocator.cached_pages()
        rank = {page: i for i, page in enumerate(cached)}  # 0: the coldest
        listed: list[int] = []
        indexed = [page for page, node in enumerate(self._node_of_page) if node is not None]
        marked = self.allocator.marked_pages()
        assert indexed == marked, (
            f"the tree lists pages {sorted(set(indexed) - set(marked))[:5]} the allocator "
            f"does not mark as its own, and misses marked pages "
            f"{sorted(set(marked) - set(indexed))[:5]}")
        for salt, root in self._roots.items():
            assert root.key == salt and root.parent is None and not root.pages, (
                f"the root of salt {salt.hex()} is misplaced")
            assert root is self.root or root.children, f"salt {salt.hex()} has an empty root"
        for node in self._all_nodes():
            assert node.pages, "an empty node is left in the tree"
            where = f"node at page {node.pages[0]}"
            assert node.parent.children.get(node.key) is node, f"{where} is misplaced"
            assert type(node.key) is bytes and node.key == node.tokens[:page_bytes], (
                f"{where} has a stale key")
            assert len(node.tokens) == page_bytes * len(node.pages), (
                f"{where} has {len(node.tokens)} token bytes for {len(node.pages)} pages")
            assert node.start == node.parent.start + len(node.parent.pages), (
                f"{where} starts at page {node.start} of its prefix, after "
                f"{node.parent.start + len(node.parent.pages)} pages")
            for earlier, later in pairwise(node.parent.pages[-1:] + node.pages):
                assert not (earlier in rank and later not in rank), (
                    f"page {later} is held but the page before it, {earlier}, is not")
                if earlier in rank and later in rank:
                    assert rank[later] < rank[earlier], (
                        f"cached page {later} is warmer than the page before it, {earlier}")
            for page in node.pages:
                assert self._node_of_page[page] is node, (
                    f"page {page} missing from the page index")
            if node.base_key is not None and node.parent.base_key is not None:
                assert node.base_key == self.chain_key(node.parent, len(node.parent.pages)), (
                    f"{where}: stale base key")
            if node.keys:
                key = self.chain_key(node, 0)
                for i, kept in enumerate(node.keys):
                    key = chain_key(key, self._packed(node, i))
                    assert kept == key, f"{where}: stale chain key of page {node.pages[i]}"
            assert len(node.keys) <= len(node.pages), (
                f"{where} keeps {len(node.keys)} chain keys for {len(node.pages)} pages")
            listed += node.pages
        assert len(listed) == len(indexed), (
            f"the page index names {len(indexed)} pages, the tree lists {len(listed)}")


def salt_key(cache_salt: str | None) -> bytes:
    """The root key of a cache salt: b"" for none (the shared root), else its SHA-256, so
    that the tree keeps 32 bytes of any salt and never the salt itself (an API key)."""
    if cache_salt is None:
        return b""
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    return hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()


def _salted_root(salt: bytes) -> PrefixNode:
    """A root for `salt` (not the unsalted b""); its chain key is a BLAKE2b digest of the
    salt personalized apart from the pages' (`chain_key`), so no key below it equals an
    unsalted one, nor one of another salt, but by a 128-bit collision."""
    base_key = hashlib.blake2b(salt, digest_size=KEY_BYTES, person=b"kvpool salt").digest()
    return PrefixNode(salt, b"", [], None, base_key=base_key)


# The match of a prompt whose content is unknown, or of any prompt when caching is off
# (shared: callers never change a match).
NO_MATCH = PrefixMatch([], PrefixNode(b"", b"", [], None, base_key=ROOT_KEY), 0)


class NoPrefixCache:
    """Stands in for the prefix cache when caching is off: matches nothing, keeps nothing,
    holds only the empty path."""

    def match(self, token_ids: bytes, max_pages: int, salt: bytes = b"") -> PrefixMatch:
        return NO_MATCH

    def insert(self, token_ids: bytes, pages: list[int], num_cached: int = 0,
               salt: bytes = b"") -> int:
        return 0

    def holds_path(self, pages: list[int]) -> bool:
        return not pages

    def check(self) -> None:
        """Nothing to check: it holds no state."""


def _common_pages(ids: bytes, tokens: bytes, page_bytes: int) -> int:
    """How many whole pages (`page_bytes` each) of packed `ids` equal `tokens` from the front."""
    depth = 0
    for offset in range(0, len(ids), page_bytes):
        if ids[offset:offset + page_bytes] != tokens[offset:offset + page_bytes]:
            break
        depth += 1
    return depth
