"""kvpool on a CUDA GPU: paged attention for every backend against SDPA on the same K/V stored
contiguously, then the engine against transformers (benchmarks/gpu_engine.py).

Run: python benchmarks/gpu.py  (prints one line and stops when there is no CUDA device)

Decode: 32 query heads / 8 KV heads, head_dim 128, bfloat16, page size 16, pages shuffled, one
query token per sequence; the baseline is torch's scaled_dot_product_attention on
[batch, heads, context, head_dim] K/V (enable_gqa). GB/s counts the K/V bytes read once.
Prefill: whole prompts packed back to back against SDPA (is_causal) over the same tokens, one
call per sequence. Times are medians of CUDA-event timings of bursts of calls (`time_ms`), so
that no call waits for the host to launch it; "ratio" is paged / SDPA, against the targets of
issue 26 (decode <= 1.1x at every shape, prefill <= 1.2x at 4 x 2,048), with the tile the
triton backend chose for each shape (context splits, tokens or query rows per step, warps).
The engine section runs the workload of benchmarks/gpu_engine.py (its docstring says which).
`main()` runs each section in turn: a section is a function that prints its own table.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from gpu_engine import run_engine_benchmark
from kvpool.attention import paged_attention
from kvpool.kernels import triton_support

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DECODE_TARGET, PREFILL_TARGET = 1.1, 1.2  # paged / SDPA at most (prefill: at 4 x 2,048)
DECODE_CASES = ((64, 1024), (64, 4096), (256, 1024), (32, 16384))  # (batch, context tokens)
PREFILL_CASES = ((4, 2048), (16, 512))  # (prompts, tokens each)


def time_ms(fn, repeats: int = 20, burst: int = 10) -> float:
    """Median GPU milliseconds per call of `fn`, after warm-up (compilation included): each of
    `repeats` timings spans `burst` calls back to back, so that the device never waits for the
    host to launch the next call (as when the engine replays a CUDA graph)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / burst)
    return statistics.median(times)


def backends() -> list[str]:
    """The paged_attention backends that run on CUDA here."""
    return ["triton", "torch"] if triton_support.triton_installed() else ["torch"]


def paged_inputs(lengths: list[int], q_lens: list[int]):
    """Shuffled pages holding K/V for sequences of `lengths` tokens, and the packed queries of
    their last `q_lens` tokens: (q, k_cache, v_cache, page_tables, seq_lens, cu_seqlens_q)."""
    pages_each = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_each)
    k_cache = torch.randn(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device="cuda").int()
    page_tables = torch.zeros(len(lengths), max(pages_each), dtype=torch.int32, device="cuda")
    start = 0
    for b, count in enumerate(pages_each):
        page_tables[b, :count] = order[start : start + count]
        start += count
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, page_tables, seq_lens, cu


def contiguous(cache, page_tables, b: int, length: int) -> torch.Tensor:
    """Sequence b's K or V as one contiguous `[kv_heads, length, head_dim]` tensor."""
    pages = page_tables[b, : -(-length // PAGE_SIZE)].long()
    return cache[pages].flatten(0, 1)[:length].transpose(0, 1).contiguous()


def decode_sdpa(inputs, context: int):
    """The decode baseline of `paged_inputs` of one query token per sequence of `context`
    tokens: SDPA on `[batch, heads, context, head_dim]` contiguous copies of its K/V."""
    q, k_cache, v_cache, page_tables = inputs[:4]
    batch = page_tables.shape[0]
    k, v = (torch.stack([contiguous(c, page_tables, b, context) for b in range(batch)])
            for c in (k_cache, v_cache))
    q4 = q.view(batch, HEADS, 1, HEAD_DIM)
    return lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def prefill_sdpa(inputs, length: int):
    """The prefill baseline of `paged_inputs` of whole prompts of `length` tokens: causal
    SDPA on contiguous copies of each prompt's K/V, one call per prompt."""
    q, k_cache, v_cache, page_tables = inputs[:4]
    prompts = page_tables.shape[0]
    ks = [contiguous(k_cache, page_tables, b, length) for b in range(prompts)]
    vs = [contiguous(v_cache, page_tables, b, length) for b in range(prompts)]
    qs = [q[b * length : (b + 1) * length].transpose(0, 1)[None] for b in range(prompts)]

    def sdpa():
        for qb, kb, vb in zip(qs, ks, vs, strict=True):
            F.scaled_dot_product_attention(qb, kb[None], vb[None], is_causal=True,
                                           enable_gqa=True)
    return sdpa


def decode_tile(batch: int, context: int) -> str:
    """The triton decode's choice for a shape: splits, tokens per step, warps."""
    from kvpool.kernels import triton_decode

    splits = triton_decode.choose_num_splits(batch, KV_HEADS, context,
                                             triton_support.num_sms(torch.device("cuda")))
    launch = triton_decode.decode_launch(DTYPE, DTYPE, HEAD_DIM, HEADS // KV_HEADS, splits,
                                         -(-context // splits),
                                         triton_support.shared_memory(torch.device("cuda")))
    return f"{splits}/{launch.constexprs['BLOCK_N']}/{launch.num_warps}"


def prefill_tile(length: int) -> str:
    """The triton prefill's choice for prompts of `length` tokens: query rows, keys per
    step, warps."""
    from kvpool.kernels import triton_prefill

    launch = triton_prefill.prefill_launch(DTYPE, DTYPE, HEAD_DIM, length,
                                           triton_support.shared_memory(torch.device("cuda")))
    return (f"{launch.constexprs['BLOCK_M']}/{launch.constexprs['BLOCK_N']}/"
            f"{launch.num_warps}")


def decode_row(batch: int, context: int, names: list[str]) -> tuple[str, list[float]]:
    """One decode table line: SDPA on contiguous K/V, then each backend on shuffled pages;
    and each backend's ratio."""
    inputs = paged_inputs([context] * batch, [1] * batch)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    sdpa = time_ms(decode_sdpa(inputs, context))
    line = f"{batch:>6} {context:>8} {sdpa:>8.3f} {kv_bytes / sdpa / 1e6:>9.0f}"
    ratios = []
    for name in names:
        ms = time_ms(lambda name=name: paged_attention(
            *inputs, backend=name, max_seq_len=context, max_query_len=1))
        ratios.append(ms / sdpa)
        line += f" {ms:>10.3f} {kv_bytes / ms / 1e6:>11.0f} {ms / sdpa:>6.2f}"
    if "triton" in names:
        line += f" {decode_tile(batch, context):>12}"
    return line, ratios


def decode_section() -> None:
    """Decode attention at the sizes of DECODE_CASES, every backend against contiguous SDPA."""
    print(f"decode attention, heads {HEADS}/{KV_HEADS} kv, head_dim {HEAD_DIM}, bf16, page_size "
          f"{PAGE_SIZE}, pages shuffled; median ms")
    names = backends()
    print(f"{'batch':>6} {'context':>8} {'sdpa ms':>8} {'sdpa GB/s':>9}" + "".join(
        f" {name + ' ms':>10} {name + ' GB/s':>11} {'ratio':>6}" for name in names)
        + (f" {'splits/N/warps':>12}" if "triton" in names else ""))
    worst = 0.0
    for batch, context in DECODE_CASES:
        line, ratios = decode_row(batch, context, names)
        print(line)
        worst = max(worst, ratios[0])
        torch.cuda.empty_cache()
    print(f"worst {names[0]} ratio {worst:.2f} (target <= {DECODE_TARGET})")


def prefill_row(prompts: int, length: int, names: list[str]) -> str:
    """One prefill table line: causal SDPA per prompt, then each backend on the packed batch."""
    inputs = paged_inputs([length] * prompts, [length] * prompts)
    base = time_ms(prefill_sdpa(inputs, length))
    line = f"{prompts:>7} {length:>7} {base:>8.3f}"
    for name in names:
        ms = time_ms(lambda name=name: paged_attention(
            *inputs, backend=name, max_seq_len=length, max_query_len=length))
        line += f" {ms:>10.3f} {ms / base:>6.2f}"
    if "triton" in names:
        line += f" {prefill_tile(length):>9}"
    if (prompts, length) == (4, 2048):
        line += f"  (target <= {PREFILL_TARGET})"
    return line


def prefill_section() -> None:
    """Prefill attention of whole prompts, every backend against causal SDPA per prompt."""
    print(f"\nprefill attention, heads {HEADS}/{KV_HEADS} kv, head_dim {HEAD_DIM}, bf16; median ms")
    names = backends()
    print(f"{'prompts':>7} {'tokens':>7} {'sdpa ms':>8}"
          + "".join(f" {name + ' ms':>10} {'ratio':>6}" for name in names)
          + (f" {'M/N/warps':>9}" if "triton" in names else ""))
    for prompts, length in PREFILL_CASES:
        print(prefill_row(prompts, length, names))


SECTIONS = [decode_section, prefill_section, run_engine_benchmark]


def main() -> None:
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing measured")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, backends {backends()}")
    for section in SECTIONS:
        section()


if __name__ == "__main__":
    main()
