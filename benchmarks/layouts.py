"""Sliding windows: how many long sequences a 4 GiB KV pool holds at once, with and without
giving back the pages that fall out of the window.

For each preset's layout (bfloat16 and fp8_e4m3 pages of 16 tokens), a cache of the bytes 4 GiB
holds (its pages shrunk to one float per token, layer and plane, with the same layers and
windows: only the page bookkeeping runs) admits sequences one at a time: a 2,048-token prompt,
then appends of 256 tokens up to 32,768 tokens, each kept alive, until a call raises
OutOfPages. The table gives the sequences that reached 32,768 tokens together, the pages each
holds at the end, and the tokens the pool has a slot for, with every page kept in one pool (the
baseline, same run) against pages given back: by the KVCache of a model whose every layer is
windowed (Mistral), and by a KVCache of a full and a window group for models mixing full and
windowed layers (Gemma 3, Qwen3 with layer_types), its 4 GiB split by kvpool.planning.group_plan for
8 sequences' windows and one prompt.

Then the engine on a long-context workload, for a small random Mistral (window 512, every layer
windowed) and a small random Qwen3 whose layer_types window three layers in four (window 512):
each saved with save_pretrained, 12 requests with prompts of 4,096-8,192 tokens and 256 output
tokens each (greedy, ignore_eos), on the bytes of 1,280 pages of 16 tokens of every layer, run
with every page kept in one pool (the baseline, same run) and with pages given back: wall
time, output tokens per second, the most requests running at once, preemptions, and that both
give the same tokens.

    python benchmarks/layouts.py
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
import transformers

from kvpool.cache import HOLE, KVCache
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import OutOfPages
from kvpool.memory.layout import KVLayout
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.planning.group_plan import split_budget

POOL_BYTES = 4 * 2**30
PAGE_SIZE = 16
PROMPT, CHUNK, CONTEXT = 2048, 256, 32768
WINDOW_SEQS = 8  # sequences whose windows a pair's window pool is sized for
QWEN3_LAYER_TYPES = dict(PRESETS["Qwen3-8B"], use_sliding_window=True, sliding_window=4096,
                         layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 9)
MODELS = {"Llama-3-8B": "Llama-3-8B", "Qwen3-8B": "Qwen3-8B",
          "Qwen3-8B layer_types": QWEN3_LAYER_TYPES, "Mistral-7B": "Mistral-7B",
          "Gemma-3-4B": "Gemma-3-4B"}
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=1, sliding_window=512, max_position_embeddings=16384,
             bos_token_id=None, eos_token_id=None, pad_token_id=0)
ENGINE_MODELS = {
    "Mistral, 2 layers windowed": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SMALL, num_hidden_layers=2)),
    "Qwen3, 3 of 4 layers windowed": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SMALL, num_hidden_layers=4, head_dim=32,
                                 use_sliding_window=True,
                                 layer_types=["sliding_attention"] * 3 + ["full_attention"])),
}
NUM_REQUESTS, OUTPUT_TOKENS, ENGINE_PAGES = 12, 256, 1280
MAX_MODEL_LEN = 8192 + OUTPUT_TOKENS


def shrunk_cache(model, kv_cache_dtype: str, free: bool) -> KVCache:
    """A cache of the bytes of POOL_BYTES of the model's layout, its pages shrunk to one float
    per token, layer and plane: a full and a window group for a mixed layout when `free`,
    else one pool."""
    layout = ModelConfig.from_hf(model).kv_layout(page_size=PAGE_SIZE,
                                                  kv_cache_dtype=kv_cache_dtype)
    shrunk = KVLayout(layout.num_layers, 1, 1, torch.float32, PAGE_SIZE,
                      layer_windows=layout.layer_windows)
    if free and len(layout.groups) > 1:
        pools = split_budget(layout, POOL_BYTES, max_num_seqs=WINDOW_SEQS,
                             prefill_tokens=PROMPT)
        return KVCache(shrunk, [pool.num_pages for pool in pools], device="cpu")
    return KVCache(shrunk, POOL_BYTES // layout.bytes_per_page, device="cpu",
                   free_out_of_window=free)


def sequences_held(model, kv_cache_dtype: str, free: bool) -> tuple[int, int, int]:
    """(sequences of CONTEXT tokens alive at once, pages the last one holds, token slots of
    the pool every token has a slot in)."""
    cache = shrunk_cache(model, kv_cache_dtype, free)
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
    held = [sum(page != HOLE for page in cache.pages(done - 1, g)) if done else 0
            for g in range(len(cache.groups))]
    return done, "+".join(map(str, held)), cache.groups[0].allocator.num_pages * PAGE_SIZE


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = [("model", "KV dtype", "every page kept", "tokens", "pages given back", "tokens",
             "ratio")]
    for name, model in MODELS.items():
        for dtype in ("auto", "fp8_e4m3"):
            kept, kept_pages, kept_tokens = sequences_held(model, dtype, free=False)
            freed, freed_pages, freed_tokens = sequences_held(model, dtype, free=True)
            ratio = f"{freed / kept:.1f}x" if kept else "-"
            rows.append((name, "bfloat16" if dtype == "auto" else "fp8_e4m3",
                         f"{kept} ({kept_pages} pages each)", f"{kept_tokens:,}",
                         f"{freed} ({freed_pages} pages each)", f"{freed_tokens:,}", ratio))
    print(f"sequences of {CONTEXT:,} tokens held at once by a {POOL_BYTES / 2**30:g} GiB pool, "
          f"pages of {PAGE_SIZE} (a pair's pages: full + window pool)")
    print_table(rows)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def run_engine(checkpoint: str, prompts: list[list[int]], free: bool) -> tuple:
    """(seconds, most requests running at once, preemptions, output tokens) of one run."""
    llm = LLM(checkpoint, page_size=PAGE_SIZE, num_pages=ENGINE_PAGES, max_num_seqs=NUM_REQUESTS,
              max_model_len=MAX_MODEL_LEN, free_out_of_window=free)
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
    prompts = [[rng.randrange(SMALL["vocab_size"]) for _ in range(rng.randint(4096, 8192))]
               for _ in range(NUM_REQUESTS)]
    tokens = NUM_REQUESTS * OUTPUT_TOKENS
    print(f"\nengine, window {SMALL['sliding_window']}, {NUM_REQUESTS} prompts of "
          f"{min(map(len, prompts)):,}-{max(map(len, prompts)):,} tokens, {OUTPUT_TOKENS} "
          f"output tokens each, the bytes of {ENGINE_PAGES} pages of {PAGE_SIZE} tokens")
    rows = [("model", "run", "seconds", "output tok/s", "ratio", "most running",
             "preemptions", "same tokens")]
    for name, build in ENGINE_MODELS.items():
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as checkpoint:
            build().save_pretrained(checkpoint)
            kept = run_engine(checkpoint, prompts, free=False)
            freed = run_engine(checkpoint, prompts, free=True)
        for run, (seconds, running, preemptions, out) in (("one pool, every page kept", kept),
                                                          ("pages given back", freed)):
            rows.append((name, run, f"{seconds:.1f}", f"{tokens / seconds:.0f}",
                         f"{kept[0] / seconds:.2f}x", str(running), str(preemptions),
                         str(out == kept[3])))
    print_table(rows)


if __name__ == "__main__":
    main()
    engine_main()
