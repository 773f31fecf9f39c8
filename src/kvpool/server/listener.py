"""The uvicorn server that runs the app: its HTTP protocol times out slow request headers,
and its shutdown drains the engine.

On shutdown (SIGTERM, SIGINT) it stops taking connections, lets the requests in flight
finish for up to `shutdown_timeout` seconds, then ends the rest as the app answers a
stopping engine: a stream gets an error event and `[DONE]`, a whole request a JSON 503.
Only then does uvicorn close the connections and run the app's lifespan shutdown (which
stops the engine process), so no handler is cancelled mid-response. The engine stops between
two steps: a process still in its step STOP_SECONDS later (a step that never returns) is
terminated, then killed (EngineLoop.stop), so that shutdown always ends.
"""

from __future__ import annotations

import socket

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvpool.server.limits import with_header_timeout

# What uvicorn may still take, after the drain, to write the last responses.
FINISH_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server for an app of `build_app`, draining its engine on shutdown."""

    def __init__(self, app: Starlette, *, host: str = "127.0.0.1", port: int = 8000,
                 shutdown_timeout: float = 5.0, log_level: str = "warning"):
        limits = app.state.server.limits
        super().__init__(uvicorn.Config(
            app, host=host, port=port, log_level=log_level,
            http=with_header_timeout(AutoHTTPProtocol, limits.header_timeout),
            timeout_graceful_shutdown=FINISH_SECONDS))
        self.served_app = app
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        await self.served_app.state.server.engine.drain(self.shutdown_timeout)
        await super().shutdown(sockets)
