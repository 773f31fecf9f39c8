"""The Triton attention kernels' tiles on a CUDA GPU: every candidate tile timed on the shapes
of benchmarks/gpu.py, beside the tile the launchers choose and SDPA, all in one run.

Decode: context splits x tokens per step x warps x pipeline stages; prefill: query rows x keys
per step x warps x stages. Each candidate's output is compared with the chosen tile's (a tile
that computes something else, or does not launch, is reported, never ranked). Every candidate
and SDPA on the same K/V stored contiguously are timed once a round (benchmarks/gpu.py's
`time_ms`), in ROUNDS rounds; each figure is the median over rounds. "vs chosen" is the
candidate's time / the chosen tile's, "vs SDPA" its time / SDPA's.

    python benchmarks/tiles.py [--top N]   (prints one line and stops without CUDA)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from unittest import mock

import torch

from gpu import (
    DECODE_CASES,
    DTYPE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PAGE_SIZE,
    PREFILL_CASES,
    decode_sdpa,
    paged_inputs,
    prefill_sdpa,
    time_ms,
)

DECODE_TILES = dict(splits=(1, 2, 4, 8), block_n=(32, 64, 128), warps=(4, 8), stages=(1, 2, 3))
PREFILL_TILES = dict(block_m=(64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
TOLERANCE = 2e-2  # bf16 outputs of two tiles differ by rounding only
ROUNDS = 5  # every candidate is timed once a round, so that drift reaches all of them alike


def decode_candidates(batch: int, context: int) -> tuple[dict, str]:
    """Every decode tile of DECODE_TILES (and the chosen one) on `batch` sequences of
    `context` tokens as {name: a function running it}, SDPA's baseline under "SDPA"; and the
    chosen tile's name."""
    from kvpool.kernels import triton_decode, triton_support

    inputs = paged_inputs([context] * batch, [1] * batch)
    chosen_splits = triton_decode.choose_num_splits(
        batch, KV_HEADS, context, triton_support.num_sms(inputs[0].device))
    chosen = triton_decode.decode_launch(DTYPE, DTYPE, HEAD_DIM, HEADS // KV_HEADS,
                                         chosen_splits, -(-context // chosen_splits),
                                         triton_support.shared_memory(inputs[0].device))
    candidates = {"SDPA": decode_sdpa(inputs, context)}
    tile = (chosen_splits, chosen.constexprs["BLOCK_N"], chosen.num_warps, chosen.num_stages)
    for splits, block_n, warps, stages in {tile, *itertools.product(*DECODE_TILES.values())}:
        launch = dataclasses.replace(
            chosen, constexprs={**chosen.constexprs, "BLOCK_N": block_n, "SPLIT": splits > 1},
            num_warps=warps, num_stages=stages)

        def run(splits=splits, launch=launch):
            with mock.patch.object(triton_decode, "decode_launch", lambda *_: launch):
                return triton_decode.paged_decode(
                    *inputs, scale=HEAD_DIM ** -0.5, window=None, num_splits=splits,
                    max_span=context)
        candidates[f"{splits}/{block_n}/{warps}/{stages}"] = run
    return candidates, "/".join(map(str, tile))


def prefill_candidates(prompts: int, length: int) -> tuple[dict, str]:
    """Every prefill tile of PREFILL_TILES (and the chosen one) on `prompts` whole prompts of
    `length` tokens, as `decode_candidates` gives them."""
    from kvpool.kernels import triton_prefill, triton_support

    inputs = paged_inputs([length] * prompts, [length] * prompts)
    chosen = triton_prefill.prefill_launch(DTYPE, DTYPE, HEAD_DIM, length,
                                           triton_support.shared_memory(inputs[0].device))
    candidates = {"SDPA": prefill_sdpa(inputs, length)}
    tile = (chosen.constexprs["BLOCK_M"], chosen.constexprs["BLOCK_N"], chosen.num_warps,
            chosen.num_stages)
    for block_m, block_n, warps, stages in {tile, *itertools.product(*PREFILL_TILES.values())}:
        launch = dataclasses.replace(
            chosen, constexprs={**chosen.constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n},
            num_warps=warps, num_stages=stages)

        def run(launch=launch):
            with mock.patch.object(triton_prefill, "prefill_launch", lambda *_: launch):
                return triton_prefill.paged_prefill(
                    *inputs, scale=HEAD_DIM ** -0.5, window=None, max_query_len=length)
        candidates[f"{block_m}/{block_n}/{warps}/{stages}"] = run
    return candidates, "/".join(map(str, tile))


def sweep(shape: str, columns: str, candidates: dict, chosen: str, top: int) -> None:
    """Check every candidate's output against the chosen tile's, time the rest in ROUNDS
    interleaved rounds, and print the chosen tile and the `top` fastest by median."""
    reference = candidates[chosen]().float()
    for name, run in list(candidates.items()):
        if name == "SDPA":
            continue
        try:
            error = (run().float() - reference).abs().max().item()
        except Exception as e:  # a tile over the shared memory limit does not launch
            error = f"{type(e).__name__}"
        if not (isinstance(error, float) and error <= TOLERANCE):
            print(f"  {shape}, {name}: not ranked ({error})")
            del candidates[name]
    times = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, run in candidates.items():
            times[name].append(time_ms(run, repeats=5))
    ms = {name: statistics.median(t) for name, t in times.items()}
    sdpa, mine = ms.pop("SDPA"), ms[chosen]
    print(f"\n{shape}: SDPA {sdpa:.4f} ms; chosen {chosen} {mine:.4f} ms ({mine / sdpa:.2f}x SDPA)")
    print(f"  {columns:<24} {'ms':>8} {'vs chosen':>10} {'vs SDPA':>8}")
    for name in sorted(ms, key=ms.get)[:top]:
        print(f"  {name:<24} {ms[name]:>8.4f} {ms[name] / mine:>9.2f}x {ms[name] / sdpa:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=6, help="candidates shown per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tiles: no CUDA device; nothing timed")
        return
    print(f"{torch.cuda.get_device_name()}, heads {HEADS}/{KV_HEADS} kv, head_dim {HEAD_DIM}, "
          f"bf16, page_size {PAGE_SIZE}, pages shuffled", flush=True)
    for batch, context in DECODE_CASES:
        sweep(f"decode {batch} x {context}", "splits/N/warps/stages",
              *decode_candidates(batch, context), args.top)
        torch.cuda.empty_cache()
    for prompts, length in PREFILL_CASES:
        sweep(f"prefill {prompts} x {length}", "M/N/warps/stages",
              *prefill_candidates(prompts, length), args.top)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
