"""fp8 KV pages: how often greedy decoding with fp8 pages agrees with bfloat16 pages, and how many
tokens a fixed KV budget holds.

Agreement: the parity models of the test suite (tests/models_util.py: small random Llama, Qwen2,
Qwen3 and Mistral checkpoints on K/V pages; tests/test_deepseek.py: small random DeepSeek-V2
and V3 checkpoints on MLA latent pages), loaded in bfloat16, each continue 16 prompts of 16 to
96 random tokens by 32 greedy tokens through the engine, once with bfloat16 pages (the
baseline) and once with fp8_e4m3 pages (scales from the first prefill). A continuation
agrees when all 32 tokens are equal; a first difference sends the two continuations apart for
good, so the table also gives the next-token agreement with the same context: each prompt with
its bfloat16 continuation runs as one prefill with bfloat16 pages and with fp8 pages (scales
from that prefill), and the greedy token predicted at each of the 32 continuation positions is
compared. For scale, the same two comparisons between float32 and bfloat16 (weights and pages)
show how sensitive these random models are to rounding at all.

MLA latent scale: the latents the DeepSeek models write in one prefill of 3 prompts (float32),
rounded to e4m3 under one scale per layer for the whole latent (what kvpool stores) and under
a scale of its own for the rope part; RMS error of each part relative to its RMS, worst layer.

Capacity: tokens held by a 4 GiB pool of each preset's layout (and DeepSeek-V2-Lite's latent
pages) in bfloat16 and in fp8.

Decode speed: the CPU decode kernel (backend "cpu") over bfloat16 pages (the baseline) and over
fp8 pages of the same K/V, batch 32, 32 query heads, 8 KV heads, head_dim 128, pages of 16,
shuffled; median of 7 interleaved runs.

    python benchmarks/fp8.py
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpool.attention import paged_attention
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.formats import format_bytes
from kvpool.fp8 import FP8_DTYPE, dequantize, quantize, scale_of
from kvpool.models import mla
from kvpool.models.config import ModelConfig
from kvpool.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the parity models
from models_util import CONFIGS, PagedRunner, make_hf_model, save_hf_model  # noqa: E402
from models_util import prompts as test_prompts  # noqa: E402
from test_deepseek import CONFIGS as DEEPSEEK_CONFIGS  # noqa: E402
from test_deepseek import V2_LITE  # noqa: E402

NUM_PROMPTS = 16
MAX_TOKENS = 32
BUDGET = 4 * 2**30
PRESETS = ("Llama-3-8B", "Qwen2.5-7B", "Qwen3-8B", "Mistral-7B")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(16, 96))]
            for _ in range(NUM_PROMPTS)]


def continuations(folder: Path, dtype: torch.dtype, kv_cache_dtype: str,
                  prompt_ids: list[list[int]]) -> list[list[int]]:
    """The engine's greedy continuation of each prompt, on pages of `kv_cache_dtype`."""
    llm = LLM(folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_pages=512,
              device="cpu", prefix_caching=False)
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def next_tokens(folder: Path, dtype: torch.dtype, kv_dtype: torch.dtype | None,
                sequences: list[list[int]]) -> list[int]:
    """The greedy token after each of the last MAX_TOKENS + 1 positions but the last of every
    sequence, each sequence run as one prefill on pages of `kv_dtype` (None: `dtype`)."""
    model = load_model(folder, dtype=dtype, device="cpu").model
    out = []
    for sequence in sequences:
        runner = PagedRunner(model, num_pages=64, page_size=4, kv_dtype=kv_dtype)
        logits = runner.step({"a": sequence}, all_logits=True)
        out += logits[-MAX_TOKENS - 1:-1].argmax(-1).tolist()
    return out


def equal_count(a: list, b: list) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def agreement_rows(configs: dict) -> tuple[list[tuple[str, ...]], list[int]]:
    """A row per parity model of `configs`, and the totals: continuations equal with fp8
    pages, with float32; next tokens equal with fp8 pages, with float32."""
    rows, totals = [], [0, 0, 0, 0]
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            hf = make_hf_model(name, configs=configs)
            folder = save_hf_model(hf, Path(tmp) / name)
            prompt_ids = prompts(hf.config.vocab_size)
            bf16 = continuations(folder, torch.bfloat16, "auto", prompt_ids)
            fp8 = continuations(folder, torch.bfloat16, "fp8_e4m3", prompt_ids)
            fp32 = continuations(folder, torch.float32, "auto", prompt_ids)
            sequences = [p + c for p, c in zip(prompt_ids, bf16, strict=True)]
            base = next_tokens(folder, torch.bfloat16, None, sequences)
            counts = [equal_count(bf16, fp8), equal_count(bf16, fp32),
                      equal_count(base, next_tokens(folder, torch.bfloat16, FP8_DTYPE, sequences)),
                      equal_count(base, next_tokens(folder, torch.float32, None, sequences))]
            totals = [t + c for t, c in zip(totals, counts, strict=True)]
            rows.append((name, f"{counts[0]}/{NUM_PROMPTS}", f"{counts[2] / len(base):.1%}",
                         f"{counts[1]}/{NUM_PROMPTS}", f"{counts[3] / len(base):.1%}"))
    return rows, totals


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


def summary(label: str, num_models: int, totals: list[int]) -> str:
    continuations_run = num_models * NUM_PROMPTS
    positions = continuations_run * MAX_TOKENS
    return (f"{label}: fp8 pages {totals[0]}/{continuations_run} = "
            f"{totals[0] / continuations_run:.1%} of continuations equal, "
            f"{totals[2] / positions:.1%} of next tokens; float32: "
            f"{totals[1] / continuations_run:.1%} and {totals[3] / positions:.1%}")


def main() -> None:
    mha_rows, mha_totals = agreement_rows(CONFIGS)
    mla_rows, mla_totals = agreement_rows(DEEPSEEK_CONFIGS)
    print(f"greedy {MAX_TOKENS}-token continuations of {NUM_PROMPTS} prompts, against "
          f"bfloat16 weights with bfloat16 pages (the baseline)")
    print(table(("model", "fp8: equal continuations", "fp8: equal next tokens",
                 "float32: equal continuations", "float32: equal next tokens"),
                mha_rows + mla_rows))
    print(summary("K/V pages (mha)", len(mha_rows), mha_totals))
    print(summary("latent pages (mla)", len(mla_rows), mla_totals) + "\n")
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
