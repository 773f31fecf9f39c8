"""Engine throughput on one CUDA GPU in bfloat16: kvpool against transformers.

The workload of issue 11: a Llama of ~0.85 B parameters with random weights (hidden 2048,
16 layers, 32 heads, 8 KV heads, intermediate 5632, vocab 32000), 128 requests with prompts
of 64-1024 random tokens and outputs of 32-256 (uniform, seed 0), ignore_eos, greedy; run
three ways in one process:

  kvpool              LLM.generate (CUDA graphs for decode steps unless --enforce-eager)
  static batches      transformers `generate` on batches of 64 in order, left padded, each
                      batch decoding for its longest output; only each request's own tokens count
  continuous batching transformers' own manager, each request with its own max_new_tokens

Prints output tokens per second, the ratio to static batching, kvpool's median decode step
time at batch 64, and the CUDA graph capture time (its target: 2 s for the default buckets)
of this model and of the built-in `tiny` preset, the first in the process (Triton compiles
included, unless its cache on disk has them) and a second. Then the profile point of one
decode step: 64 sequences of ~700 tokens (prompts of 256-1,024 tokens, 60 tokens decoded),
PROFILE_STEPS steps under the torch profiler, with and without overlap scheduling: wall
time, GPU busy time (kernels and copies, overlapping intervals merged), host time inside
CUDA calls that wait for the device, the rest of the host's time, and kernels, per step.
Without CUDA it prints one line and returns.

    python benchmarks/gpu_engine.py [--num-requests N] [--enforce-eager] [--no-overlap]
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
from torch.autograd import DeviceType
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from kvpool.engine import LLM, SamplingParams
from kvpool.engine.stats import StepRecord

PAGE_SIZE = 16
HF_PAGE_SIZE = 256  # transformers' continuous batching default
STATIC_BATCH_SIZE = 64
DECODE_BATCH = 64  # the batch size whose decode step time is reported
# requests finish several at a time, so a run may step over exactly 64: batches this near count
DECODE_BATCH_SPREAD = 4
MAX_NUM_SEQS = 128
PROFILE_PROMPT_LEN = (256, 1024)  # prompt tokens of the profiled decode step's sequences
PROFILE_DECODED = 60  # tokens each has decoded before the profiled steps
PROFILE_STEPS = 5
# Host calls that block until the device is done (a copy to pageable host memory among them).
WAITING_CALLS = frozenset({"cudaEventSynchronize", "cudaStreamSynchronize",
                           "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy"})
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


@dataclass(frozen=True, slots=True)
class StepProfile:
    """One decode step on average over a profile (milliseconds): wall time, the device's
    busy time, the host's time inside calls that wait for the device, and kernels."""

    wall_ms: float
    gpu_busy_ms: float
    host_wait_ms: float
    kernels: float

    @property
    def host_work_ms(self) -> float:
        """The host's time not spent waiting for the device."""
        return self.wall_ms - self.host_wait_ms


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
               overlap: bool | None = None) -> tuple[Run, float | None, float | None]:
    """kvpool over the workload with a pool that holds all of it; returns the run, the
    median duration (s) of its decode-only steps of DECODE_BATCH (+- DECODE_BATCH_SPREAD)
    sequences and its CUDA graph capture time (s; None without graphs)."""
    records: list[StepRecord] = []
    num_pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / PAGE_SIZE) for r in requests)
    llm = LLM(folder, dtype=torch.bfloat16, device="cuda", page_size=PAGE_SIZE,
              num_pages=num_pages + 1, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enforce_eager=enforce_eager,
              overlap=overlap, on_step=records.append)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    decode = [r.duration for r in records
              if r.num_batched_tokens == r.num_decode_tokens
              and abs(r.num_decode_tokens - DECODE_BATCH) <= DECODE_BATCH_SPREAD]
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


def decode_requests(num_requests: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """The profiled step's sequences: prompts of PROFILE_PROMPT_LEN random tokens (uniform,
    seeded), generating past the profiled steps."""
    rng = random.Random(seed)
    return [Request([rng.randrange(1, vocab_size) for _ in range(rng.randint(*PROFILE_PROMPT_LEN))],
                    PROFILE_DECODED + PROFILE_STEPS + 2) for _ in range(num_requests)]


def profile_decode_step(model: str, requests: list[Request], *, device: str, overlap: bool,
                        enforce_eager: bool = False, steps: int = PROFILE_STEPS,
                        **options) -> StepProfile:
    """Admit `requests` (greedy, ignore_eos) into an engine of as many seats, step until
    every one has decoded PROFILE_DECODED tokens (fewer when its max_tokens says so), then
    profile `steps` decode steps."""
    num_pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / PAGE_SIZE) for r in requests)
    llm = LLM(model, device=device, page_size=PAGE_SIZE, num_pages=num_pages + 1,
              max_num_seqs=len(requests), max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              enforce_eager=enforce_eager, overlap=overlap, **options)
    for r in requests:
        llm.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                                 ignore_eos=True))
    decoded = min(PROFILE_DECODED, min(r.max_tokens for r in requests) - steps - 2)
    while llm.scheduler.waiting or min(
            len(seq.output_token_ids) for seq in llm.scheduler.running) < decoded:
        llm.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return summarize_profile(profile.events(), steps, wall)


def summarize_profile(events, steps: int, wall: float) -> StepProfile:
    """A StepProfile from a torch profile's events of `steps` steps that took `wall`
    seconds."""
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    waiting = sum(e.time_range.elapsed_us() for e in events
                  if e.device_type == DeviceType.CPU and e.name in WAITING_CALLS)
    busy = merged_us([(e.time_range.start, e.time_range.end) for e in device])
    return StepProfile(wall * 1e3 / steps, busy / 1e3 / steps, waiting / 1e3 / steps,
                       len(kernels) / steps)


def merged_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def print_profiles(profiles: dict[str, StepProfile]) -> None:
    """The profile point's table, one row per loop, and the ratio of the last to the first."""
    print(f"\ndecode step of {DECODE_BATCH} sequences of ~700 tokens, {PROFILE_STEPS} steps "
          f"profiled, per step:")
    print(f"{'loop':<10} {'wall ms':>8} {'GPU busy ms':>12} {'host wait ms':>13} "
          f"{'host work ms':>13} {'kernels':>8}")
    for name, p in profiles.items():
        print(f"{name:<10} {p.wall_ms:8.2f} {p.gpu_busy_ms:12.2f} {p.host_wait_ms:13.2f} "
              f"{p.host_work_ms:13.2f} {p.kernels:8.0f}")
    (first, a), *_, (last, b) = profiles.items()
    print(f"{last} / {first} wall time: {b.wall_ms / a.wall_ms:.2f}x")


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


def run_engine_benchmark(num_requests: int = 128, *, enforce_eager: bool = False,
                         overlap: bool | None = None) -> None:
    """Run the workload three ways and print the table, then the profile point (one line
    without CUDA)."""
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
                                                  enforce_eager=enforce_eager, overlap=overlap)
        decode = decode_requests(DECODE_BATCH, CONFIG.vocab_size)
        profiles = {name: profile_decode_step(folder, decode, device="cuda", overlap=on,
                                              enforce_eager=enforce_eager,
                                              dtype=torch.bfloat16)
                    for name, on in (("plain", False), ("overlap", True))}
    print(f"{'engine':<34} {'seconds':>8} {'tok/s':>8} {'vs static':>10} {'vs continuous':>14}")
    for run in (kvpool, static, continuous):
        print(f"{run.name:<34} {run.seconds:8.1f} {output_tokens / run.seconds:8.1f} "
              f"{static.seconds / run.seconds:9.2f}x {continuous.seconds / run.seconds:13.2f}x")
    shown = "n/a (no such step)" if decode_step is None else f"{decode_step * 1e3:.1f} ms"
    print(f"\nkvpool decode step at batch {DECODE_BATCH} +- {DECODE_BATCH_SPREAD} (median): "
          f"{shown}")
    if capture is not None:
        first, second = tiny_capture_seconds()
        print(f"CUDA graph capture, default buckets (target <= 2 s): this model {capture:.2f} s; "
              f"tiny preset {first:.2f} s, then {second:.2f} s")
    print_profiles(profiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run kvpool without CUDA graphs")
    parser.add_argument("--no-overlap", action="store_true",
                        help="run kvpool's workload without overlap scheduling (the profile "
                             "point runs both)")
    args = parser.parse_args()
    run_engine_benchmark(args.num_requests, enforce_eager=args.enforce_eager,
                         overlap=False if args.no_overlap else None)


if __name__ == "__main__":
    main()
