"""MLA attention on latent pages: absorbed (multi-query over the latent) vs expanded (per-head
K/V projected from the latent), for decode and for prefill, in the same run.

Run: python benchmarks/mla.py  (prints one table; a few minutes on 2 CPU cores)

One attention layer of DeepSeek-V2-Lite's shape (16 heads, kv_lora_rank 512, qk_rope_head_dim
64, qk_nope_head_dim 128, v_head_dim 128), float32, random weights, pages of 16 tokens in
shuffled order. Timed: `MLAttention.attend_absorbed` and `attend_expanded` on the same queries
and pages (the projections before them are common to both, so left out). Times are medians
(ms) of interleaved runs; "expanded / absorbed" above 1 means absorbed is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvpool.attention import AttentionMetadata
from kvpool.forward_context import HostLengths
from kvpool.models.config import ModelConfig
from kvpool.models.mla import MLAttention

PAGE_SIZE = 16
V2_LITE_ATTENTION = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 1000, "hidden_size": 2048,
    "intermediate_size": 10944, "num_hidden_layers": 1, "num_attention_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": None, "dtype": "float32",
}
# (phase, sequences, new tokens per sequence, context per sequence in tokens)
CASES = (
    ("decode", 8, 1, 512),
    ("decode", 8, 1, 2048),
    ("decode", 32, 1, 1024),
    ("prefill", 1, 512, 512),
    ("prefill", 1, 2048, 2048),
    ("prefill, chunk over a prefix", 1, 256, 2048),
)


def time_ms(fns: dict, repeats: int) -> dict:
    """Median wall time (ms) of each callable, run interleaved so load changes hit all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_case(layer: MLAttention, batch: int, q_len: int, context: int) -> dict:
    """The two attention paths over one batch: `batch` sequences of `context` tokens whose
    last `q_len` are new, latents already in shuffled pages."""
    mla, heads = layer.mla, layer.num_heads
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    cache = torch.randn(num_pages, PAGE_SIZE, 1, mla.latent_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        page_tables=torch.randperm(num_pages).view(batch, pages_per_seq).int(),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32),
        max_seq_len=context, max_query_len=q_len,
    )
    host = HostLengths(list(range(0, batch * q_len + 1, q_len)), [context] * batch, context,
                       q_len)
    q_nope = torch.randn(batch * q_len, heads, mla.qk_nope_head_dim)
    q_pe = torch.randn(batch * q_len, heads, mla.qk_rope_head_dim)
    return {
        "absorbed": lambda: layer.attend_absorbed(q_nope, q_pe, meta, cache),
        "expanded": lambda: layer.attend_expanded(q_nope, q_pe, meta, host, cache),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    config = ModelConfig.from_hf(V2_LITE_ATTENTION)
    with torch.device("meta"):
        layer = MLAttention(config, torch.float32, 0)
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, page size "
          f"{PAGE_SIZE}, load average {os.getloadavg()[0]:.1f}; median ms")
    header = f"{'phase':<30}{'seqs':>6}{'new':>6}{'context':>9}{'absorbed':>11}" \
             f"{'expanded':>11}{'expanded / absorbed':>22}"
    print(header)
    with torch.inference_mode():
        for phase, batch, q_len, context in CASES:
            ms = time_ms(make_case(layer, batch, q_len, context), repeats=5)
            print(f"{phase:<30}{batch:>6}{q_len:>6}{context:>9}{ms['absorbed']:>9.2f}ms"
                  f"{ms['expanded']:>9.2f}ms{ms['expanded'] / ms['absorbed']:>21.2f}x")


if __name__ == "__main__":
    main()
