"""The flags that choose how `kvpool bench`, `generate`, `chat` and `serve` run each step:
--no-overlap (LLM's overlap=False) and --enforce-eager (no CUDA graphs)."""

from __future__ import annotations

import argparse


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """--no-overlap and --enforce-eager."""
    parser.add_argument("--no-overlap", action="store_true",
                        help="finish each step before scheduling the next (overlap scheduling "
                             "is on by default on CUDA, off on the CPU)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly, without capturing CUDA graphs (they are "
                             "captured by default on CUDA)")


def step_options(args: argparse.Namespace) -> dict:
    """LLM's keyword arguments for the flags: overlap (None: the engine's default) and
    enforce_eager."""
    return {"overlap": False if args.no_overlap else None, "enforce_eager": args.enforce_eager}
