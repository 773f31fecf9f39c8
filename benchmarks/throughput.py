"""Generation throughput of kvpool's engine against transformers, on the CPU in float32.

One seeded workload (default 64 requests, prompts of 32-512 tokens, outputs of 16-256,
ignore_eos, greedy) on a Llama of ~58M parameters with random weights (hidden 512, 8 layers,
8 heads, 4 KV heads, intermediate 1536, vocab 32000), built with transformers and saved with
save_pretrained, run three ways in the same process:

  kvpool              LLM.generate: continuous batching on the paged cache, prefix caching on,
                      a pool that holds every request at once
  static batches      transformers `generate` on batches of 32 requests in order (the fastest size),
                      left padded, max_new_tokens = the batch's longest output; only each
                      request's own output tokens count (the honest cost of static batching)
  continuous batching transformers' own (the manager behind `generate_batch`, which takes one
                      max_new_tokens for all; the manager takes each request's own)

Prints generated tokens per second of each and the ratio to static batching, then checks that
kvpool's greedy tokens equal transformers' for the first requests run alone.

    python benchmarks/throughput.py [--num-requests N] [--batch-size B]
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import tempfile
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from kvpool.engine import LLM, SamplingParams
from options import positive_int

PAGE_SIZE = 16
HF_PAGE_SIZE = 256  # transformers' continuous batching default
MAX_NUM_BATCHED_TOKENS = 2048  # kvpool's default, given to transformers' too
# The fastest static batch size on this workload (2 cores): 8, 16, 32, 64 -> 81, 97, 100, 69
# useful tok/s.
STATIC_BATCH_SIZE = 32
NUM_CHECKED = 4  # requests whose greedy tokens are compared with transformers' alone
CHECKED_TOKENS = 32  # leading tokens compared per request
CONFIG = LlamaConfig(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt (token ids) and how many tokens to generate for it."""

    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Run:
    """One way of serving the workload: its output tokens per request and wall time (s)."""

    name: str
    outputs: list[list[int]] | None
    seconds: float

    def tokens_per_second(self, requests: list[Request]) -> float:
        """Requested output tokens (each request's own) per second of wall time."""
        return sum(r.max_tokens for r in requests) / self.seconds


def make_requests(num_requests: int, seed: int = 0) -> list[Request]:
    """Prompts of 32-512 random tokens and outputs of 16-256 tokens, uniform, seeded."""
    rng = random.Random(seed)
    return [Request([rng.randrange(1, CONFIG.vocab_size) for _ in range(rng.randint(32, 512))],
                    rng.randint(16, 256)) for _ in range(num_requests)]


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """The transformers Llama with seeded random weights, float32, eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG).eval()


def run_kvpool(checkpoint: str, requests: list[Request]) -> Run:
    """kvpool's LLM.generate over the whole workload, greedy, with a pool for all of it."""
    num_pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / PAGE_SIZE) for r in requests)
    llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=num_pages, prefix_caching=True,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Run("kvpool", [o.outputs[0].token_ids for o in outputs], seconds)


def run_static(model: LlamaForCausalLM, requests: list[Request], batch_size: int) -> Run:
    """transformers `generate` on consecutive batches, left padded; each batch decodes for
    its longest output and each request keeps only its own tokens."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[CONFIG.pad_token_id] * (width - len(r.prompt)) + r.prompt
                            for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        config = _greedy(max(r.max_tokens for r in batch))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        outputs += [row[width:width + r.max_tokens].tolist() for row, r in zip(out, batch,
                                                                             strict=True)]
    return Run(f"static batches of {batch_size}", outputs, time.perf_counter() - start)


def run_continuous(model: LlamaForCausalLM, requests: list[Request]) -> Run:
    """transformers' continuous batching manager, each request with its own max_new_tokens,
    a paged cache that holds every request at once."""
    from transformers.generation import ContinuousBatchingConfig

    num_blocks = sum(math.ceil((len(r.prompt) + r.max_tokens) / HF_PAGE_SIZE) for r in requests)
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks,
                                         max_batch_tokens=MAX_NUM_BATCHED_TOKENS)
    config = _greedy(max(r.max_tokens for r in requests))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config) as manager:
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens) for r in requests]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
    seconds = time.perf_counter() - start
    return Run("transformers continuous batching", [results[i] for i in ids], seconds)


def _greedy(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                            pad_token_id=CONFIG.pad_token_id)


def reference_outputs(model: LlamaForCausalLM, requests: list[Request]) -> list[list[int]]:
    """transformers' greedy tokens for each request alone (no padding), CHECKED_TOKENS each."""
    outputs = []
    for r in requests:
        n = min(r.max_tokens, CHECKED_TOKENS)
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([r.prompt]), generation_config=_greedy(n))
        outputs.append(out[0, len(r.prompt):].tolist())
    return outputs


def agreement(outputs: list[list[int]], references: list[list[int]]) -> str:
    """One line: how many requests (and tokens) match the reference, and where the first
    mismatch is."""
    same = [next((i for i, (a, b) in enumerate(zip(o, ref, strict=False)) if a != b), len(ref))
            for o, ref in zip(outputs, references, strict=False)]
    total = sum(len(ref) for ref in references)
    line = (f"{sum(s == len(ref) for s, ref in zip(same, references, strict=True))}"
            f"/{len(references)} requests, {sum(same)}/{total} leading tokens")
    first = next((i for i, (s, ref) in enumerate(zip(same, references, strict=True))
                  if s < len(ref)), None)
    return line if first is None else f"{line}; request {first} differs at token {same[first]}"


def print_table(runs: list[Run], requests: list[Request], baseline: Run) -> None:
    """Tokens per second of each run and its ratio to the baseline."""
    print(f"{'engine':<34} {'seconds':>8} {'tok/s':>8} {'vs static':>10}")
    for run in runs:
        if run.outputs is None:
            print(f"{run.name:<34} {'n/a':>8} {'n/a':>8} {'n/a':>10}")
            continue
        ratio = run.tokens_per_second(requests) / baseline.tokens_per_second(requests)
        print(f"{run.name:<34} {run.seconds:8.1f} {run.tokens_per_second(requests):8.1f} "
              f"{ratio:9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=STATIC_BATCH_SIZE,
                        help=f"static batch size for transformers generate "
                             f"(default: {STATIC_BATCH_SIZE})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    # Its CPU memory probe wants psutil; the cache is sized by num_blocks here, so it is moot.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    requests = make_requests(args.num_requests, args.seed)
    model = build_model(args.seed)
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: Llama, {num_parameters / 1e6:.1f} M parameters ({num_parameters:,}), "
          f"float32, CPU, {torch.get_num_threads()} threads, transformers "
          f"{transformers.__version__}")
    print(f"workload: {len(requests)} requests, "
          f"{sum(len(r.prompt) for r in requests):,} prompt tokens, "
          f"{sum(r.max_tokens for r in requests):,} output tokens (ignore_eos, greedy)")
    with tempfile.TemporaryDirectory() as checkpoint:
        model.save_pretrained(checkpoint)
        kvpool_run = run_kvpool(checkpoint, requests)
    static = run_static(model, requests, args.batch_size)
    try:
        continuous = run_continuous(model, requests)
    except Exception as e:  # any failure of transformers' continuous batching is reported
        print(f"transformers continuous batching: n/a ({type(e).__name__}: {e})")
        continuous = Run("transformers continuous batching", None, math.nan)
    print()
    print_table([kvpool_run, static, continuous], requests, static)
    checked = requests[:NUM_CHECKED]
    print(f"\ngreedy check, kvpool vs transformers alone: "
          f"{agreement(kvpool_run.outputs, reference_outputs(model, checked))}")


if __name__ == "__main__":
    main()
