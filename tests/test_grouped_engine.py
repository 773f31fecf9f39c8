"""The engine on models mixing sliding-window and full-attention layers (Qwen3 with
layer_types, Gemma 3): a full pool and a window pool, greedy outputs equal to transformers'
on sequences longer than the window, with chunked prefill, prefix hits and preemption."""

import pytest

from kvpool.cache import HOLE
from kvpool.engine import LLM, SamplingParams
from models_util import hf_greedy, make_hf_model, prompts, save_hf_model
from test_models import MAX_TOKENS
from test_windows import CONFIGS, WINDOW

PAGE_SIZE = 4
WINDOW_PAGES = -(-WINDOW // PAGE_SIZE) + 1  # what a decoding sequence holds in the window pool
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# 64 tokens at most: 16 pages. The window pool holds 2 windows (3 pages each) and one prompt
# (16 pages); the full pool gets the rest of the bytes of 22 pages of every layer: 22 pages
# (half the layers are windowed), less than two whole sequences, so the engine preempts.
ENGINE = dict(num_pages=22, page_size=PAGE_SIZE, max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=64)


@pytest.fixture(scope="module", params=["qwen3-layer-types", "gemma3"])
def checkpoint(request, tmp_path_factory, device):
    """(transformers model on the device, its checkpoint folder)."""
    hf = make_hf_model(request.param, configs=CONFIGS)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), folder


def batch() -> list[list[int]]:
    """Prompts of 5-31 tokens, two of them continuing one 20-token prefix."""
    shared = prompts(160, lengths=(20,), seed=2)["seq0"]
    out = list(prompts(160, lengths=(5, 30), seed=3).values())
    return out + [shared + tail for tail in prompts(160, lengths=(3, 11), seed=4).values()]


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    """transformers' greedy continuation of each prompt of batch()."""
    hf, _ = checkpoint
    return [hf_greedy(hf, p, MAX_TOKENS) for p in batch()]


def test_a_mixed_model_gets_a_full_pool_and_a_window_pool(checkpoint, device):
    _, folder = checkpoint
    llm = LLM(folder, **ENGINE, device=device)
    assert [g.window for g in llm.cache.groups] == [None, WINDOW]
    assert [g.allocator.num_pages for g in llm.cache.groups] == [22, 2 * WINDOW_PAGES + 16]


def test_bench_shows_the_pages_of_each_pool_and_the_bytes_of_both(checkpoint, device):
    from kvpool.cli.bench import BenchRequest, run_workload, summary_rows
    from kvpool.formats import format_bytes

    _, folder = checkpoint
    llm = LLM(folder, **ENGINE, device=device)
    requests = [BenchRequest(prompt, 4, 0.0, None) for prompt in batch()[:2]]
    result = run_workload(llm, requests, show_progress=False)
    rows = dict(summary_rows(llm, requests, result))
    assert rows["pool pages"] == (
        f"22 full attention + {2 * WINDOW_PAGES + 16} window {WINDOW:,} x {PAGE_SIZE} tokens "
        f"= {22 * PAGE_SIZE} tokens ({format_bytes(llm.cache.kv_pools.nbytes)})")
    assert llm.cache.kv_pools.nbytes > llm.cache.pool.nbytes


def test_a_tier_is_refused_with_a_clear_error(checkpoint, device):
    _, folder = checkpoint
    with pytest.raises(ValueError, match="host_tier_memory: .* grouped .* takes none yet"):
        LLM(folder, **ENGINE, device=device, host_tier_memory=2**20)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_outputs_equal_transformers_with_chunks_prefix_hits_and_preemption(
        checkpoint, expected, prefix_caching, device, overlap):
    _, folder = checkpoint
    llm = LLM(folder, prefix_caching=prefix_caching, **ENGINE, device=device, overlap=overlap)
    prompts_ = batch()
    ids = [llm.add_request(p, GREEDY) for p in prompts_]
    outputs = {}
    windowed = 0  # steps of sequences that gave window pages back
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for seq_id in llm.cache.sequences():
            pages = llm.cache.pages(seq_id, 1)
            if HOLE in pages:  # its window, and the chunk of 16 tokens it took last
                assert len(pages) - pages.count(HOLE) <= WINDOW_PAGES + 16 // PAGE_SIZE
                windowed += 1
            assert HOLE not in llm.cache.pages(seq_id, 0)
        llm.check()
    assert windowed > 0
    assert [outputs[i] for i in ids] == expected
    assert llm.stats().num_preemptions > 0
    assert (llm.cache.stats().prefix_hit_tokens > 0) == prefix_caching


def test_free_out_of_window_false_keeps_one_pool_of_every_page(checkpoint, expected, device):
    _, folder = checkpoint
    llm = LLM(folder, free_out_of_window=False, **ENGINE, device=device)
    assert len(llm.cache.groups) == 1 and llm.cache.num_pages == 22
    out = llm.generate([batch()[1]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[1]


def test_fp8_pages_calibrate_each_pool_of_the_pair(checkpoint, device):
    _, folder = checkpoint
    llm = LLM(folder, kv_cache_dtype="fp8_e4m3", **ENGINE, device=device)
    out = llm.generate([batch()[1]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert llm.cache.pool.quantized and llm.cache.pool.scales_ready
    llm.check()
