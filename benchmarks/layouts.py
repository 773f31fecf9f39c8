"""Sliding windows: how many long sequences a 4 GiB KV pool holds at once, with and without
giving back the pages that fall out of the window.

For each preset's layout (bfloat16 and fp8_e4m3 pages of 16 tokens), a KVCache of as many
pages as 4 GiB holds of that layout (its pages shrunk to one float per token, layer and plane,
with the same layers and windows: only the page bookkeeping runs) admits sequences one at a
time: a 2,048-token prompt, then appends of 256 tokens up to 32,768 tokens, each kept alive,
until a call raises OutOfPages. The table gives the sequences that reached 32,768 tokens
together and the pages each holds at the end, with pages given back (`free_out_of_window`, the
default) against every page kept (the baseline, same run), and the ratio. Only a layout whose
every layer is windowed (Mistral) gives pages back; models mixing full and windowed layers
keep everything until the full/window pool pair exists.

Then the engine on a long-context workload: a small random Mistral (window 512) saved with
save_pretrained, 12 requests with prompts of 4,096-8,192 tokens and 256 output tokens each
(greedy, ignore_eos), on a pool of 1,280 pages of 16 tokens, run with pages given back and
with every page kept (the baseline, same run): wall time, output tokens per second, the
most requests decoding at once, preemptions, and that both give the same tokens.

    python benchmarks/layouts.py
"""

from __future__ import annotations

import random
import tempfile
import time

import torch
import transformers

from kvpool.cache import HOLE, KVCache
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import OutOfPages
from kvpool.layout import KVLayout
from kvpool.models.config import ModelConfig

POOL_BYTES = 4 * 2**30
PAGE_SIZE = 16
PROMPT, CHUNK, CONTEXT = 2048, 256, 32768
MODELS = ("Llama-3-8B", "Qwen3-8B", "Mistral-7B", "Gemma-3-4B")
MISTRAL = transformers.MistralConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
    max_position_embeddings=16384, bos_token_id=None, eos_token_id=None, pad_token_id=0)
NUM_REQUESTS, OUTPUT_TOKENS, ENGINE_PAGES = 12, 256, 1280


def sequences_held(model: str, kv_cache_dtype: str, free: bool) -> tuple[int, int]:
    """(sequences of CONTEXT tokens alive at once, pages the last one holds)."""
    layout = ModelConfig.from_hf(model).kv_layout(page_size=PAGE_SIZE,
                                                  kv_cache_dtype=kv_cache_dtype)
    shrunk = KVLayout(layout.num_layers, 1, 1, torch.float32, PAGE_SIZE,
                      layer_windows=layout.layer_windows)
    cache = KVCache(shrunk, POOL_BYTES // layout.bytes_per_page, device="cpu",
                    free_out_of_window=free)
    done = 0
    try:
        while True:
            cache.add_sequence(done, num_tokens=PROMPT)
            while cache.num_tokens(done) < CONTEXT:
                cache.append(done, CHUNK)
            done += 1
    except OutOfPages:  # the pool is full: `done` sequences reached CONTEXT together
        pass
    cache.check()
    held = sum(page != HOLE for page in cache.pages(done - 1)) if done else 0
    return done, held


def main() -> None:
    rows = [("model", "KV dtype", "every page kept", "pages given back", "ratio")]
    for model in MODELS:
        for dtype in ("auto", "fp8_e4m3"):
            kept, kept_pages = sequences_held(model, dtype, free=False)
            freed, freed_pages = sequences_held(model, dtype, free=True)
            ratio = f"{freed / kept:.1f}x" if kept else "-"
            rows.append((model, "bfloat16" if dtype == "auto" else "fp8_e4m3",
                         f"{kept} ({kept_pages} pages each)",
                         f"{freed} ({freed_pages} pages each)", ratio))
    print(f"sequences of {CONTEXT:,} tokens held at once by a {POOL_BYTES / 2**30:g} GiB pool, "
          f"pages of {PAGE_SIZE}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def run_engine(checkpoint: str, prompts: list[list[int]], free: bool) -> tuple:
    """(seconds, most requests running at once, preemptions, output tokens) of one run."""
    llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=ENGINE_PAGES, max_num_seqs=NUM_REQUESTS,
              free_out_of_window=free)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    for prompt in prompts:
        llm.add_request(prompt, params)
    running, outputs = 0, {}
    start = time.perf_counter()
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        running = max(running, len(llm.cache.sequences()))
    seconds = time.perf_counter() - start
    llm.cache.check()
    return seconds, running, llm.stats().num_preemptions, [outputs[k] for k in sorted(outputs)]


def engine_main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(MISTRAL.vocab_size) for _ in range(rng.randint(4096, 8192))]
               for _ in range(NUM_REQUESTS)]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as checkpoint:
        transformers.MistralForCausalLM(MISTRAL).save_pretrained(checkpoint)
        kept = run_engine(checkpoint, prompts, free=False)
        freed = run_engine(checkpoint, prompts, free=True)
    tokens = NUM_REQUESTS * OUTPUT_TOKENS
    print(f"\nengine, Mistral window {MISTRAL.sliding_window}, {NUM_REQUESTS} prompts of "
          f"{min(map(len, prompts)):,}-{max(map(len, prompts)):,} tokens, {OUTPUT_TOKENS} "
          f"output tokens each, {ENGINE_PAGES} pages of {PAGE_SIZE}")
    rows = [("run", "seconds", "output tok/s", "ratio", "most running", "preemptions")]
    for name, (seconds, running, preemptions, _) in (("every page kept", kept),
                                                      ("pages given back", freed)):
        rows.append((name, f"{seconds:.1f}", f"{tokens / seconds:.0f}",
                     f"{kept[0] / seconds:.2f}x", str(running), str(preemptions)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"same greedy tokens: {kept[3] == freed[3]}")


if __name__ == "__main__":
    main()
    engine_main()
