"""The HTTP application: OpenAI-compatible routes over one EngineLoop.

POST /v1/completions and /v1/chat/completions (whole or streamed as server-sent events),
GET /v1/models, /health and /metrics. Every refusal is an OpenAI error body (JSON): 400 for
a bad request (naming the field and the numbers), 401 without a valid API key (when the
server has keys), 404/405 for an unknown route, 408 and 413 for a body too slow or too
large (see limits.py), 503 with Retry-After when the waiting queue is full or the server is
stopping, 503 without it once the engine process has exited or its engine can serve no more
(a DisaggregatedLLM's prefill side is gone: /health then answers 503 too), 500 when the engine
failed while running the request.

With `prefix_isolation="per-key"`, each API key is a cache salt of its own (combined with
a request's `cache_salt`), so clients of different keys never share cached prefix pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import abc

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvpool.engine import LLM, DisaggregatedLLM
from kvpool.errors import EngineDied, InvalidPrompt, KVPoolError, OutOfPages, SequenceTooLong
from kvpool.server.auth import OPEN_PATHS, ApiKeyMiddleware, check_keys, key_salt
from kvpool.server.chat import ChatTemplate
from kvpool.server.engine_loop import (
    EngineExited,
    EngineFailure,
    EngineLoop,
    EngineStopped,
    RequestStream,
    ServerBusy,
)
from kvpool.server.generation import Change, Generation, sse
from kvpool.server.limits import ServerLimits, read_json
from kvpool.server.metrics import EngineSnapshot, ServerMetrics
from kvpool.server.protocol import GenerationRequest, RequestError, parse_chat, parse_completion

RETRY_AFTER_SECONDS = 1
PREFIX_ISOLATION = ("none", "per-key")


class Server:
    """What the routes share: the engine loop, the served model's name, its chat template,
    the request limits, the prefix isolation and the metrics."""

    def __init__(self, make_llm: abc.Callable[[], LLM], *, model_name: str,
                 chat_template: ChatTemplate, max_waiting: int, limits: ServerLimits,
                 prefix_isolation: str):
        self.engine = EngineLoop(make_llm, max_waiting=max_waiting)
        self.info = self.engine.start()
        self.model_name = model_name
        self.chat_template = chat_template
        self.limits = limits
        self.prefix_isolation = prefix_isolation
        self.metrics = ServerMetrics()

    # ---- routes ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: a prompt as text or token ids."""
        parsed = parse_completion(await read_json(request, self.limits), self.model_name,
                                  self.limits)
        prompt = parsed.prompt
        if self.info.tokenizer is None and isinstance(prompt, str):
            raise RequestError("this model has no tokenizer: send the prompt as token ids",
                               param="prompt")
        if self.info.tokenizer is None and parsed.stop:  # its samples have no text to match
            raise RequestError("this model has no tokenizer, so stop strings cannot match: "
                               "use stop_token_ids", param="stop", code="unsupported")
        if isinstance(prompt, str):
            # off the event loop: a long text takes seconds, and every client would wait
            prompt = await asyncio.to_thread(self.info.tokenizer.encode, prompt,
                                             add_special_tokens=parsed.add_special_tokens)
        return await self._generate(request, parsed, prompt, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions: messages rendered by the chat template."""
        parsed = parse_chat(await read_json(request, self.limits), self.model_name,
                            self.limits)
        if self.info.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot chat",
                               param="messages")
        prompt = await asyncio.to_thread(self._chat_prompt, parsed)  # as above
        return await self._generate(request, parsed, prompt, chat=True)

    def _chat_prompt(self, parsed: GenerationRequest) -> list[int]:
        """The token ids of the chat's messages rendered by the chat template, with the
        tokenizer's special tokens where the request or else the template asks for them."""
        add = parsed.add_special_tokens
        return self.info.tokenizer.encode(
            self.chat_template.render(parsed.messages),
            add_special_tokens=self.chat_template.add_special_tokens if add is None else add)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one served model, with its context and vocabulary sizes."""
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kvpool",
            "max_model_len": self.info.max_model_len,
            "vocab_size": self.info.vocab_size}]})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 while the server and its engine run, 503 once the engine process
        has exited (a supervisor should restart the server). A DisaggregatedLLM whose
        prefill side is gone ends its engine process once a request sees it."""
        if not self.engine.alive:
            return _error(_exited(EngineExited("the engine process has exited")))
        return Response(status_code=200)

    async def metrics_text(self, request: Request) -> Response:
        """GET /metrics: Prometheus text, the engine read between two steps."""
        try:
            snapshots = await self.engine.call(_snapshot)
        except (EngineExited, EngineDied) as e:  # EngineDied: the engine process then ends
            return _error(_exited(e))
        return Response(self.metrics.render(snapshots),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation --------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        """One token's text, as log-probabilities name it ("token_id:N" with no tokenizer)."""
        if self.info.tokenizer is None:
            return f"token_id:{token_id}"
        return self.info.tokenizer.decode([token_id])

    async def _generate(self, request: Request, parsed: GenerationRequest, prompt: list[int], *,
                        chat: bool) -> Response:
        """Run one request: a JSON response when it ends, or a stream of its events."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if parsed.n > self.info.max_num_seqs:  # it could never run: a retry will not help
            raise RequestError(f"n={parsed.n} samples exceed max_num_seqs "
                               f"{self.info.max_num_seqs}", param="n")
        max_tokens = parsed.max_tokens
        if max_tokens is None:  # the room one sequence has left
            max_tokens = self.info.max_sequence_tokens - len(prompt)
            if max_tokens < 1:
                raise _too_long(f"prompt of {len(prompt)} tokens leaves no room for a "
                                f"completion: a sequence holds at most "
                                f"{self.info.max_sequence_tokens} tokens", parsed)
        arrival = time.perf_counter()
        stream = await self._add(request_id, prompt, parsed, max_tokens,
                                 self._cache_salt(request, parsed))
        generation = Generation(request_id, self.model_name, num_prompt_tokens=len(prompt),
                                n=parsed.n, stop=parsed.stop, chat=chat,
                                include_usage=parsed.include_usage, logprobs=parsed.logprobs,
                                token_text=self._token_text, tokenizer=self.info.tokenizer,
                                context=prompt[-1])
        events = self._events(stream, generation, arrival)
        if parsed.stream:
            return StreamingResponse(self._sse(generation, events),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(self._abort_on_disconnect(request, request_id))
        try:
            async for _ in events:  # each event updates `generation`; answer once they end
                pass
        except EngineFailure as e:
            return _error(_failure(e))
        finally:
            watcher.cancel()
        return _json(generation.response())

    def _cache_salt(self, request: Request, parsed: GenerationRequest) -> str | None:
        """The request's cache salt: its `cache_salt`, under its API key's salt when
        prefixes are isolated per key."""
        if self.prefix_isolation != "per-key":
            return parsed.cache_salt
        salt = key_salt(request.scope["state"]["api_key"])
        return salt if parsed.cache_salt is None else f"{salt}/{parsed.cache_salt}"

    async def _abort_on_disconnect(self, request: Request, request_id: str) -> None:
        """Abort the request when its client disconnects. A non-streamed request has
        nothing to write until it ends, so only the connection can tell that the client
        left: the server reads it for the disconnect message (the body is read already)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(request_id)

    async def _add(self, request_id: str, prompt: list[int], parsed: GenerationRequest,
                   max_tokens: int, cache_salt: str | None) -> RequestStream:
        """Hand the request to the engine; its refusals become RequestErrors."""
        try:
            return await self.engine.add(request_id, prompt, parsed.sampling_params(max_tokens),
                                         cache_salt)
        except asyncio.CancelledError:  # the client left while the engine took it
            self.engine.abort(request_id)
            raise
        except (EngineExited, EngineDied) as e:  # EngineDied: the engine process then ends
            raise _exited(e) from None
        except ServerBusy as e:
            raise RequestError(str(e), status=503, type="server_busy",
                               code="server_busy") from None
        except EngineStopped as e:
            raise RequestError(str(e), status=503, type="server_busy",
                               code="server_shutting_down") from None
        except InvalidPrompt as e:
            raise RequestError(str(e), param="prompt") from None
        except SequenceTooLong as e:
            raise _too_long(e, parsed) from None
        except OutOfPages as e:
            if len(prompt) >= self.info.max_sequence_tokens:  # the pool never holds the prompt
                raise _too_long(e, parsed) from None
            raise RequestError(str(e), param="n" if parsed.n > 1 else "max_tokens") from None
        except (KVPoolError, ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

    async def _events(self, stream: RequestStream, generation: Generation,
                      arrival: float) -> abc.AsyncIterator[list[Change]]:
        """The changes of the generation's choices as updates arrive, until every choice
        has ended. However it ends (done, failed, or the reader went away), the engine
        holds nothing of the request afterwards, and a finished request is counted."""
        finished, failed = False, False
        try:
            while not generation.done:
                update = await stream.get()
                finished = update.finished
                changes = generation.update(update)
                if changes:
                    yield changes
        except EngineFailure:
            failed = True
            raise
        finally:
            if not finished:
                self.engine.abort(stream.request_id)
            reason = generation.choices[0].finish_reason or ("error" if failed else "abort")
            self.metrics.record(generation.times(arrival, time.perf_counter()), reason,
                                generation.num_prompt_tokens, generation.num_completion_tokens)

    async def _sse(self, generation: Generation,
                   events: abc.AsyncIterator) -> abc.AsyncIterator[bytes]:
        """The server-sent events of a streamed generation (closing `events` if the client
        disconnects, which aborts the request). The events of one update go out in one
        write: each write is a system call and a trip through Starlette and uvicorn."""
        async with contextlib.aclosing(events):
            if generation.chat:
                yield b"".join(generation.role_chunks())
            try:
                async for changes in events:
                    yield b"".join(generation.chunks(changes))
            except EngineFailure as e:
                yield sse(_failure(e).body())
            yield b"".join(generation.final_chunks())


def check_access(api_keys: tuple[str, ...], prefix_isolation: str) -> None:
    """ValueError unless the keys and the prefix isolation are ones `build_app` serves
    (checked there before the engine starts: Starlette builds its middleware at the first
    request)."""
    if prefix_isolation not in PREFIX_ISOLATION:
        raise ValueError(f"prefix_isolation must be one of {PREFIX_ISOLATION}, "
                         f"got {prefix_isolation!r}")
    if prefix_isolation == "per-key" and not api_keys:
        raise ValueError("prefix isolation per key needs API keys")
    if api_keys:
        check_keys(tuple(api_keys))


def build_app(make_llm: abc.Callable[[], LLM], *, model_name: str,
              chat_template: ChatTemplate | None = None, max_waiting: int = 1024,
              limits: ServerLimits | None = None, api_keys: tuple[str, ...] = (),
              open_paths: frozenset[str] = OPEN_PATHS,
              prefix_isolation: str = "none") -> Starlette:
    """The ASGI app serving the LLM that `make_llm()` builds, as `model_name`. The engine
    process starts here, builds the LLM (raising what that raises) and waits; the app's
    lifespan connects it to the event loop, and stops it (aborting what runs) when the app
    shuts down. `make_llm` must pickle, e.g. functools.partial(LLM, "tiny", num_pages=64).
    With `api_keys`, every path but `open_paths` needs one; `prefix_isolation` "per-key"
    (which needs keys) salts the prefix cache by key. `app.state.server` is the Server."""
    check_access(api_keys, prefix_isolation)
    middleware = [Middleware(ApiKeyMiddleware, keys=tuple(api_keys), open_paths=open_paths)] \
        if api_keys else []
    server = Server(make_llm, model_name=model_name,
                    chat_template=chat_template or ChatTemplate.for_model(model_name),
                    max_waiting=max_waiting, limits=limits or ServerLimits(),
                    prefix_isolation=prefix_isolation)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.engine.attach()
        yield
        await server.engine.stop()

    app = Starlette(routes=[
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
    ], middleware=middleware, exception_handlers={
        RequestError: lambda request, e: _error(e),
        HTTPException: lambda request, e: _error(RequestError(
            e.detail, status=e.status_code, type="not_found" if e.status_code == 404
            else "invalid_request_error"), e.headers),  # a 405's Allow
        Exception: lambda request, e: _error(RequestError(
            f"internal error: {type(e).__name__}", status=500, type="internal_error")),
    }, lifespan=lifespan)
    app.state.server = server
    return app


def _snapshot(llm: LLM | DisaggregatedLLM) -> list[EngineSnapshot]:
    """The engine's counters now (run in the engine process); a disaggregated pair's, one
    snapshot per side."""
    return [EngineSnapshot(stats, side) for side, stats in llm.stats_by_side().items()]


def _failure(e: EngineFailure) -> RequestError:
    """The error of a request the engine failed (500), or the stopping server ended (503)."""
    if e.status == 503:
        return RequestError(str(e), status=503, type="server_busy", code="server_shutting_down")
    return RequestError(str(e), status=500, type="internal_error")


def _too_long(why: Exception | str, parsed: GenerationRequest) -> RequestError:
    """The error of a prompt longer than the server's context (max_model_len or the pool)."""
    return RequestError(str(why), param="messages" if parsed.messages else "prompt",
                        code="context_length_exceeded")


def _exited(e: EngineExited | EngineDied) -> RequestError:
    """The error of a request to a server whose engine has exited (or is gone, and exits):
    no retry will help."""
    return RequestError(str(e), status=503, type="server_error", code="engine_exited")


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response; non-ASCII characters escaped, so that any text, even a lone
    surrogate that a client sent, encodes."""
    return Response(json.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


def _error(error: RequestError, headers: dict | None = None) -> Response:
    if error.status == 503 and error.code != "engine_exited":
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return _json(error.body(), error.status, headers)
