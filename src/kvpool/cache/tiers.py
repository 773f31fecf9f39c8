"""Tiers below the pool: host memory and disk (here), Redis (`redis_tier`). Evicted prefix
pages go there instead of being lost, and load back when a later prompt continues their
prefix. A page is stored under a `PageKey`, which names its whole prefix, in a tier bound to
one namespace (model and layout: `page_namespace`): a page of another is never served."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import struct
import tempfile
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import torch

from kvpool.cache.tokens import pack_tokens, unpack_tokens
from kvpool.errors import OutOfMemory
from kvpool.numeric import check_int64

KEY_BYTES = 16  # a chain key: a BLAKE2b digest of this many bytes
ROOT_KEY = bytes(KEY_BYTES)  # chain key of the empty prefix


def chain_key(parent_key: bytes, packed_ids: bytes) -> bytes:
    """The chain key of a page holding the ids packed in `packed_ids` (`pack_tokens`) below
    the prefix named `parent_key`: a 128-bit BLAKE2b digest of both, so that no two prefixes
    can be made to share one, and the same in every process."""
    return hashlib.blake2b(parent_key + packed_ids, digest_size=KEY_BYTES,
                           person=b"kvpool page").digest()


@dataclass(frozen=True, slots=True)
class PageKey:
    """Names one page by its whole prefix: `chain_key` of the prefix through this page,
    `parent_key` of the prefix before it, and the page's `token_ids`, which every lookup
    compares. A chain key is a cryptographic digest of the whole prefix: two prefixes never
    share one but by a 128-bit collision, which no one can craft."""

    chain_key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, parent_key: bytes, token_ids: Sequence[int]) -> PageKey:
        """The key of the page holding `token_ids` below the prefix named `parent_key`.
        TypeError or ValueError for an id that is not an int32."""
        return cls.of_packed(parent_key, pack_tokens(list(token_ids)))

    @classmethod
    def of_packed(cls, parent_key: bytes, packed_ids: bytes) -> PageKey:
        """`of` for ids packed by `pack_tokens`."""
        return cls(chain_key(parent_key, packed_ids), parent_key, unpack_tokens(packed_ids))


@dataclass(slots=True)
class TierStats:
    """A tier's counters, in pages (hits and misses count `get` calls)."""

    capacity_pages: int
    num_pages: int = 0  # held now
    num_stored: int = 0  # cumulative puts
    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0  # pages dropped to make room (least recently used first)
    num_dropped: int = 0  # pages `store` could not keep (a failed read or write)
    num_corrupt: int = 0  # stored pages that failed their checks on load, and were removed


class Tier(ABC):
    """Storage for at most `capacity_pages` evicted prefix pages, dropping the least recently
    used beyond. A page's data is one page of `KVPool.read_pages`. Subclasses say where the
    data lives (`_open`, `_write`, `_read`, `_discard`); this class keeps the index, the
    recency order and the counters."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = check_int64("capacity_pages", capacity_pages, 1)
        self.namespace: str | None = None
        self.page_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self._keys: OrderedDict[bytes, PageKey] = OrderedDict()  # least recently used first
        self._counts = TierStats(capacity_pages)  # cumulative; stats() adds capacity and size

    def bind(self, namespace: str, page_shape: Sequence[int], dtype: torch.dtype) -> None:
        """Fix what this tier stores: pages of `namespace`, shaped `page_shape`, of `dtype`.
        Binding again to the same is allowed; to anything else raises ValueError. TypeError
        for a namespace that is not a str, a dtype that is not a torch.dtype or a page_shape
        that is not a sequence of ints, ValueError for a size below 1: nothing changed."""
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__} "
                            f"{namespace!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if not isinstance(page_shape, Sequence):
            raise TypeError(f"page_shape must be a sequence of ints, got "
                            f"{type(page_shape).__name__} {page_shape!r}")
        for size in page_shape:
            check_int64("page_shape sizes", size, 1)
        wanted = (namespace, tuple(page_shape), dtype)
        if self.namespace is None:
            self._open(*wanted)
            self.namespace, self.page_shape, self.dtype = wanted
        elif (self.namespace, self.page_shape, self.dtype) != wanted:
            raise ValueError(
                f"this tier holds pages of {self.namespace!r} shaped {self.page_shape} "
                f"({self.dtype}); a cache of {namespace!r} shaped {tuple(page_shape)} "
                f"({dtype}) cannot share it")

    def put(self, key: PageKey, data: torch.Tensor) -> None:
        """Store one page's data under `key` (replacing what its chain key held), dropping
        the least recently used page if the tier is full. ValueError for data of another
        shape or dtype, OSError if the storage fails; the index stays consistent. TypeError
        for a key that is not a PageKey or data that is not a tensor, ValueError for a key
        whose chain key is not that of its parent key (a chain key) and token ids: nothing
        changed."""
        self._check_put(key, data)
        victim = self._keys.get(key.chain_key)  # the page it replaces, or the coldest
        full = victim is None and len(self._keys) >= self.capacity_pages
        if full:
            victim = next(iter(self._keys.values()))
        if victim is not None:
            self._discard(victim)  # raising, it stays indexed: its storage is still held
            del self._keys[victim.chain_key]
            if full:
                self._counts.num_evictions += 1
        self._write(key, data)
        self._keys[key.chain_key] = key
        self._counts.num_stored += 1

    def _check_put(self, key: PageKey, data: torch.Tensor) -> None:
        """`put`'s checks, and ValueError for a tier not bound yet (a key filed under another
        chain key would leave the index inconsistent)."""
        if type(key) is not PageKey:
            raise TypeError(f"tier keys must be PageKeys, got {type(key).__name__} {key!r}")
        if not _well_formed(key):
            raise ValueError(f"{key} does not hold the chain key of its parent key and token "
                             f"ids (a parent key is a {KEY_BYTES}-byte chain key)")
        if self.namespace is None:
            raise ValueError("bind the tier to a namespace before storing pages")
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"tier pages must be tensors, got {type(data).__name__}")
        if tuple(data.shape) != self.page_shape or data.dtype != self.dtype:
            raise ValueError(f"tier pages are shaped {self.page_shape} ({self.dtype}), "
                             f"got {tuple(data.shape)} ({data.dtype})")

    def store(self, key: PageKey, data: torch.Tensor) -> bool:
        """`put` that never raises, for eviction, which must not fail: a page the tier cannot
        keep, or one `put` refuses (a bad key included), is dropped and counted. Returns
        whether it was stored."""
        try:
            self.put(key, data)
        except Exception:  # noqa: BLE001 - any failure of a store is a dropped page
            self._counts.num_dropped += 1
            return False
        return True

    def count_dropped(self, n: int) -> None:
        """Count `n` pages dropped before they reached `store` (their data could not be
        read)."""
        self._counts.num_dropped += n

    def get(self, key: PageKey) -> torch.Tensor | None:
        """A copy of the page stored under `key`, now the most recently used; None (a miss)
        if the tier holds none for this exact prefix or cannot read it, or `key` is not a
        PageKey. Never raises."""
        if key in self:
            data = self._read(key)
            if data is not None:
                self._keys.move_to_end(key.chain_key)
                self._counts.num_hits += 1
                return data
            with contextlib.suppress(OSError):  # one left behind is served no more
                self._discard(self._keys.pop(key.chain_key))
        self._counts.num_misses += 1
        return None

    def __contains__(self, key: PageKey) -> bool:
        """Whether the tier holds a page for exactly this prefix (False for a key that is
        not a PageKey)."""
        return is_page_key(key) and self._keys.get(key.chain_key) == key

    def __len__(self) -> int:
        """Pages held."""
        return len(self._keys)

    def __iter__(self) -> Iterator[PageKey]:
        """The stored keys, least recently used first."""
        return iter(list(self._keys.values()))

    def stats(self) -> TierStats:
        """A snapshot of the counters, with the capacity and the pages held now."""
        return replace(self._counts, capacity_pages=self.capacity_pages,
                       num_pages=len(self._keys))

    def clear(self) -> None:
        """Drop every page (counters stay); raising, the pages not dropped stay indexed."""
        for key in list(self._keys.values()):
            self._discard(key)
            del self._keys[key.chain_key]

    def check(self) -> None:
        """Index invariants: within capacity, every key filed under its own chain key."""
        assert len(self._keys) <= self.capacity_pages, (
            f"tier holds {len(self._keys)} pages, capacity {self.capacity_pages}")
        for ck, key in self._keys.items():
            assert ck == key.chain_key and _well_formed(key), (
                f"key {key} filed under {ck}")

    def _page_of(self, record: bytes, key: PageKey) -> torch.Tensor | None:
        """The page data in `record` (a `page_record`); None, counted corrupt, unless it is
        whole and holds `key`'s page of this tier's namespace, shape and dtype (its payload
        one page of bytes, whatever its header says)."""
        f = io.BytesIO(record)
        header = _read_header(f, self.namespace, self.page_shape, self.dtype)
        payload = bytearray(f.read())
        if (header != (key, len(payload), zlib.crc32(payload))
                or len(payload) != math.prod(self.page_shape) * self.dtype.itemsize):
            self._counts.num_corrupt += 1
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.page_shape)

    @abstractmethod
    def _open(self, namespace: str, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Prepare the storage for pages of `namespace`; raise before changing anything."""

    @abstractmethod
    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        """Store `data` for `key`, which is not in the index."""

    @abstractmethod
    def _read(self, key: PageKey) -> torch.Tensor | None:
        """A copy of the data stored for `key`, None if lost or damaged."""

    @abstractmethod
    def _discard(self, key: PageKey) -> None:
        """Release the storage of `key`, which leaves the index (raising from `put`'s
        eviction, it stays indexed)."""


class HostTier(Tier):
    """Pages in host memory: one CPU tensor of `capacity_pages` pages, allocated when the
    tier is bound and never resized, and a free list of its slots. `pin_memory=True` pins
    it for faster copies to and from a GPU."""

    def __init__(self, capacity_pages: int, *, pin_memory: bool = False):
        super().__init__(capacity_pages)
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self.pin_memory = pin_memory
        self.buffer: torch.Tensor | None = None  # [capacity_pages, *page shape]
        self._slot_of: dict[bytes, int] = {}  # chain key -> slot in `buffer`
        self._free_slots: list[int] = []  # made when bound; pop() takes slot 0 first

    @property
    def nbytes(self) -> int:
        """Bytes held by the store (0 before the tier is bound)."""
        return 0 if self.buffer is None else self.buffer.nbytes

    def check(self) -> None:
        """Index invariants, and the slots in use (one per page) and free partition the
        capacity."""
        super().check()
        assert set(self._slot_of) == set(self._keys), "slot index disagrees with the keys"
        used = sorted(self._slot_of.values())
        slots = list(range(self.capacity_pages)) if self.buffer is not None else []
        assert sorted(used + self._free_slots) == slots, (
            f"slots in use {used} and free {sorted(self._free_slots)} do not partition "
            f"[0, {self.capacity_pages})")

    def _open(self, namespace: str, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        shape = (self.capacity_pages, *page_shape)
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no int64 wrap
        ram = None  # where the platform does not say
        with contextlib.suppress(AttributeError, ValueError, OSError):
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if ram is not None and nbytes > ram:
            raise OutOfMemory(f"HostTier of {self.capacity_pages:,} pages needs {nbytes:,} "
                              f"bytes, more than this machine's {ram:,} bytes of memory")
        try:
            # zeroed so that its memory is committed now, not page fault by page fault in puts
            self.buffer = torch.zeros(shape, dtype=dtype, pin_memory=self.pin_memory)
        except (RuntimeError, MemoryError) as e:
            raise OutOfMemory(f"cannot allocate {nbytes:,} bytes for a HostTier of "
                              f"{self.capacity_pages:,} pages: {e}") from None
        self._free_slots = list(range(self.capacity_pages - 1, -1, -1))

    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        slot = self._free_slots[-1]  # taken once the copy is in: one that raises keeps it free
        self.buffer[slot].copy_(data)
        self._slot_of[key.chain_key] = self._free_slots.pop()

    def _read(self, key: PageKey) -> torch.Tensor:
        # A copy: the slot may be reused by the next put while the caller still holds it.
        return self.buffer[self._slot_of[key.chain_key]].clone()

    def _discard(self, key: PageKey) -> None:
        self._free_slots.append(self._slot_of.pop(key.chain_key))


_MAGIC = b"KVPOOLPG"
_PREFIX = struct.Struct("<8sII")
_FORMAT_VERSION = 2  # 2: chain keys are BLAKE2b digests (1: Python's hash of a tuple)
_TMP_PREFIX = ".kvpage-"
STALE_WRITE_SECONDS = 60  # a temporary page file this old is an interrupted write's


class DiskTier(Tier):
    """Pages on disk in `directory`, one file per page (a `page_record`) named by namespace
    and chain key, written atomically (a temporary renamed) and checked on every load: one
    that fails is a miss, removed and counted. Binding indexes the namespace's files already
    there in recency order (modification times), removing those that fail their header,
    those beyond capacity and its temporaries of interrupted writes (older than
    STALE_WRITE_SECONDS: a younger one may be a live replica's write); other namespaces'
    files are left alone."""

    def __init__(self, directory: str | os.PathLike, capacity_pages: int):
        super().__init__(capacity_pages)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"tier directory {str(self.directory)!r} is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create tier directory {str(self.directory)!r}: {e}") from e
        self._tag = ""  # file name prefix of the bound namespace
        self._last_use_ns = 0  # mtime stamped on the most recently used page file

    def path(self, key: PageKey) -> Path:
        """The file holding the page stored under `key`."""
        return self.directory / f"{self._tag}-{key.chain_key.hex()}.kvpage"

    def _open(self, namespace: str, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._tag = namespace_tag(namespace)
        now = time.time()
        for f in self.directory.glob(f"{_TMP_PREFIX}{self._tag}-*.tmp"):
            with contextlib.suppress(OSError):  # gone meanwhile: written by a live tier
                if now - f.stat().st_mtime > STALE_WRITE_SECONDS:
                    _remove(f)
        stamped = sorted(_stamped(self.directory.glob(f"{self._tag}-*.kvpage")))
        self._last_use_ns = stamped[-1][0] if stamped else 0
        for _, path in stamped:
            header = None
            with contextlib.suppress(OSError), open(path, "rb") as f:
                header = _read_header(f, namespace, page_shape, dtype)
            if header is None or self.path(header[0]) != path:
                self._counts.num_corrupt += 1
                _remove(path)
            else:
                self._keys[header[0].chain_key] = header[0]
        while len(self._keys) > self.capacity_pages:
            _remove(self.path(self._keys.popitem(last=False)[1]))

    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        record = page_record(self.namespace, key, data)
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)  # it may have been removed
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{_TMP_PREFIX}{self._tag}-",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._touch(path)

    def _read(self, key: PageKey) -> torch.Tensor | None:
        path = self.path(key)
        try:
            record = path.read_bytes()
        except OSError:
            return None
        data = self._page_of(record, key)
        if data is not None:
            self._touch(path)
        return data

    def _discard(self, key: PageKey) -> None:
        self.path(key).unlink(missing_ok=True)  # raising (read-only), the page stays indexed

    def _touch(self, path: Path) -> None:
        """Stamp `path` used now, strictly after every other page file (the clock may tick
        coarser than uses), so that a reopened index keeps the recency order; in memory only
        where the directory cannot be written."""
        self._last_use_ns = max(time.time_ns(), self._last_use_ns + 1)
        with contextlib.suppress(OSError):
            os.utime(path, ns=(self._last_use_ns, self._last_use_ns))


def is_page_key(key: object) -> bool:
    """Whether `key` is a PageKey whose chain key can be looked up (bytes)."""
    return type(key) is PageKey and type(key.chain_key) is bytes


def _well_formed(key: PageKey) -> bool:
    """Whether `key`'s chain key is that of its parent key, a chain key, and token ids."""
    try:
        return (type(key.parent_key) is bytes and len(key.parent_key) == KEY_BYTES
                and key.chain_key == chain_key(key.parent_key, pack_tokens(list(key.token_ids))))
    except (TypeError, ValueError):  # ids that are not int32s
        return False


def _stamped(paths: Iterator[Path]) -> Iterator[tuple[int, Path]]:
    """Each of `paths` with its modification time, skipping those gone meanwhile (another
    process sharing the directory) or that cannot be read."""
    for path in paths:
        with contextlib.suppress(OSError):
            yield path.stat().st_mtime_ns, path


def _remove(path: Path) -> None:
    """Remove a page file if the directory lets us (one left behind is never indexed)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def namespace_tag(namespace: str) -> str:
    """A short hash of `namespace` (16 hex digits) that names its pages in a shared store."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


def page_record(namespace: str, key: PageKey, data: torch.Tensor) -> bytes:
    """One stored page as bytes: magic, header length and CRC-32, the header (JSON: format
    version, namespace, key, shape, dtype, payload length and CRC-32), the payload."""
    payload = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    header = json.dumps({
        "version": _FORMAT_VERSION, "namespace": namespace,
        "parent_key": key.parent_key.hex(), "token_ids": list(key.token_ids),
        "shape": list(data.shape), "dtype": str(data.dtype),
        "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload),
    }).encode()
    return b"".join([_PREFIX.pack(_MAGIC, len(header), zlib.crc32(header)), header,
                     payload.tobytes()])


def _read_header(f: BinaryIO, namespace: str, page_shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[PageKey, object, object] | None:
    """(key, payload length, payload CRC-32) from the header of the record open as `f`, left
    at the payload; None unless the magic and CRC-32 match and the header names this format
    version, namespace, shape and dtype."""
    try:
        magic, header_len, header_crc = _PREFIX.unpack(f.read(_PREFIX.size))
        raw = f.read(header_len)
        if magic != _MAGIC or len(raw) != header_len or zlib.crc32(raw) != header_crc:
            return None
        header = json.loads(raw)
        key = PageKey.of(bytes.fromhex(header["parent_key"]), header["token_ids"])
    except (struct.error, ValueError, KeyError, TypeError, RecursionError):  # nested JSON
        return None
    if len(key.parent_key) != KEY_BYTES:
        return None
    if (header.get("version") != _FORMAT_VERSION or header.get("namespace") != namespace
            or header.get("shape") != list(page_shape) or header.get("dtype") != str(dtype)):
        return None
    return key, header.get("payload_bytes"), header.get("payload_crc32")


def page_namespace(layout, model_fingerprint: str = "", kv_scales=None) -> str:
    """What a stored page of `layout` is valid for: the KV geometry, dtype and page size,
    `model_fingerprint` (naming the model's architecture and weights) and, for fp8 pages,
    `kv_scales`, without which the stored bytes mean nothing."""
    scales = "" if kv_scales is None else f" kv_scales={kv_scales}"
    return (f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} "
            f"head_dim={layout.head_dim} dtype={layout.dtype} page_size={layout.page_size} "
            f"kind={layout.kind} model={model_fingerprint}{scales}")
