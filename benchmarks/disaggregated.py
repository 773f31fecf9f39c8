"""Prefill/decode disaggregation against one engine, on a mixed workload: short prompts
decoding many tokens while long prompts (few output tokens) arrive.

    python benchmarks/disaggregated.py [--model tiny] [--device cpu] [--long N]
        [--long-tokens T] [--short N] [--short-max-tokens T] [--interval S]

`--short` requests (16-token prompts, `--short-max-tokens` greedy tokens) start at once;
`--long` requests (`--long-tokens` prompts, 4 tokens) arrive one every `--interval` seconds.
Both setups take the same options (a chunked-prefill budget of 256 tokens); the baseline,
one engine, runs first in the same process. Reported: time to first token (TTFT) of the long
requests and time per output token (TPOT, first token to last over the tokens between) of the
short ones, medians in milliseconds, and the wall time; ratios are disaggregated over one
engine (below 1: faster).

On one engine a long prompt's chunks share every step with the decodes, so the short
requests' TPOT grows while prefills run; disaggregated, the prefill runs in its own process
and the decode steps carry one token per request. That only pays where the two processes
get cores of their own: on a machine of 2 cores shared with others, they contend, and the
transfer of each prompt's pages (through the host, gloo) adds to TTFT.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvpool.engine import LLM, DisaggregatedLLM, SamplingParams
from options import non_negative_float, positive_int

OPTIONS = dict(num_pages=1024, page_size=16, max_num_seqs=32, max_num_batched_tokens=256)


def run(llm, args: argparse.Namespace) -> dict[str, float]:
    """Run the workload through the step API; returns the long requests' median TTFT and
    the short ones' median TPOT (ms), and the wall time (s)."""
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    short = SamplingParams(max_tokens=args.short_max_tokens, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    start = time.perf_counter()
    for i in range(args.short):
        prompt = [rng.randrange(vocab) for _ in range(16)]
        arrived[llm.add_request(prompt, short, f"short-{i}")] = start
    due = [start + (i + 1) * args.interval for i in range(args.long)]
    while due or llm.has_unfinished():
        now = time.perf_counter()
        while due and due[0] <= now:
            prompt = [rng.randrange(vocab) for _ in range(args.long_tokens)]
            request_id = llm.add_request(prompt, long, f"long-{args.long - len(due)}")
            arrived[request_id] = due.pop(0)
        if not llm.has_unfinished():
            time.sleep(max(due[0] - time.perf_counter(), 0))
            continue
        for output in llm.step():
            now = time.perf_counter()
            first.setdefault(output.request_id, now)
            last[output.request_id] = (now, len(output.outputs[0].token_ids))
    wall = time.perf_counter() - start
    ttft = [first[r] - arrived[r] for r in arrived if r.startswith("long")]
    tpot = [(last[r][0] - first[r]) / (last[r][1] - 1) for r in arrived if r.startswith("short")]
    return {"ttft": statistics.median(ttft) * 1e3, "tpot": statistics.median(tpot) * 1e3,
            "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--long", type=positive_int, default=8,
                        help="long requests (default: 8)")
    parser.add_argument("--long-tokens", type=positive_int, default=1024,
                        help="tokens of a long prompt (default: 1024)")
    parser.add_argument("--short", type=positive_int, default=8,
                        help="short requests (default: 8)")
    parser.add_argument("--short-max-tokens", type=positive_int, default=128,
                        help="tokens each short request generates, at least 2 (default: 128)")
    parser.add_argument("--interval", type=non_negative_float, default=0.5,
                        help="seconds between long arrivals (default: 0.5)")
    args = parser.parse_args()
    if args.short_max_tokens < 2:
        parser.error(f"argument --short-max-tokens: expected an int >= 2 (TPOT is the time "
                     f"between a request's tokens), got {args.short_max_tokens}")
    options = {**OPTIONS, "device": args.device}
    one = LLM(args.model, **options)
    run(one, args)  # warm-up: first-call costs stay out of the table
    baseline = run(one, args)
    del one
    with DisaggregatedLLM(args.model, prefill=options, decode=options) as pair:
        run(pair, args)
        ours = run(pair, args)
    print(f"{args.short} short requests (16-token prompts, {args.short_max_tokens} tokens) and "
          f"{args.long} long ones ({args.long_tokens}-token prompts, 4 tokens, one every "
          f"{args.interval} s), {args.model} on {args.device}")
    print(f"{'':<22}{'one engine':>12}{'disaggregated':>15}{'ratio':>8}")
    for key, name in (("ttft", "long TTFT (ms)"), ("tpot", "short TPOT (ms)"),
                      ("wall", "wall time (s)")):
        print(f"{name:<22}{baseline[key]:>12.1f}{ours[key]:>15.1f}"
              f"{ours[key] / baseline[key]:>8.2f}")


if __name__ == "__main__":
    main()
