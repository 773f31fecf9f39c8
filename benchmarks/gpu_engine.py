"""Engine throughput on one CUDA GPU in bfloat16: kvpool against transformers.

The workload of issue 11: a Llama of ~0.85 B parameters with random weights (hidden 2048,
16 layers, 32 heads, 8 KV heads, intermediate 5632, vocab 32000), 128 requests with prompts
of 64-1024 random tokens and outputs of 32-256 (uniform, seed 0), ignore_eos, greedy; run
three ways in one process:

  kvpool              LLM.generate (CUDA graphs for decode steps unless --enforce-eager)
  static batches      transformers `generate` on batches of 64 in order, left padded, each
                      batch decoding for its longest output; only each request's own tokens count
  continuous batching transformers' own manager, each request with its own max_new_tokens

Prints output tokens per second, the ratio to static batching, kvpool's median decode
step time at batch 64, and the CUDA graph capture time (its target: 2 s for the default
buckets) of this model and of the built-in `tiny` preset, the first in the process (Triton
compiles included, unless its cache on disk has them) and a second. Without CUDA it prints
one line and returns.

    python benchmarks/gpu_engine.py [--num-requests N] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.stats import StepRecord

PAGE_SIZE = 16
HF_PAGE_SIZE = 256  # transformers' continuous batching default
STATIC_BATCH_SIZE = 64
DECODE_BATCH = 64  # the batch size whose decode step time is reported
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 4096
CONFIG = LlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
    bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt (token ids) and how many tokens to generate for it."""

    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Run:
    """One way of serving the workload: wall time (s) for every request's own tokens."""

    name: str
    seconds: float


def make_requests(num_requests: int, seed: int = 0) -> list[Request]:
    """Prompts of 64-1024 random tokens and outputs of 32-256 tokens, uniform, seeded."""
    rng = random.Random(seed)
    return [Request([rng.randrange(1, CONFIG.vocab_size) for _ in range(rng.randint(64, 1024))],
                    rng.randint(32, 256)) for _ in range(num_requests)]


def build_checkpoint(folder: str, seed: int = 0) -> LlamaForCausalLM:
    """Save the seeded random bf16 Llama to `folder`; return it on CUDA, eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model.cuda()


def run_kvpool(folder: str, requests: list[Request], *, enforce_eager: bool,
               ) -> tuple[Run, float | None, float | None]:
    """kvpool over the workload with a pool that holds all of it; returns the run, the
    median duration (s) of its decode-only steps of DECODE_BATCH sequences and its CUDA graph
    capture time (s; None without graphs)."""
    records: list[StepRecord] = []
    num_pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / PAGE_SIZE) for r in requests)
    llm = LLM(folder, dtype=torch.bfloat16, device="cuda", page_size=PAGE_SIZE,
              num_pages=num_pages + 1, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enforce_eager=enforce_eager,
              on_step=records.append)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    decode = [r.duration for r in records
              if r.num_batched_tokens == r.num_decode_tokens == DECODE_BATCH]
    capture = llm.graphs.capture_seconds if llm.graphs is not None else None
    return Run("kvpool", seconds), statistics.median(decode) if decode else None, capture


def tiny_capture_seconds() -> list[float]:
    """CUDA graph capture time (s) of the `tiny` preset at the engine's defaults, twice in a
    row: the first pays for whatever compiles the process has not done yet."""
    times = []
    for _ in range(2):
        llm = LLM("tiny", device="cuda")
        times.append(llm.graphs.capture_seconds)
        del llm
        torch.cuda.empty_cache()
    return times


def run_static(model: LlamaForCausalLM, requests: list[Request]) -> Run:
    """transformers `generate` on consecutive batches of STATIC_BATCH_SIZE, left padded."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(requests), STATIC_BATCH_SIZE):
        batch = requests[i:i + STATIC_BATCH_SIZE]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[CONFIG.pad_token_id] * (width - len(r.prompt)) + r.prompt
                            for r in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch],
                            device="cuda")
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask,
                           generation_config=_greedy(max(r.max_tokens for r in batch)))
    torch.cuda.synchronize()
    return Run(f"static batches of {STATIC_BATCH_SIZE}", time.perf_counter() - start)


def run_continuous(model: LlamaForCausalLM, requests: list[Request]) -> Run:
    """transformers' continuous batching manager, a paged cache holding every request."""
    from transformers.generation import ContinuousBatchingConfig

    num_blocks = sum(math.ceil((len(r.prompt) + r.max_tokens) / HF_PAGE_SIZE) for r in requests)
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks,
                                         max_batch_tokens=MAX_NUM_BATCHED_TOKENS)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
            generation_config=_greedy(max(r.max_tokens for r in requests)),
            continuous_batching_config=cb_config) as manager:
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens) for r in requests]
        done = set()
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
            if result is not None and result.is_finished():
                done.add(result.request_id)
    return Run("transformers continuous batching", time.perf_counter() - start)


def _greedy(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, pad_token_id=CONFIG.pad_token_id)


def run_engine_benchmark(num_requests: int = 128, *, enforce_eager: bool = False) -> None:
    """Run the workload three ways and print the table (one line without CUDA)."""
    if not torch.cuda.is_available():
        print("engine benchmark skipped: no CUDA device")
        return
    requests = make_requests(num_requests)
    output_tokens = sum(r.max_tokens for r in requests)
    with tempfile.TemporaryDirectory() as folder:
        model = build_checkpoint(folder)
        params = sum(p.numel() for p in model.parameters())
        print(f"model: Llama, {params / 1e9:.2f} B parameters, bfloat16, "
              f"{torch.cuda.get_device_name()}")
        print(f"workload: {num_requests} requests, {sum(len(r.prompt) for r in requests):,} "
              f"prompt tokens, {output_tokens:,} output tokens (ignore_eos, greedy)\n")
        static = run_static(model, requests)
        continuous = run_continuous(model, requests)
        del model
        torch.cuda.empty_cache()
        kvpool, decode_step, capture = run_kvpool(folder, requests,
                                                  enforce_eager=enforce_eager)
    print(f"{'engine':<34} {'seconds':>8} {'tok/s':>8} {'vs static':>10} {'vs continuous':>14}")
    for run in (kvpool, static, continuous):
        print(f"{run.name:<34} {run.seconds:8.1f} {output_tokens / run.seconds:8.1f} "
              f"{static.seconds / run.seconds:9.2f}x {continuous.seconds / run.seconds:13.2f}x")
    shown = "n/a (no such step)" if decode_step is None else f"{decode_step * 1e3:.1f} ms"
    print(f"\nkvpool decode step at batch {DECODE_BATCH} (median): {shown}")
    if capture is not None:
        first, second = tiny_capture_seconds()
        print(f"CUDA graph capture, default buckets (target <= 2 s): this model {capture:.2f} s; "
              f"tiny preset {first:.2f} s, then {second:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run kvpool without CUDA graphs")
    args = parser.parse_args()
    run_engine_benchmark(args.num_requests, enforce_eager=args.enforce_eager)


if __name__ == "__main__":
    main()
