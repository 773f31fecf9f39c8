"""What one client may ask of the server: request body size, stop strings and stop token
ids, and how long it may take to send a request's headers and body.

A body is counted while it is read, so one over the limit is refused (413) before it is
in memory, and read against a deadline, so a client that stalls mid-body (408) does not
hold its connection and buffer. Headers are bounded the same way by the HTTP protocol
`with_header_timeout` makes: a connection whose request headers have not all arrived in
time is closed (uvicorn itself only times out idle keep-alive connections).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from kvpool.numeric import check_seconds
from kvpool.server.protocol import RequestError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Limits of one request: body bytes, stop strings (count, and characters each), stop
    token ids (count), and seconds to send the headers and, from then, the body."""

    max_body_bytes: int = 16 * MiB
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_stop_strings", "max_stop_length",
                     "max_stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("header_timeout", "body_timeout"):  # (0, a year]: a timer's range
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))


async def read_json(request: Request, limits: ServerLimits) -> object:
    """The request's body parsed as JSON: 413 past `max_body_bytes` (by Content-Length at
    once, else as soon as the bytes read pass it), 408 when it takes longer than
    `body_timeout`, 400 when it is not JSON (too deep to parse included)."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), limits.body_timeout)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        raise RequestError(f"the request body did not arrive within {limits.body_timeout:g} s",
                           status=408, code="request_timeout") from None
    except ClientDisconnect:
        raise RequestError("the client closed the connection mid-body") from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply to parse") from None


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(f"the request body of {size} bytes or more passes the limit of "
                        f"{limit} bytes", status=413, code="request_too_large")


def with_header_timeout(protocol: type[asyncio.Protocol], seconds: float) -> type:
    """A subclass of uvicorn's HTTP protocol class `protocol` (h11 or httptools) that closes
    a connection whose next request's headers have not all arrived `seconds` after it
    opened or after the response before. Both classes set `cycle` when a request's headers
    are complete and call `on_response_complete` when its response is sent."""

    class HeaderTimeoutProtocol(protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and \
                    not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = (
        f"HeaderTimeout{protocol.__name__}")
    return HeaderTimeoutProtocol
