"""The flags that choose the KV pages' dtype: --kv-cache-dtype (`kvpool plan` too) and
--kv-scales, of `kvpool bench`, `generate`, `chat` and `serve` (LLM's kv_cache_dtype and
kv_scales)."""

from __future__ import annotations

import argparse

from kvpool.memory.fp8 import KV_CACHE_DTYPES


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype."""
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV page dtype: auto (the model's) or fp8_e4m3 (float8 pages, one "
                             "byte a value, with per-layer scales from the first prefill unless "
                             "given; default: auto)")


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --kv-scales."""
    add_kv_dtype_argument(parser)
    parser.add_argument("--kv-scales", type=_scales, metavar="K,V",
                        help="fp8 pages: the K and V scale of every layer, or one number for "
                             "an MLA model's latent pages, instead of scales from the first "
                             "prefill (a tier's fp8 pages need them given)")


def kv_options(args: argparse.Namespace) -> dict[str, object]:
    """LLM's keyword arguments for the flags."""
    return {"kv_cache_dtype": args.kv_cache_dtype, "kv_scales": args.kv_scales}


def _scales(text: str) -> tuple[float, float] | float:
    """`K,V` as a pair of floats, or one float (argparse reports the error; the engine checks
    the values)."""
    try:
        scales = tuple(float(part) for part in text.split(","))
    except ValueError:
        scales = ()
    if len(scales) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected K,V (two numbers) or one number, "
                                         f"got {text!r}")
    return scales[0] if len(scales) == 1 else scales
