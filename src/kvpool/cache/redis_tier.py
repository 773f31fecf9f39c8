"""RedisTier: evicted prefix pages in a Redis server, shared by every engine reading it: a
prompt one replica computed, the next loads. Each page is one Redis string (the record
`DiskTier` writes) under its namespace and chain key; a value that fails its checks is a miss,
deleted and counted. Redis down or slow never fails the engine: every call has a timeout, a
failed store is dropped, a failed load a miss, and after Redis could not be reached the tier
leaves it alone for `retry_interval` seconds (a dead server costs one timeout, not one per
page). A server bounded by `maxmemory` needs an eviction policy (such as allkeys-lru): under
the default, noeviction, a full server refuses every store."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from kvpool.cache.tiers import PageKey, Tier, is_page_key, namespace_tag, page_record
from kvpool.errors import KVPoolError
from kvpool.numeric import check_int64, check_seconds

KEY_PREFIX = "kvpool:page"
UNBOUNDED = 2**62  # capacity_pages when Redis's own maxmemory is the only bound


class RedisUnavailable(KVPoolError, ConnectionError):
    """Redis failed recently; the tier does not try again before its retry interval."""


class RedisTier(Tier):
    """Pages in the Redis server at `url` (redis://host:port/db). `capacity_bytes`: this
    tier's share of the server, beyond which it deletes the least recently used pages it
    stored; `len` and iteration count the pages it stored and has not seen go (a page whose
    deletion failed stays counted, deleted at a later eviction). None: the server's
    `maxmemory` policy bounds the pages, unseen by the tier, which then keeps no index of them
    (`len` 0). `namespace` prefixes the keys, to separate deployments on one server.
    `timeout`: seconds per call; it and `retry_interval` lie in (0, a year]. `get` finds any
    engine's pages. `put` raises redis.RedisError (or RedisUnavailable) when Redis fails."""

    def __init__(self, url: str, capacity_bytes: int | None = None, namespace: str | None = None,
                 *, timeout: float = 0.25, retry_interval: float = 1.0):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError("RedisTier needs the redis client: pip install 'kvpool[redis]'") \
                from None
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__} {url!r}")
        if capacity_bytes is not None:
            check_int64("capacity_bytes", capacity_bytes, 1)
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
        timeout = check_seconds("timeout", timeout)
        retry_interval = check_seconds("retry_interval", retry_interval)
        super().__init__(UNBOUNDED)
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        except ValueError as e:
            raise ValueError(f"bad Redis URL {url!r}: {e}") from None
        if self.client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(f"Redis URL {url!r} asks for decode_responses: pages are bytes, "
                             f"never text")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.prefix = KEY_PREFIX if namespace is None else f"{KEY_PREFIX}:{namespace}"
        self.retry_interval = retry_interval
        self.num_errors = 0  # calls to Redis that failed (refused, timed out, server error)
        self._redis_error = redis.RedisError
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self._tag = ""  # the bound namespace, hashed into every key
        self._retry_at = 0.0  # monotonic time before which Redis is not called

    def redis_key(self, key: PageKey) -> str:
        """The Redis key of the page stored under `key`."""
        return f"{self.prefix}:{self._tag}:{key.chain_key.hex()}"

    def put(self, key: PageKey, data: torch.Tensor) -> None:
        """`Tier.put`; without `capacity_bytes`, the page is written and nothing indexed."""
        if self.capacity_bytes is not None:
            super().put(key, data)
            return
        self._check_put(key, data)
        self._write(key, data)
        self._counts.num_stored += 1

    def get(self, key: PageKey) -> torch.Tensor | None:
        """A copy of the page another engine or this one stored under `key`, or None (a miss:
        never stored, evicted by Redis, unreadable, Redis unavailable, or `key` not a
        PageKey). Never raises."""
        if not is_page_key(key):
            self._counts.num_misses += 1
            return None
        try:
            data = self._read(key)
        except (self._redis_error, ConnectionError):
            data = None  # unanswered: the page may still be there, and stays indexed
        else:
            if data is None:
                self._keys.pop(key.chain_key, None)  # gone, or damaged and deleted
        if data is None:
            self._counts.num_misses += 1
            return None
        if key.chain_key in self._keys:
            self._keys.move_to_end(key.chain_key)
        self._counts.num_hits += 1
        return data

    def __contains__(self, key: PageKey) -> bool:
        """Whether the server holds a readable page for exactly this prefix (a value that
        fails its checks is deleted and counted, as on load); False for a key that is not a
        PageKey."""
        if not is_page_key(key):
            return False
        try:
            return self._read(key) is not None
        except (self._redis_error, ConnectionError):
            return False

    def _open(self, namespace: str, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._tag = namespace_tag(namespace)
        if self.capacity_bytes is not None:
            page_bytes = math.prod(page_shape) * dtype.itemsize
            if self.capacity_bytes < page_bytes:
                raise ValueError(f"capacity_bytes {self.capacity_bytes:,} holds no page of "
                                 f"{page_bytes:,} bytes")
            self.capacity_pages = self.capacity_bytes // page_bytes

    def _write(self, key: PageKey, data: torch.Tensor) -> None:
        self._call("set", self.redis_key(key), page_record(self.namespace, key, data))

    def _read(self, key: PageKey) -> torch.Tensor | None:
        """The page stored under `key`; None if Redis holds none or a damaged one (deleted if
        Redis answers: one left behind Redis evicts in time). Raises when Redis fails."""
        record = self._call("get", self.redis_key(key))
        if record is None:
            return None
        data = self._page_of(record, key)
        if data is None:
            with contextlib.suppress(self._redis_error, ConnectionError):
                self._discard(key)
        return data

    def _discard(self, key: PageKey) -> None:
        self._call("delete", self.redis_key(key))

    def _call(self, command: str, *args):
        """One Redis command; raises RedisUnavailable without calling while Redis is backing
        off after it could not be reached, and starts the back-off when it cannot be (an
        error Redis answers, such as a full server refusing a write, starts none)."""
        if time.monotonic() < self._retry_at:
            raise RedisUnavailable(f"Redis at {self.url} failed less than "
                                   f"{self.retry_interval} s ago")
        try:
            return getattr(self.client, command)(*args)
        except self._redis_error as e:
            self.num_errors += 1
            if isinstance(e, self._unreachable):
                self._retry_at = time.monotonic() + self.retry_interval
            raise
