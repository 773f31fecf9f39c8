"""The tier flags of `kvpool bench`, `serve` and `chat`: one tier below the pool for the
prefix pages it evicts (LLM's host_tier_memory, disk_tier, redis_tier)."""

from __future__ import annotations

import argparse

from kvpool.formats import parse_bytes
from kvpool.numeric import check_int64


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """--host-tier-memory, --disk-tier (with --disk-tier-memory) and --redis-tier, at most
    one of the three."""
    group = parser.add_argument_group("tier (evicted prefix pages, loaded back on a hit)")
    tiers = group.add_mutually_exclusive_group()
    tiers.add_argument("--host-tier-memory", type=byte_size, metavar="SIZE",
                       help="keep evicted prefix pages in this much host memory (e.g. 8GiB)")
    tiers.add_argument("--disk-tier", metavar="DIR", help="keep them in files in DIR")
    tiers.add_argument("--redis-tier", metavar="URL",
                       help="keep them in the Redis server at URL (redis://host:port/db), "
                            "shared with other engines of the same model (needs "
                            "pip install 'kvpool[redis]')")
    group.add_argument("--disk-tier-memory", type=byte_size, metavar="SIZE",
                       help="the most bytes of pages --disk-tier keeps (default: 16GiB)")


def byte_size(text: str) -> int:
    """A size option such as 24GiB, in bytes: at most int64 (argparse reports the error)."""
    try:
        return check_int64("size", parse_bytes(text), 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tier_options(args: argparse.Namespace) -> dict[str, object]:
    """LLM keyword options of the tier flags in `args` (none for flags not given);
    ValueError for --disk-tier-memory without --disk-tier."""
    if args.disk_tier_memory is not None and args.disk_tier is None:
        raise ValueError("--disk-tier-memory needs --disk-tier: it bounds that tier's files")
    names = ("host_tier_memory", "disk_tier", "disk_tier_memory", "redis_tier")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
