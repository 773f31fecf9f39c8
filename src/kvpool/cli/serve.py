"""`kvpool serve`: its arguments, and running the app under uvicorn until SIGTERM/SIGINT.

On a signal the server stops accepting connections, lets the requests in flight finish
for up to `--shutdown-timeout` seconds, ends the rest (a stream with an error event and
`[DONE]`, a whole request with a JSON 503), then the engine process stops; the command
exits 0.

The API keys come from `--api-key` (repeatable) or, without it, KVPOOL_API_KEY (keys
separated by commas), the whitespace around each one stripped; with none the server is open
to whoever reaches its port.

uvicorn runs on uvloop and parses HTTP with httptools where they are installed (the server
extra brings both): they take less of the cores the server shares with the engine than
asyncio's loop and h11. Without them it falls back to those.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import sys

from kvpool.cli.kv_flags import add_kv_arguments, kv_options
from kvpool.cli.parallel_flag import add_tensor_parallel_argument
from kvpool.cli.step_flags import add_step_arguments, step_options
from kvpool.cli.tier_flags import add_tier_arguments, byte_size, tier_options
from kvpool.formats import DTYPES
from kvpool.server import INSTALL_HINT, missing_modules

DEFAULT_MAX_WAITING = 1024
API_KEY_ENV = "KVPOOL_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# The defaults of ServerLimits (limits.py imports starlette, which may be missing here).
DEFAULT_MAX_BODY = "16MiB"
DEFAULT_MAX_STOP_STRINGS = 16
DEFAULT_MAX_STOP_LENGTH = 256
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool serve`."""
    parser.add_argument("--model", default="tiny", metavar="PATH",
                        help="checkpoint folder or 'tiny' (default: tiny); also the model "
                             "name clients send")
    parser.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--page-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per page (default: 16)")
    parser.add_argument("--num-pages", type=int, metavar="PAGES",
                        help="pool size (default: planned from the memory)")
    parser.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                        help="KV cache budget on the CPU, e.g. 4GiB (default: the engine's)")
    parser.add_argument("--max-num-seqs", type=int, metavar="N",
                        help="running sequences at most (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS",
                        help="tokens per forward at most (default: the engine's)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn the prefix cache off")
    add_tier_arguments(parser)
    add_tensor_parallel_argument(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights and KV dtype "
                                                        "(default: the checkpoint's)")
    add_kv_arguments(parser)
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds requests that bring no seed (default: 0)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="prefill on a second engine in its own process, which hands "
                             "each prompt's KV to the decode engine (kvpool.engine."
                             "disaggregated); each engine gets these options, the tier flags "
                             "go to the prefill engine")
    add_step_arguments(parser)
    parser.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                        help=f"sequences that may wait for a seat; beyond, 503 with "
                             f"Retry-After (default: {DEFAULT_MAX_WAITING})")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long requests in flight may finish "
                             "before they are ended with an error (default: 5)")
    parser.add_argument("--max-body-size", type=byte_size, default=DEFAULT_MAX_BODY,
                        metavar="SIZE", help=f"largest request body; beyond, 413 "
                                             f"(default: {DEFAULT_MAX_BODY})")
    parser.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        metavar="N", help=f"stop strings per request at most "
                                          f"(default: {DEFAULT_MAX_STOP_STRINGS})")
    parser.add_argument("--max-stop-length", type=int, default=DEFAULT_MAX_STOP_LENGTH,
                        metavar="CHARS", help=f"characters per stop string at most "
                                              f"(default: {DEFAULT_MAX_STOP_LENGTH})")
    parser.add_argument("--max-stop-token-ids", type=int, default=DEFAULT_MAX_STOP_TOKEN_IDS,
                        metavar="N", help=f"stop token ids per request at most "
                                          f"(default: {DEFAULT_MAX_STOP_TOKEN_IDS})")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                        metavar="SECONDS", help=f"a connection whose request headers take "
                                                f"longer is closed "
                                                f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                        metavar="SECONDS", help=f"a request body that takes longer gets 408 "
                                                f"(default: {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("--api-key", action="append", metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' (repeat for more keys; "
                             f"default: ${API_KEY_ENV}, comma-separated, else no key)")
    parser.add_argument("--auth-all-routes", action="store_true",
                        help="require the key on /health and /metrics too")
    parser.add_argument("--prefix-isolation", choices=("none", "per-key"), default="none",
                        help="per-key: requests of different API keys never share cached "
                             "prefix pages (default: none; a request's cache_salt isolates "
                             "it either way)")


def api_keys(flag_values: list[str] | None) -> tuple[str, ...]:
    """The keys of `--api-key`, or else of KVPOOL_API_KEY (comma-separated, empty pieces
    dropped), each without the whitespace around it ("a, b"; a key read from a file ends
    with a newline); () for none. ValueError for a variable of commas and whitespace alone:
    meant to hold keys, it would leave the server open."""
    if flag_values:
        return tuple(k.strip() for k in flag_values)
    value = os.environ.get(API_KEY_ENV, "")
    keys = tuple(k for k in (k.strip() for k in value.split(",")) if k)
    if value.strip() and not keys:
        raise ValueError(f"{API_KEY_ENV} holds no key, only commas and whitespace; unset it "
                         f"to serve without one")
    return keys


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; 2 when the server extra is not installed."""
    missing = missing_modules()
    if missing:
        print(f"kvpool serve: error: needs {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from kvpool.engine import LLM, DisaggregatedLLM
    from kvpool.server.engine_loop import forkserver_ended

    options = {"num_pages": args.num_pages, "kv_cache_memory": args.kv_cache_memory,
               "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens,
               "dtype": DTYPES.get(args.dtype),
               "device": args.device, **step_options(args)}
    options = {"page_size": args.page_size, "prefix_caching": not args.no_prefix_caching,
               "seed": args.seed, **kv_options(args),
               "tensor_parallel_size": args.tensor_parallel_size,
               **{k: v for k, v in options.items() if v is not None}}
    if args.disaggregated and args.tensor_parallel_size > 1:
        print("kvpool serve: error: --disaggregated runs each engine on one device; "
              f"--tensor-parallel-size {args.tensor_parallel_size} is not supported with it",
              file=sys.stderr)
        return 2
    if args.disaggregated:
        make_llm = functools.partial(DisaggregatedLLM, args.model,
                                     prefill={**options, **tier_options(args)}, decode=options)
    else:
        make_llm = functools.partial(LLM, args.model, **options, **tier_options(args))
    from kvpool.server.app import check_access
    from kvpool.server.limits import ServerLimits

    try:  # checked before the port is taken and the engine built: the error names the option
        limits = ServerLimits(args.max_body_size, args.max_stop_strings, args.max_stop_length,
                              args.max_stop_token_ids, args.header_timeout, args.body_timeout)
        keys = api_keys(args.api_key)
        check_access(keys, args.prefix_isolation)
    except ValueError as e:
        print(f"kvpool serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = bound_socket(args.host, args.port)
    except OSError as e:
        print(f"kvpool serve: error: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 2
    with forkserver_ended():  # the one that starts the engine processes, once they end
        return _serve(args, sock, make_llm, limits, keys)


def _serve(args: argparse.Namespace, sock: socket.socket, make_llm, limits, keys) -> int:
    """Build the app on `sock` and serve until SIGTERM or SIGINT; 2 for an invalid option."""
    from kvpool.server.app import build_app
    from kvpool.server.auth import OPEN_PATHS
    from kvpool.server.listener import DrainingServer

    try:
        app = build_app(make_llm, model_name=args.model, max_waiting=args.max_waiting,
                        limits=limits, api_keys=keys,
                        open_paths=frozenset() if args.auth_all_routes else OPEN_PATHS,
                        prefix_isolation=args.prefix_isolation)
    except ValueError as e:
        sock.close()
        print(f"kvpool serve: error: {e}", file=sys.stderr)
        return 2
    # uvicorn raises the signal that stopped it again once it has shut down; by then it is
    # handled, so these handlers let the command return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    port = sock.getsockname()[1]  # the one the system picked for --port 0
    print(f"kvpool serve: {args.model} on http://{args.host}:{port}/v1", file=sys.stderr)
    if not keys and args.host not in LOOPBACK_HOSTS:
        print(f"kvpool serve: warning: no API key; whoever reaches {args.host}:{port} "
              f"can use the server (--api-key)", file=sys.stderr)
    DrainingServer(app, host=args.host, port=args.port,
                   shutdown_timeout=args.shutdown_timeout).run(sockets=[sock])
    return 0


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port`, not yet listening (uvicorn listens once the engine
    is up): a host that does not resolve or a port in use fails here, before the engine
    starts. OSError naming the cause."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
