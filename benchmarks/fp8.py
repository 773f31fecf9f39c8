"""fp8 KV pages: how often greedy decoding with fp8 pages agrees with bfloat16 pages, and how many
tokens a fixed KV budget holds.

Agreement: the parity models of the test suite (tests/models_util.py: small random Llama, Qwen2,
Qwen3 and Mistral checkpoints), loaded in bfloat16, each continue 16 prompts of 16 to 96 random
tokens by 32 greedy tokens through the engine, once with bfloat16 pages (the baseline) and once
with fp8_e4m3 pages (scales from the first prefill). A continuation agrees when all 32 tokens
are equal. For scale, the same comparison between float32 and bfloat16 (weights and pages)
shows how sensitive these random models are to rounding at all.

Capacity: tokens held by a 4 GiB pool of each preset's layout in bfloat16 and in fp8.

    python benchmarks/fp8.py
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.formats import format_bytes
from kvpool.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the parity models
from models_util import CONFIGS, make_hf_model, save_hf_model  # noqa: E402

NUM_PROMPTS = 16
MAX_TOKENS = 32
BUDGET = 4 * 2**30
PRESETS = ("Llama-3-8B", "Qwen2.5-7B", "Qwen3-8B", "Mistral-7B")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(16, 96))]
            for _ in range(NUM_PROMPTS)]


def continuations(folder: Path, dtype: torch.dtype, kv_cache_dtype: str) -> list[list[int]]:
    llm = LLM(folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_pages=512,
              device="cpu", prefix_caching=False)
    outputs = llm.generate(prompts(llm.model_config.vocab_size), GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(continuations equal in every token, mean tokens equal before the first difference)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
              for x, y in zip(a, b, strict=True)]
    return same, sum(prefix) / len(prefix)


def agreement_rows() -> tuple[list[tuple[str, ...]], int, int]:
    rows, fp8_same, total = [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            folder = save_hf_model(make_hf_model(name), Path(tmp) / name)
            bf16 = continuations(folder, torch.bfloat16, "auto")
            fp8 = continuations(folder, torch.bfloat16, "fp8_e4m3")
            fp32 = continuations(folder, torch.float32, "auto")
            same, prefix = agreement(bf16, fp8)
            same32, prefix32 = agreement(bf16, fp32)
            fp8_same, total = fp8_same + same, total + NUM_PROMPTS
            rows.append((name, f"{same}/{NUM_PROMPTS}", f"{prefix:.1f}",
                         f"{same32}/{NUM_PROMPTS}", f"{prefix32:.1f}"))
    return rows, fp8_same, total


def capacity_rows() -> list[tuple[str, ...]]:
    rows = []
    for name in PRESETS:
        layout = ModelConfig.from_hf(name).kv_layout(dtype=torch.bfloat16)
        fp8 = ModelConfig.from_hf(name).kv_layout(dtype=torch.bfloat16,
                                                  kv_cache_dtype="fp8_e4m3")
        tokens = [BUDGET // lay.bytes_per_page * lay.page_size for lay in (layout, fp8)]
        rows.append((name, format_bytes(layout.bytes_per_token), f"{tokens[0]:,}",
                     format_bytes(fp8.bytes_per_token), f"{tokens[1]:,}",
                     f"{tokens[1] / tokens[0]:.2f}x"))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in [header, *rows])


def main() -> None:
    rows, same, total = agreement_rows()
    print(f"greedy {MAX_TOKENS}-token continuations of {NUM_PROMPTS} prompts, against "
          f"bfloat16 weights with bfloat16 pages (the baseline)")
    print(table(("model", "fp8 pages: equal", "tokens before a difference",
                 "float32: equal", "tokens before a difference"), rows))
    print(f"fp8 pages agree with bfloat16 pages on {same}/{total} = {same / total:.1%} "
          f"of continuations\n")
    print(f"tokens held by a {format_bytes(BUDGET)} KV pool")
    print(table(("preset", "bf16 bytes/token", "bf16 tokens", "fp8 bytes/token", "fp8 tokens",
                 "ratio"), capacity_rows()))


if __name__ == "__main__":
    main()
