"""Decode attention: paged_attention on shuffled pages vs SDPA on the same K/V stored contiguously.

Run: python benchmarks/attention.py  (prints one table; about a minute on 2 CPU cores)

paged_attention runs two ways: "kernel" is the fused CPU decode kernel (backend "cpu",
kvpool/kernels, which reads K/V in place), "torch" the torch path (backend "torch": gather
pages, then SDPA).

Batch 32, 32 query heads, 8 KV heads, head_dim 128, page size 16, one query token per sequence.
The contiguous baseline is torch's scaled_dot_product_attention on [batch, kv_heads, context,
head_dim] tensors, in whichever of two GQA forms is faster on this machine: `enable_gqa=True`, or
the query viewed as [batch, kv_heads, group, head_dim] (no K/V expansion either way). "copy" is
`dst.copy_(src)` of a tensor with as many bytes as the K/V read: the memory-bandwidth ceiling.
Times are medians; "ratio" is kernel / contiguous; "min ratio" compares the fastest runs, which
shows less of other processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvpool.attention import paged_attention
from kvpool.kernels import cpu as cpu_kernel

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 32, 8, 128, 16
CONTEXTS = (1024, 4096)
DTYPES = (torch.float32, torch.bfloat16)


def time_ms(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median and fastest wall time (ms) of each callable, run interleaved so that changes in
    machine load hit all of them alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return (
        {name: statistics.median(ts) for name, ts in times.items()},
        {name: min(ts) for name, ts in times.items()},
    )


def make_case(context: int, dtype: torch.dtype) -> dict:
    """Callables for one (context, dtype): paged (kernel and torch path), both contiguous SDPA
    forms, and the copy."""
    pages_per_seq = context // PAGE_SIZE
    num_pages = BATCH * pages_per_seq
    k_cache = torch.randn(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    page_tables = torch.randperm(num_pages).view(BATCH, pages_per_seq).int()
    seq_lens = torch.full((BATCH,), context, dtype=torch.int32)
    cu_seqlens_q = torch.arange(BATCH + 1, dtype=torch.int32)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, dtype=dtype)

    def contiguous(cache):
        tokens = cache[page_tables.long()].view(BATCH, context, KV_HEADS, HEAD_DIM)
        return tokens.transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q_heads = q.view(BATCH, HEADS, 1, HEAD_DIM)
    q_grouped = q.view(BATCH, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    src = torch.randn(2 * k.numel(), dtype=dtype)
    dst = torch.empty_like(src)

    def paged(backend: str):
        return lambda: paged_attention(
            q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q, backend=backend
        )

    return {
        "kernel": paged("cpu"),
        "torch": paged("torch"),
        "sdpa grouped q": lambda: F.scaled_dot_product_attention(q_grouped, k, v),
        "sdpa enable_gqa": lambda: F.scaled_dot_product_attention(q_heads, k, v, enable_gqa=True),
        "copy": lambda: dst.copy_(src),
    }


def row(dtype: torch.dtype, context: int, ms: dict, fastest: dict) -> str:
    """One table line: times (ms), kernel/contiguous ratio, and K/V bytes read per second (GB/s)."""
    forms = ("sdpa grouped q", "sdpa enable_gqa")
    baseline, other = sorted(forms, key=ms.__getitem__)
    kv_bytes = 2 * BATCH * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    gbps = {name: kv_bytes / (t * 1e6) for name, t in ms.items()}
    return (
        f"{str(dtype).removeprefix('torch.'):>9} {context:>7} {ms['kernel']:>9.1f} "
        f"{ms['torch']:>8.1f} {ms[baseline]:>9.1f} {ms['kernel'] / ms[baseline]:>6.2f} "
        f"{gbps['kernel']:>11.1f} {gbps[baseline]:>11.1f} {gbps['copy']:>9.1f} "
        f"{fastest['kernel'] / fastest[baseline]:>9.2f}  {baseline} ({other}: {ms[other]:.1f} ms)"
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    kernel = "fused kernel" if cpu_kernel.library() is not None else "NO KERNEL: torch path twice"
    print(
        f"decode attention, batch {BATCH}, heads {HEADS}/{KV_HEADS} kv, head_dim {HEAD_DIM}, "
        f"page_size {PAGE_SIZE}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{kernel}; load average "
        f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.1f} "
        "(other processes on these cores slow both sides); median ms"
    )
    header = (
        f"{'dtype':>9} {'context':>7} {'kernel ms':>9} {'torch ms':>8} {'contig ms':>9} "
        f"{'ratio':>6} {'kernel GB/s':>11} {'contig GB/s':>11} {'copy GB/s':>9} {'min ratio':>9}  "
        "contiguous baseline"
    )
    print(header)
    print("-" * len(header))
    for dtype in DTYPES:
        for context in CONTEXTS:
            case = make_case(context, dtype)
            print(row(dtype, context, *time_ms(case, repeats=9 if context <= 1024 else 7)))
            del case  # free this case's ~GiB of K/V before building the next


if __name__ == "__main__":
    main()
