"""The Triton kernels' resources on real GPUs, with no GPU: registers, spills, shared memory.

Every variant the launchers make (kvpool.kernels.triton_variants: query dtypes, fp8 pages or
not, decode split or not, and the head shapes of the built-in preset, Llama 3 8B, Gemma 3 4B
and DeepSeek's MLA latent) is compiled for sm_80 and sm_90 with the ptxas of the triton wheel.
Per variant: registers and spill-store bytes per thread (ptxas -v), shared memory per program
(the compiled kernel's metadata) against the arch's limit. A variant whose shared memory is over
the limit compiles but cannot launch.

    python benchmarks/kernel_resources.py [--workers N] [--only TEXT]  (names with TEXT)
    python benchmarks/kernel_resources.py --shapes [--sms 132]

`--shapes` prints, for each attention shape of benchmarks/gpu.py (Llama 3's heads, bf16), the
tile the launchers choose on a GPU of `--sms` SMs (132: H100 and H200) and that variant's
registers, spills and shared memory on sm_90.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU, never the CPU interpreter

from kvpool.kernels import triton_variants  # noqa: E402
from options import positive_int  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=positive_int, default=2, help="compiling processes")
    parser.add_argument("--only", default="", help="the variants whose name has this text")
    parser.add_argument("--shapes", action="store_true",
                        help="the variants benchmarks/gpu.py's attention shapes choose")
    parser.add_argument("--sms", type=positive_int, default=132, help="SMs of the GPU (--shapes)")
    args = parser.parse_args()
    if args.shapes:
        print_shapes(args.sms, args.workers)
        return
    workers = args.workers
    names = [v.name for v in triton_variants.variants() if args.only in v.name]
    start = time.perf_counter()
    results = triton_variants.compile_all(names, workers=workers, resources=True)
    seconds = time.perf_counter() - start
    rows = [("variant", "registers", "spill bytes", "shared KiB", "limit KiB", "note")]
    for result in results:
        limit = triton_variants.MAX_SHARED[result.arch]
        if result.error is not None:
            rows.append((result.name, "-", "-", "-", f"{limit // 1024}",
                         result.error.splitlines()[0][:60]))
            continue
        note = "" if result.fits else "over the shared limit: cannot launch"
        rows.append((result.name, str(result.registers), str(result.spill_bytes),
                     f"{result.shared_bytes / 1024:.1f}", f"{limit // 1024}", note))
    print(f"{len(results)} Triton kernel variants compiled to cubin in {seconds:.0f} s "
          f"({workers} processes); per thread: registers, spill stores; per program: shared")
    print_table(rows)


def shape_variants(sms: int, arch: int = 90) -> list[tuple[str, str]]:
    """(shape, variant name) for each attention shape of benchmarks/gpu.py: the variant the
    launchers choose for it on a GPU of `sms` SMs and `arch`."""
    from gpu import DECODE_CASES, DTYPE, HEAD_DIM, HEADS, KV_HEADS, PREFILL_CASES
    from kvpool.kernels import triton_decode, triton_prefill

    prefix = f"sm{arch}-bf16-llama3-"
    named = {(v.kernel_name, repr(v.launch)): v.name for v in triton_variants.variants()
             if v.name.startswith(prefix)}
    found = []
    for batch, context in DECODE_CASES:
        splits = triton_decode.choose_num_splits(batch, KV_HEADS, context, sms)
        launch = triton_decode.decode_launch(DTYPE, DTYPE, HEAD_DIM, HEADS // KV_HEADS, splits,
                                             -(-context // splits),
                                             triton_variants.MAX_SHARED[arch])
        found.append((f"decode {batch} x {context}, {splits} split(s)",
                      named[("_decode_split", repr(launch))]))
    for prompts, length in PREFILL_CASES:
        launch = triton_prefill.prefill_launch(DTYPE, DTYPE, HEAD_DIM, length,
                                               triton_variants.MAX_SHARED[arch])
        found.append((f"prefill {prompts} x {length}", named[("_prefill", repr(launch))]))
    return found


def print_shapes(sms: int, workers: int) -> None:
    """The table of `--shapes`."""
    shapes = shape_variants(sms)
    results = {r.name: r for r in triton_variants.compile_all(
        sorted({name for _, name in shapes}), workers=workers, resources=True)}
    print(f"attention shapes of benchmarks/gpu.py on {sms} SMs, sm_90: the chosen variant's "
          f"registers and spill stores per thread, shared memory per program")
    rows = [("shape", "variant", "registers", "spill bytes", "shared KiB")]
    for shape, name in shapes:
        result = results[name]
        rows.append((shape, name, str(result.registers), str(result.spill_bytes),
                     f"{result.shared_bytes / 1024:.1f}"))
    print_table(rows)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
