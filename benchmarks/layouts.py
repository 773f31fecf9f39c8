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

    python benchmarks/layouts.py
"""

from __future__ import annotations

import torch

from kvpool.cache import HOLE, KVCache
from kvpool.errors import OutOfPages
from kvpool.layout import KVLayout
from kvpool.models.config import ModelConfig

POOL_BYTES = 4 * 2**30
PAGE_SIZE = 16
PROMPT, CHUNK, CONTEXT = 2048, 256, 32768
MODELS = ("Llama-3-8B", "Qwen3-8B", "Mistral-7B", "Gemma-3-4B")


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
    except OutOfPages:
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


if __name__ == "__main__":
    main()
