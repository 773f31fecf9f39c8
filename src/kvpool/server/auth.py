"""API keys: a request to the server must carry one of them as `Authorization: Bearer KEY`,
or it is refused with 401 (an OpenAI error body). Keys are compared in constant time. The
paths in `open_paths` (/health and /metrics unless the server closes them) need no key.

The key a request carried is kept in its scope's state (`api_key`), for prefix isolation
per key: `key_salt` turns it into a cache salt that names the key without holding it.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics"})


def check_keys(keys: tuple[str, ...]) -> None:
    """ValueError unless `keys` are one or more non-empty strings without whitespace or
    control characters (HTTP strips the whitespace around a header's value: a key ending in
    a space could never match). The bad one is named by its position (a key is a secret)."""
    if not keys:
        raise ValueError("api keys: none given")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            shown = "empty" if key == "" else f"a {type(key).__name__}"
            raise ValueError(f"api keys must be non-empty strings; key {i + 1} of "
                             f"{len(keys)} is {shown}")
        bad = next((c for c in key if c.isspace() or not c.isprintable()), None)
        if bad is not None:
            raise ValueError(f"api keys must hold no whitespace or control characters; key "
                             f"{i + 1} of {len(keys)} holds U+{ord(bad):04X}")


class ApiKeyMiddleware:
    """ASGI middleware refusing HTTP requests that carry none of `keys` (401)."""

    def __init__(self, app: ASGIApp, *, keys: tuple[str, ...],
                 open_paths: frozenset[str] = OPEN_PATHS):
        check_keys(keys)
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        key = self.key_of(scope)
        if key is None:
            await _unauthorized(send)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)

    def key_of(self, scope: Scope) -> str | None:
        """The configured key the request carries, or None. Every key is compared, each in
        constant time, so the time taken tells nothing of which one nearly matched."""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key):
                found = key
        return None if found is None or not given else found.decode()


def key_salt(api_key: str) -> str:
    """The cache salt of an API key: its SHA-256, so neither the engine nor the prefix
    cache ever holds the key."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()


async def _unauthorized(send: Send) -> None:
    body = json.dumps({"error": {
        "message": "a valid API key is required: send it as 'Authorization: Bearer KEY'",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
