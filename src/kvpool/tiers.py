"""Tiers below the pool: host memory and disk, where evicted prefix pages go instead of
being lost, to be loaded back into fresh pages when a later prompt continues their prefix.

A page is stored under a `PageKey`: its chain key `hash((parent_key, token_ids))` names
the whole prefix up to and including the page, and the key also keeps the parent's chain
key and the page's own token ids, which `get` compares so that a hash collision is a miss,
never wrong KV. CPython hashes ints and tuples of ints the same way in every process (hash
randomization only touches str and bytes), so chain keys are stable across runs. Each tier
keeps at most `capacity_pages` pages and drops the least recently used (put or hit) beyond.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT_KEY = 0  # chain key of the empty prefix


def chain_key(parent_key: int, token_ids: tuple[int, ...]) -> int:
    """The chain key of a page holding `token_ids` below the prefix named `parent_key`."""
    return hash((parent_key, token_ids))


@dataclass(frozen=True, slots=True)
class PageKey:
    """Names one page by its whole prefix: `chain_key` of the prefix through this page,
    `parent_key` of the prefix before it, and the page's own `token_ids`."""

    chain_key: int
    parent_key: int
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, parent_key: int, token_ids: Sequence[int]) -> PageKey:
        """The key of the page holding `token_ids` below the prefix named `parent_key`."""
        tokens = tuple(token_ids)
        return cls(chain_key(parent_key, tokens), parent_key, tokens)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of a tier's counters, in pages (hits and misses count `get` calls)."""

    capacity_pages: int
    num_pages: int  # held now
    num_stored: int  # cumulative puts
    num_hits: int
    num_misses: int
    num_evictions: int  # pages dropped to make room (least recently used first)

    @property
    def hit_rate(self) -> float:
        """Fraction of `get` calls that returned a page."""
        lookups = self.num_hits + self.num_misses
        return self.num_hits / lookups if lookups else 0.0


class Tier(ABC):
    """Storage for evicted prefix pages, at most `capacity_pages` of them, LRU beyond that.

    A page's data is shaped `[num_layers, 2, page_size, num_kv_heads, head_dim]` (one page
    of `KVPool.read_pages`). Subclasses say where the data lives (`_write`, `_read`,
    `_discard`); this class keeps the index, the recency order and the counters.
    """

    def __init__(self, capacity_pages: int):
        if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int) \
                or capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be a positive int, got {capacity_pages!r}")
        self.capacity_pages = capacity_pages
        self._keys: OrderedDict[int, PageKey] = OrderedDict()  # least recently used first
        self._num_stored = 0
        self._num_hits = 0
        self._num_misses = 0
        self._num_evictions = 0

    def put(self, key: PageKey, data: torch.Tensor) -> None:
        """Store one page's data under `key` (replacing what its chain key held), dropping
        the least recently used page if the tier is full. Raises OSError if the storage
        fails (disk full); the index stays consistent."""
        self._prepare(data)
        if key.chain_key not in self._keys and len(self._keys) == self.capacity_pages:
            _, victim = self._keys.popitem(last=False)
            self._discard(victim)
            self._num_evictions += 1
        self._write(key, data)
        self._keys[key.chain_key] = key
        self._keys.move_to_end(key.chain_key)
        self._num_stored += 1

    def get(self, key: PageKey) -> torch.Tensor | None:
        """A copy of the page stored under `key`, or None (a miss) if the tier holds no page
        for this exact prefix. A hit makes the page the most recently used."""
        data = self._read(key) if key in self else None
        if data is None:
            if key in self:  # indexed but unreadable (a damaged or removed file): forget it
                del self._keys[key.chain_key]
                self._discard(key)
            self._num_misses += 1
            return None
        self._keys.move_to_end(key.chain_key)
        self._num_hits += 1
        return data

    def __contains__(self, key: PageKey) -> bool:
        """Whether the tier holds a page for exactly this prefix. Changes nothing."""
        return self._keys.get(key.chain_key) == key

    def __len__(self) -> int:
        """Pages held."""
        return len(self._keys)

    def __iter__(self) -> Iterator[PageKey]:
        """The stored keys, least recently used first."""
        return iter(list(self._keys.values()))

    def stats(self) -> TierStats:
        """Capacity, pages held, and cumulative put/hit/miss/eviction counts."""
        return TierStats(self.capacity_pages, len(self._keys), self._num_stored,
                         self._num_hits, self._num_misses, self._num_evictions)

    def clear(self) -> None:
        """Drop every page (counters stay)."""
        for key in self._keys.values():
            self._discard(key)
        self._keys.clear()

    def check(self) -> None:
        """Index invariants: within capacity, every key filed under its own chain key."""
        assert len(self._keys) <= self.capacity_pages, (
            f"tier holds {len(self._keys)} pages, capacity {self.capacity_pages}")
        for ck, key in self._keys.items():
            assert ck == key.chain_key == chain_key(key.parent_key, key.token_ids), (
                f"key {key} filed under {ck}")

    @abstractmethod
    def _prepare(self, data: torch.Tensor) -> None:
        """Raise ValueError if `data` cannot be stored; runs before `put` changes anything."""

    @abstractmethod
    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        """Store `data` for `key` (new or replacing an entry with the same chain key)."""

    @abstractmethod
    def _read(self, key: PageKey) -> torch.Tensor | None:
        """A copy of the data stored for `key` (which the index holds), None if lost."""

    @abstractmethod
    def _discard(self, key: PageKey) -> None:
        """Release the storage of `key`, which has left the index."""


class HostTier(Tier):
    """Pages in host memory: one CPU tensor of `capacity_pages` pages, allocated by the
    first `put` (which fixes the page shape and dtype) and never resized, with a free list
    of its page slots. `pin_memory=True` pins it for faster copies to and from a GPU."""

    def __init__(self, capacity_pages: int, *, pin_memory: bool = False):
        super().__init__(capacity_pages)
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self.pin_memory = pin_memory
        self.store: torch.Tensor | None = None  # [capacity_pages, *page shape]
        self._slot_of: dict[int, int] = {}  # chain key -> slot in `store`
        self._free_slots = list(range(capacity_pages - 1, -1, -1))  # pop() takes slot 0 first

    @property
    def nbytes(self) -> int:
        """Bytes held by the store (0 before the first put)."""
        return 0 if self.store is None else self.store.numel() * self.store.element_size()

    def check(self) -> None:
        """Index invariants plus: every stored page has its own slot; slots in use and
        free slots add up to the capacity."""
        super().check()
        assert set(self._slot_of) == set(self._keys), "slot index disagrees with the keys"
        used = sorted(self._slot_of.values())
        assert sorted(used + self._free_slots) == list(range(self.capacity_pages)), (
            f"slots in use {used} and free {sorted(self._free_slots)} do not partition "
            f"[0, {self.capacity_pages})")

    def _prepare(self, data: torch.Tensor) -> None:
        if self.store is None:  # the one allocation: the first page fixes shape and dtype
            # zeroed so that its memory is committed now, not page fault by page fault in puts
            self.store = torch.zeros((self.capacity_pages, *data.shape), dtype=data.dtype,
                                     pin_memory=self.pin_memory)
        elif tuple(data.shape) != tuple(self.store.shape[1:]):
            raise ValueError(f"tier pages are shaped {tuple(self.store.shape[1:])}, "
                             f"got {tuple(data.shape)}")

    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        slot = self._slot_of.get(key.chain_key)
        if slot is None:
            slot = self._free_slots.pop()
            self._slot_of[key.chain_key] = slot
        self.store[slot].copy_(data)

    def _read(self, key: PageKey) -> torch.Tensor:
        # A copy: the slot may be reused by the next put while the caller still holds it.
        return self.store[self._slot_of[key.chain_key]].clone()

    def _discard(self, key: PageKey) -> None:
        self._free_slots.append(self._slot_of.pop(key.chain_key))


_PAGE_FILE = re.compile(r"^[0-9a-f]{16}\.kvpage$")
_TMP_PREFIX = ".kvpage-"


class DiskTier(Tier):
    """Pages on disk in `directory`, one file per page named by its chain key. Files are
    written atomically (to a temporary name, then renamed), removed on eviction and by
    `clear()`. Opening a directory that holds pages indexes them again, least recently
    used (by file modification time) first."""

    def __init__(self, directory: str | os.PathLike, capacity_pages: int):
        super().__init__(capacity_pages)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"tier directory {str(self.directory)!r} is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create tier directory {str(self.directory)!r}: {e}") \
                from e
        self._last_use_ns = 0  # mtime stamped on the most recently used page file
        self._reopen()

    def path(self, key: PageKey) -> Path:
        """The file holding the page stored under `key`."""
        return self.directory / f"{key.chain_key & 0xFFFF_FFFF_FFFF_FFFF:016x}.kvpage"

    def check(self) -> None:
        """Index invariants plus: every indexed page has its file."""
        super().check()
        for key in self._keys.values():
            assert self.path(key).is_file(), f"page file {self.path(key).name} is missing"

    def _reopen(self) -> None:
        """Index the pages already in the directory, least recently used first; drop
        unreadable files, those beyond capacity and temporaries of interrupted writes."""
        for f in self.directory.glob(f"{_TMP_PREFIX}*.tmp"):
            f.unlink(missing_ok=True)
        files = [f for f in self.directory.iterdir() if _PAGE_FILE.match(f.name)]
        mtimes = {f: f.stat().st_mtime_ns for f in files}
        files.sort(key=mtimes.__getitem__)
        self._last_use_ns = max(mtimes.values(), default=0)
        for f in files:
            record = _load_record(f, mmap=True)
            if record is None or self.path(record[0]) != f:
                f.unlink(missing_ok=True)
                continue
            self._keys[record[0].chain_key] = record[0]
        while len(self._keys) > self.capacity_pages:
            self._discard(self._keys.popitem(last=False)[1])

    def _prepare(self, data: torch.Tensor) -> None:
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"tier pages are tensors, got {type(data).__name__}")

    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        record = {"parent_key": key.parent_key, "token_ids": list(key.token_ids),
                  "data": data.detach().to("cpu").clone()}  # clone: save this page alone
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TMP_PREFIX, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(record, f)
            os.replace(tmp, self.path(key))
        except RuntimeError as e:  # torch's zip writer reports a failed write this way
            Path(tmp).unlink(missing_ok=True)
            raise OSError(f"cannot write tier page {self.path(key).name}: {e}") from e
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._touch(self.path(key))

    def _read(self, key: PageKey) -> torch.Tensor | None:
        record = _load_record(self.path(key), mmap=False)
        if record is None or record[0] != key:
            return None  # damaged, or overwritten behind our back
        self._touch(self.path(key))
        return record[1]

    def _discard(self, key: PageKey) -> None:
        self.path(key).unlink(missing_ok=True)

    def _touch(self, path: Path) -> None:
        """Stamp `path` used now, strictly after every other page file (the clock may tick
        coarser than uses), so that a reopened index keeps the exact recency order."""
        self._last_use_ns = max(time.time_ns(), self._last_use_ns + 1)
        os.utime(path, ns=(self._last_use_ns, self._last_use_ns))


def _load_record(path: Path, *, mmap: bool) -> tuple[PageKey, torch.Tensor] | None:
    """The key and data of a page file (`mmap`: the data stays on disk until touched),
    None if the file is missing or is not a page file."""
    try:
        record = torch.load(path, weights_only=True, mmap=mmap)
        key = PageKey.of(record["parent_key"], record["token_ids"])
        data = record["data"]
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, KeyError, TypeError):
        return None
    return (key, data) if isinstance(data, torch.Tensor) else None
