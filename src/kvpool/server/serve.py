"""`kvpool serve`: its arguments, and running the app under uvicorn until SIGTERM/SIGINT.

On a signal uvicorn stops accepting connections, lets the requests in flight finish for up
to `--shutdown-timeout` seconds, cancels the rest (their requests are aborted), then the
engine process stops; the command exits 0.

uvicorn runs on uvloop and parses HTTP with httptools where they are installed (the server
extra brings both): they take less of the cores the server shares with the engine than
asyncio's loop and h11. Without them it falls back to those.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys

from kvpool.formats import DTYPES, parse_bytes
from kvpool.fp8 import KV_CACHE_DTYPES
from kvpool.server import INSTALL_HINT, missing_modules

DEFAULT_MAX_WAITING = 1024


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
    parser.add_argument("--kv-cache-memory", type=parse_bytes, metavar="SIZE",
                        help="KV cache budget on the CPU, e.g. 4GiB (default: the engine's)")
    parser.add_argument("--max-num-seqs", type=int, metavar="N",
                        help="running sequences at most (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS",
                        help="tokens per forward at most (default: the engine's)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn the prefix cache off")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights and KV dtype "
                                                        "(default: the checkpoint's)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV page dtype: auto (the model's) or fp8_e4m3 (float8 pages with "
                             "per-layer scales from the first prefill; default: auto)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds requests that bring no seed (default: 0)")
    parser.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                        help=f"sequences that may wait for a seat; beyond, 503 with "
                             f"Retry-After (default: {DEFAULT_MAX_WAITING})")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long requests in flight may finish "
                             "before they are aborted (default: 5)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; 2 when the server extra is not installed."""
    missing = missing_modules()
    if missing:
        print(f"kvpool serve: needs {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    import uvicorn

    from kvpool.engine import LLM
    from kvpool.server.app import build_app

    options = {"num_pages": args.num_pages, "kv_cache_memory": args.kv_cache_memory,
               "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens,
               "dtype": DTYPES.get(args.dtype),
               "device": args.device}
    make_llm = functools.partial(
        LLM, args.model, page_size=args.page_size, prefix_caching=not args.no_prefix_caching,
        seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
        **{k: v for k, v in options.items() if v is not None})
    app = build_app(make_llm, model_name=args.model, max_waiting=args.max_waiting)
    # uvicorn raises the signal that stopped it again once it has shut down; by then it is
    # handled, so these handlers let the command return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    print(f"kvpool serve: {args.model} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
