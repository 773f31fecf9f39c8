"""The Triton kernels (kvpool/kernels/triton_*.py) against the float64 reference and the torch path.

Without CUDA they run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets before triton is first imported), on small shapes: the interpreter runs
each program in numpy. The tests at real sizes need CUDA.
"""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from kvpool.attention import paged_attention  # noqa: E402
from kvpool.kernels import triton_decode, triton_prefill, triton_write  # noqa: E402
from kvpool.memory.fp8 import FP8_DTYPE, dequantize, quantize  # noqa: E402
from test_attention import (  # noqa: E402
    MIXED,
    SOFTCAP,
    Batch,
    relative_error,
    sinks_for,
    softcap_batch,
)
from test_fp8 import LOOSE, TIGHT, fp8_pages  # noqa: E402

# Triton runs on CUDA, or on the CPU in its interpreter: every tensor, reference included, is
# built on this one device.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DECODES = [(37, 1), (1, 1), (16, 1), (64, 1), (150, 1), (17, 1)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_batch(specs, *, heads, kv_heads, head_dim, page_size, dtype, seed=0):
    """A Batch (test_attention) on DEVICE whose unwritten slots hold NaN."""
    return Batch(specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                 dtype=dtype, device=DEVICE, seed=seed, fill=float("nan"))


def decode(batch, *, window=None, num_splits=1, workspace=None, softcap=None, sinks=None):
    return triton_decode.paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.page_tables, batch.seq_lens,
        batch.cu_seqlens_q, scale=batch.scale, window=window, num_splits=num_splits,
        max_span=int(batch.seq_lens.max()), workspace=workspace, softcap=softcap, sinks=sinks,
    )


def prefill(batch, *, window=None, softcap=None, sinks=None):
    return triton_prefill.paged_prefill(
        batch.q, batch.k_cache, batch.v_cache, batch.page_tables, batch.seq_lens,
        batch.cu_seqlens_q, scale=batch.scale, window=window, max_query_len=max(batch.q_lens),
        softcap=softcap, sinks=sinks,
    )


class Workspace:
    """The workspace interface (`alloc(shape, dtype)`, `scope()`), recording what the kernels
    ask for."""

    def __init__(self):
        self.requests = []

    def alloc(self, shape, dtype):
        self.requests.append((tuple(shape), dtype))
        return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)

    @contextlib.contextmanager
    def scope(self):
        yield self


# (heads, kv_heads, head_dim, page_size, dtype, window, num_splits)
DECODE_CASES = [
    (4, 4, 64, 16, torch.float32, None, 1),
    (8, 2, 128, 5, torch.float32, None, 3),
    (7, 1, 64, 1, torch.float32, 9, 2),
    (14, 2, 128, 16, torch.bfloat16, None, 4),
    (8, 2, 64, 5, torch.bfloat16, 40, 1),
    (8, 2, 64, 16, torch.float16, None, 2),
    (40, 2, 48, 16, torch.float32, None, 2),  # 20 heads a kv head: two head blocks of 16
    (20, 1, 64, 4, torch.bfloat16, 9, 1),  # MLA's shape: every head on one kv head
    (4, 2, 48, 16, torch.float32, None, 1),  # unsplit, head_dim padded in the tile: 48 -> 64
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "dtype", "window", "num_splits"),
    DECODE_CASES,
    ids=["mha-d64-p16-fp32", "gqa4-d128-p5-fp32-split3", "gqa7-d64-p1-fp32-window-split2",
         "gqa7-d128-p16-bf16-split4", "gqa4-d64-p5-bf16-window", "gqa4-d64-p16-fp16-split2",
         "gqa20-d48-p16-fp32-split2", "mqa20-d64-p4-bf16-window", "gqa2-d48-p16-fp32"],
)
def test_decode_matches_reference(heads, kv_heads, head_dim, page_size, dtype, window,
                                  num_splits):
    # Every case takes its scratch from a workspace whose memory holds NaN: a split decode asks
    # for float32 partial outputs (head_dim padded to a power of two, as the kernel tiles it:
    # 48 -> 64 in gqa20) and log-sum-exps, exactly the bytes the engine sizes its workspace
    # for (decode_scratch_bytes); an unsplit one asks for nothing.
    from kvpool.kernels import decode_scratch_bytes

    batch = make_batch(DECODES, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=dtype)
    workspace = Workspace()
    out = decode(batch, window=window, num_splits=num_splits, workspace=workspace)
    assert out.dtype == dtype
    assert relative_error(out, batch.reference(window=window)) < TOLERANCE[dtype]
    if num_splits == 1:
        assert workspace.requests == []
    else:
        padded = 1 << (head_dim - 1).bit_length()
        rows = (len(DECODES), heads, num_splits)
        assert workspace.requests == [((*rows, padded), torch.float32), (rows, torch.float32)]
        taken = sum(torch.Size(shape).numel() * kind.itemsize
                    for shape, kind in workspace.requests)
        assert taken == decode_scratch_bytes(len(DECODES), heads, head_dim, num_splits)


def test_decode_split_over_the_context_matches_unsplit():
    batch = make_batch(DECODES, heads=2, kv_heads=1, head_dim=64, page_size=16,
                       dtype=torch.float32)
    whole = decode(batch)
    for num_splits in (2, 5):
        assert relative_error(decode(batch, num_splits=num_splits), whole.double()) < 1e-6


def test_decode_splits_past_a_short_context_are_harmless():
    # 8 splits of a 1- or 2-token context: all but one split have no token at all.
    batch = make_batch([(1, 1), (2, 1), (3, 1)], heads=4, kv_heads=1, head_dim=64,
                       page_size=16, dtype=torch.float32)
    out = decode(batch, num_splits=8)
    assert relative_error(out, batch.reference()) < 1e-5


def test_decode_of_a_zero_length_row_is_zero_not_nan():
    # Padded rows of a captured graph may carry seq_len 0: they must not produce NaN.
    batch = make_batch([(20, 1), (20, 1)], heads=4, kv_heads=1, head_dim=64, page_size=16,
                       dtype=torch.float32)
    batch.seq_lens[1] = 0
    for num_splits in (1, 2):
        out = decode(batch, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros(4, 64, device=DEVICE))
        assert not out[0].isnan().any()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_ignores_nan_in_unwritten_slots(window, num_splits):
    kwargs = dict(heads=2, kv_heads=1, head_dim=64, page_size=5, dtype=torch.float32)
    poisoned = make_batch(DECODES, **kwargs)  # unwritten slots hold NaN
    clean = make_batch(DECODES, **kwargs)
    clean.k_cache.nan_to_num_(0.0)
    clean.v_cache.nan_to_num_(0.0)
    assert torch.equal(decode(poisoned, window=window, num_splits=num_splits),
                       decode(clean, window=window, num_splits=num_splits))


@pytest.mark.parametrize(("window", "num_splits", "dtype"),
                         [(None, 1, torch.float32), (40, 3, torch.bfloat16)])
def test_softcapped_decode_matches_reference(window, num_splits, dtype):
    batch = softcap_batch(DECODES, dtype=dtype, device=DEVICE, page_size=5)
    out = decode(batch, window=window, num_splits=num_splits, softcap=SOFTCAP)
    expected = batch.reference(window=window, softcap=SOFTCAP)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(decode(batch, window=window, num_splits=num_splits), expected) > 0.5


@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_prefill_of_a_mixed_batch_matches_reference(window):
    batch = softcap_batch(MIXED, device=DEVICE)
    out = prefill(batch, window=window, softcap=SOFTCAP)
    expected = batch.reference(window=window, softcap=SOFTCAP)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert relative_error(prefill(batch, window=window), expected) > 0.5


@pytest.mark.parametrize(("window", "num_splits", "dtype"),
                         [(None, 1, torch.float32), (40, 3, torch.bfloat16)])
def test_decode_with_sinks_matches_reference(window, num_splits, dtype):
    # split: each split's partial output must leave the sink to the merge, joined once
    batch = make_batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=5, dtype=dtype)
    sinks = sinks_for(batch)
    out = decode(batch, window=window, num_splits=num_splits, sinks=sinks)
    expected = batch.reference(window=window, sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(decode(batch, window=window, num_splits=num_splits), expected) > 0.5


# the interpreter's numpy says so when 3e38 times log2(e) overflows, as the kernels mean it to
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_strided_sinks_and_sinks_past_float32s_base_2_range_reach_the_kernels_as_given():
    batch = make_batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4,
                       dtype=torch.float32)
    strided = torch.stack([sinks_for(batch), torch.full((8,), 100.0, device=DEVICE)], 1)[:, 0]
    expected = batch.reference(sinks=strided)
    assert relative_error(batch.attend(backend="triton", sinks=strided), expected) < 1e-5
    decodes = make_batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=5,
                         dtype=torch.float32)
    huge = torch.full((8,), 3e38, device=DEVICE)  # times log2(e): past float32
    for splits in (1, 3):
        assert decode(decodes, window=None, num_splits=splits, sinks=huge).abs().max() < 1e-30


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_sinks_of_a_mixed_batch_matches_reference(window):
    batch = make_batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4,
                       dtype=torch.float32)
    sinks = sinks_for(batch)
    out = prefill(batch, window=window, sinks=sinks)
    expected = batch.reference(window=window, sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert relative_error(prefill(batch, window=window), expected) > 0.5


@pytest.mark.parametrize("softcap", [1e6, 1e30])
def test_a_softcap_far_above_the_scores_leaves_them_as_they_are(softcap):
    # tanh(x) of a tiny x must not cancel to 0: the attention is then the uncapped one
    batch = softcap_batch(MIXED, device=DEVICE)
    expected = batch.reference(window=5)
    assert relative_error(prefill(batch, window=5, softcap=softcap), expected) < 1e-5
    decodes = softcap_batch(DECODES, device=DEVICE, page_size=5)
    assert relative_error(decode(decodes, window=40, num_splits=3, softcap=softcap),
                          decodes.reference(window=40)) < 1e-5


@pytest.mark.parametrize("specs", [DECODES[:3], MIXED[:3]], ids=["decode", "mixed"])
def test_paged_attention_passes_the_softcap_to_the_triton_kernels(specs):
    batch = softcap_batch(specs, device=DEVICE)
    out = batch.attend(backend="triton", sliding_window=5, softcap=SOFTCAP)
    expected = batch.attend(backend="torch", sliding_window=5, softcap=SOFTCAP)
    assert relative_error(out, expected.double()) < TOLERANCE[torch.float32]


def test_num_splits_fill_the_gpu_without_short_splits():
    sm = 1  # one SM: splits aim at 4 programs
    assert triton_decode.choose_num_splits(1, 1, 10_000, sm) == 4
    assert triton_decode.choose_num_splits(1, 1, 300, sm) == 2  # >= 256 tokens a split
    assert triton_decode.choose_num_splits(4, 8, 10_000, sm) == 1
    assert triton_decode.choose_num_splits(1, 1, 10**9, sm) == 4
    # Half the programs aimed at already: no merge for a doubling.
    assert triton_decode.choose_num_splits(2, 1, 10_000, sm) == 1


SM90 = 227 * 1024  # bytes of shared memory a program may take on an H100
SM89 = 99 * 1024  # on an L4, L40S or RTX 4090 (an A10's, sm_86, too)


def test_decode_tile_follows_the_tokens_of_a_split():
    def tile(split_tokens, dtype=torch.bfloat16, head_dim=128):
        launch = triton_decode.decode_launch(dtype, dtype, head_dim, 4, 1, split_tokens, SM90)
        return launch.constexprs["BLOCK_N"], launch.num_warps

    assert tile(20) == (32, 4)  # a short context: a block no longer than it
    assert tile(1024) == (64, 4)
    assert tile(4096) == (64, 4)  # a long one: BLOCK_N a step
    assert tile(4096, torch.float32) == (64, 4)
    assert tile(4096, head_dim=576)[0] == triton_decode.WIDE_BLOCK_N


def test_prefill_tile_follows_the_query_length():
    def tile(query_len, head_dim=128):
        launch = triton_prefill.prefill_launch(torch.bfloat16, torch.bfloat16, head_dim,
                                               query_len, SM90)
        return launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"], launch.num_warps

    assert tile(100) == (64, 64, 4)
    assert tile(2048) == (64, 32, 4)  # long queries: fewer keys a step
    assert tile(100, head_dim=256) == (64, 32, 8)  # wide heads: fewer keys, more warps


def _tile(launch):
    c = launch.constexprs
    return c.get("BLOCK_M", c.get("BLOCK_G")), c["BLOCK_N"], launch.num_stages


def test_tiles_shrink_to_the_shared_memory_of_the_gpu():
    f32, bf16 = torch.float32, torch.bfloat16

    def prefill_tile(dtype, head_dim, shared, cache=None):
        return _tile(triton_prefill.prefill_launch(dtype, cache or dtype, head_dim, 100, shared))

    def decode_tile(dtype, head_dim, group, shared, cache=None):
        return _tile(triton_decode.decode_launch(dtype, cache or dtype, head_dim, group, 1,
                                                 4096, shared))

    # float32 on sm_89: one stage, then fewer keys a step; float32 queries over fp8 pages too
    assert prefill_tile(f32, 128, SM90) == (64, 64, 2)
    assert prefill_tile(f32, 128, SM89) == (64, 64, 1)
    assert prefill_tile(f32, 256, SM89) == (64, 16, 1)
    assert prefill_tile(f32, 256, SM89, cache=FP8_DTYPE) == (64, 16, 1)
    assert decode_tile(f32, 256, 2, SM89) == (16, 64, 1)
    # 16-bit tiles are the same on every GPU kvpool compiles for
    for head_dim, group in ((128, 4), (256, 2), (576, 16)):
        assert prefill_tile(bf16, min(head_dim, 256), SM89) == \
            prefill_tile(bf16, min(head_dim, 256), SM90)
        assert decode_tile(bf16, head_dim, group, SM89) == decode_tile(bf16, head_dim, group,
                                                                       SM90)
    # MLA's float32 latents: two stages on sm_90, one on sm_80, none on sm_89
    assert decode_tile(f32, 576, 16, SM90) == (16, 16, 2)
    assert decode_tile(f32, 576, 16, 163 * 1024) == (16, 16, 1)
    with pytest.raises(ValueError, match=r"needs 132160 bytes .* gives 101376: run the model"):
        decode_tile(f32, 576, 16, SM89)
    # past every smaller key block, fewer query rows
    assert prefill_tile(f32, 512, SM89) == (32, 16, 1)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_the_smallest_tiles_match_reference(kind, monkeypatch):
    # What a GPU with little shared memory runs: 16 rows, 16 keys a step, one stage.
    module = triton_prefill if kind == "prefill" else triton_decode
    monkeypatch.setattr(module, "shared_memory", lambda device: 6_000)
    specs = [(70, 40), (33, 1), (16, 16)] if kind == "prefill" else DECODES
    batch = make_batch(specs, heads=2, kv_heads=1, head_dim=32, page_size=16,
                       dtype=torch.float32)
    launch = (triton_prefill.prefill_launch(torch.float32, torch.float32, 32, 40, 6_000)
              if kind == "prefill" else
              triton_decode.decode_launch(torch.float32, torch.float32, 32, 2, 1, 150, 6_000))
    assert _tile(launch) == (16, 16, 1)
    out = prefill(batch) if kind == "prefill" else decode(batch)
    assert relative_error(out, batch.reference()) < 1e-5


@pytest.mark.parametrize(("max_query_len", "block_n"), [(40, 64), (520, 32)], ids=["40", "520"])
def test_prefill_tiles_of_either_size_match_reference(max_query_len, block_n):
    # Long prompts take the long-query tile (LONG_QUERY tokens or more: 32 keys a step) and the
    # unmasked key steps before the diagonal. 520: past LONG_QUERY, its last block of 64 query
    # rows partial (8 rows); the second sequence's query starts past a cached prefix that is
    # not a whole number of key steps (330 or 90 tokens). One head: the heads' grouping is
    # checked by the prefill cases below.
    specs = [(max_query_len, max_query_len), (max_query_len + 70, max_query_len // 2),
             (90, 1)]
    launch = triton_prefill.prefill_launch(torch.float32, torch.float32, 32, max_query_len,
                                           triton_prefill.shared_memory(DEVICE))
    assert launch.constexprs["BLOCK_N"] == block_n  # the tile these shapes are for
    batch = make_batch(specs, heads=1, kv_heads=1, head_dim=32, page_size=16,
                       dtype=torch.float32)
    assert relative_error(prefill(batch), batch.reference()) < 1e-5


# (heads, kv_heads, head_dim, page_size, dtype, window)
PREFILL_CASES = [
    (2, 2, 64, 16, torch.float32, None),
    (4, 1, 128, 5, torch.float32, 17),
    (7, 1, 64, 1, torch.bfloat16, None),
    (4, 1, 64, 16, torch.bfloat16, 4),
    (4, 2, 48, 16, torch.float32, None),  # head_dim padded in the tile: 48 -> 64
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "dtype", "window"),
    PREFILL_CASES,
    ids=["mha-d64-p16-fp32", "gqa4-d128-p5-fp32-window", "gqa7-d64-p1-bf16",
         "gqa4-d64-p16-bf16-window", "gqa2-d48-p16-fp32"],
)
def test_prefill_of_a_mixed_batch_matches_reference(heads, kv_heads, head_dim, page_size, dtype,
                                                    window):
    # MIXED: decode rows, a full prefill, prefill over a cached prefix, a chunk of a chunked
    # prefill, and decodes of one token, one page and several pages, packed together.
    batch = make_batch(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=dtype)
    out = prefill(batch, window=window)
    assert out.dtype == dtype
    assert relative_error(out, batch.reference(window=window)) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [32, 256], ids=["d32", "d256"])
def test_prefill_with_a_window_over_several_query_blocks_matches_reference(head_dim):
    # Query blocks past the first (64 rows from a position of 64 or more) have whole key steps
    # before their first row, yet under a window every step is masked. Heads over 128 wide
    # (Gemma 3's 256) step fewer keys than the 64 query rows: a row may see none of the first
    # step's keys (its window starts past them).
    specs = [(150, 150), (140, 70)]
    launch = triton_prefill.prefill_launch(torch.float32, torch.float32, head_dim, 150,
                                           triton_prefill.shared_memory(DEVICE))
    block_m, block_n = launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"]
    assert block_m == 64 and (block_n < block_m) == (head_dim > 128)  # the tiles meant
    batch = make_batch(specs, heads=1, kv_heads=1, head_dim=head_dim, page_size=16,
                       dtype=torch.float32)
    assert relative_error(prefill(batch, window=20), batch.reference(window=20)) < 1e-5


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_window_of_one_token_attends_to_the_token_itself(kind):
    # The second sequence's queries start at 70, past a whole step of 64 keys.
    specs = [(20, 20), (90, 20)] if kind == "prefill" else DECODES
    batch = make_batch(specs, heads=2, kv_heads=1, head_dim=32, page_size=16,
                       dtype=torch.float32)
    out = prefill(batch, window=1) if kind == "prefill" else decode(batch, window=1)
    assert relative_error(out, batch.reference(window=1)) < 1e-6


def test_chunked_prefill_over_a_cached_prefix_equals_one_prefill():
    whole = make_batch([(90, 90)], heads=4, kv_heads=2, head_dim=64, page_size=5,
                       dtype=torch.float32)
    chunk = make_batch([(90, 90)], heads=4, kv_heads=2, head_dim=64, page_size=5,
                       dtype=torch.float32)
    # The same sequence after 70 cached tokens: its last 20 tokens are the queries.
    chunk.q = chunk.q[70:]
    chunk.q_lens = [20]
    chunk.cu_seqlens_q = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    assert relative_error(prefill(chunk), prefill(whole)[70:].double()) < 1e-6


def test_prefill_ignores_nan_in_unwritten_slots():
    kwargs = dict(heads=2, kv_heads=1, head_dim=64, page_size=16, dtype=torch.float32)
    poisoned = make_batch(MIXED, **kwargs)
    clean = make_batch(MIXED, **kwargs)
    clean.k_cache.nan_to_num_(0.0)
    clean.v_cache.nan_to_num_(0.0)
    assert torch.equal(prefill(poisoned, window=7), prefill(clean, window=7))


# Three sequences of each: paged_attention's choice of kernel (decode when every query is one
# token, else prefill), its bounds and its index tensors do not depend on the batch's size (the
# kernels are checked over DECODES and MIXED above).
@pytest.mark.parametrize("bounds", [False, True], ids=["bounds-read", "bounds-given"])
@pytest.mark.parametrize("specs", [DECODES[:3], MIXED[:3]], ids=["decode", "mixed"])
def test_paged_attention_triton_backend_matches_torch_backend(specs, bounds):
    # mixed: a decode row, a whole prefill and a prefill over a cached prefix; page_size 4:
    # page tables several columns wide
    batch = make_batch(specs, heads=2, kv_heads=1, head_dim=64, page_size=4,
                       dtype=torch.float32)
    kwargs = {}
    if bounds:  # what a captured step passes: bounds above the batch's own lengths
        kwargs = dict(max_seq_len=int(batch.seq_lens.max()) + 7,
                      max_query_len=max(batch.q_lens))

    def attend(page_tables, seq_lens, cu_seqlens_q):
        return paged_attention(batch.q, batch.k_cache, batch.v_cache, page_tables, seq_lens,
                               cu_seqlens_q, backend="triton", sliding_window=30, **kwargs)

    fast = attend(batch.page_tables, batch.seq_lens, batch.cu_seqlens_q)
    reference = batch.attend(backend="torch", sliding_window=30)
    assert relative_error(fast, reference.double()) < 1e-5
    assert relative_error(fast, batch.reference(window=30)) < 1e-5

    # Index tensors that are strided views give the dense ones' result.
    def strided(t):  # the same values, every other element of a wider tensor
        return torch.stack([t, t], dim=-1)[..., 0]

    for i in range(3):
        args = [batch.page_tables, batch.seq_lens, batch.cu_seqlens_q]
        args[i] = args[i].t().contiguous().t() if i == 0 else strided(args[i])
        assert not args[i].is_contiguous()
        assert torch.equal(attend(*args), fast)


def test_paged_attention_passes_the_workspace_to_the_split_decode(monkeypatch):
    monkeypatch.setattr(triton_decode, "choose_num_splits", lambda *args: 2)
    batch = make_batch(DECODES, heads=4, kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float32)
    workspace = Workspace()
    out = batch.attend(backend="triton", workspace=workspace)
    assert [shape for shape, _ in workspace.requests] == [(6, 4, 2, 64), (6, 4, 2)]
    assert relative_error(out, batch.reference()) < 1e-5


def test_write_kv_kernel_writes_exactly_the_given_slots():
    k_cache = torch.full((4, 5, 2, 24), float("nan"), device=DEVICE)
    v_cache = torch.full((4, 5, 2, 24), float("nan"), device=DEVICE)
    slots = torch.tensor([17, 3, 19, 0], device=DEVICE)
    k = torch.randn(4, 2, 24, device=DEVICE)
    v = torch.randn(4, 2, 24, device=DEVICE)
    triton_write.write_kv(k_cache, v_cache, slots, k, v)
    flat_k, flat_v = k_cache.view(-1, 2, 24), v_cache.view(-1, 2, 24)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(20, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_write_kv_kernel_writes_bfloat16_into_strided_caches():
    store = torch.zeros(3, 2, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = store[:, 0], store[:, 1]  # a pool's K and V of one layer: not contiguous
    slots = torch.tensor([40, 2], dtype=torch.int32, device=DEVICE)
    k = torch.randn(2, 2, 64, device=DEVICE).bfloat16()
    v = torch.randn(2, 2, 64, device=DEVICE).bfloat16()
    triton_write.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[2, 8], k[0]) and torch.equal(v_cache[0, 2], v[1])
    assert int((store != 0).sum()) == 4 * 2 * 64


def test_write_kv_kernel_skips_a_slot_outside_the_cache():
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    ones = torch.ones(2, 1, 16, device=DEVICE)
    triton_write.write_kv(k_cache, v_cache, torch.tensor([8, 5], device=DEVICE), ones, ones)
    assert k_cache.view(-1, 16).sum(1).tolist() == [0, 0, 0, 0, 0, 16, 0, 0]


# At real sizes, on a GPU.


# ---- fp8 pages: each kernel against the torch path over the dequantized pages ----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("specs", "num_splits"), [(DECODES, 1), (DECODES, 3), (MIXED, None)],
                         ids=["decode", "decode-split3", "mixed-prefill"])
def test_fp8_pages_equal_the_dequantized_pages(specs, num_splits, dtype):
    batch = make_batch(specs, heads=2, kv_heads=1, head_dim=32, page_size=16, dtype=dtype)
    k8, v8, k_scale, v_scale = fp8_pages(batch)  # unwritten slots stay NaN bytes
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    if num_splits is None:
        out = paged_attention(batch.q, k8, v8, *args, backend="triton", k_scale=k_scale,
                              v_scale=v_scale)
    else:
        out = triton_decode.paged_decode(batch.q, k8, v8, *args, scale=batch.scale, window=None,
                                         num_splits=num_splits,
                                         max_span=int(batch.seq_lens.max()), k_scale=k_scale,
                                         v_scale=v_scale)
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, dtype),
                                  dequantize(v8, v_scale, dtype), *args, backend="torch")
    assert relative_error(out, dequantized.double()) < TIGHT[dtype]
    assert relative_error(out, batch.reference()) < LOOSE


@pytest.mark.parametrize("specs", [DECODES, MIXED], ids=["decode", "mixed"])
def test_softcap_over_fp8_pages_caps_the_scores_k_scale_included(specs):
    # The kernels fold K's scale into the scores: the cap must come after it.
    batch = softcap_batch(specs, device=DEVICE)
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(batch.q, k8, v8, *args, backend="triton", k_scale=k_scale,
                          v_scale=v_scale, softcap=SOFTCAP)
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, torch.float32),
                                  dequantize(v8, v_scale, torch.float32), *args,
                                  backend="torch", softcap=SOFTCAP)
    assert relative_error(out, dequantized.double()) < TIGHT[torch.float32]


@pytest.mark.parametrize(("specs", "num_splits"), [(DECODES, 3), (MIXED, None)],
                         ids=["decode-split3", "mixed"])
def test_sinks_over_fp8_pages_equal_the_dequantized_pages(specs, num_splits):
    batch = make_batch(specs, heads=8, kv_heads=2, head_dim=32, page_size=16,
                       dtype=torch.float32)
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    sinks = sinks_for(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    if num_splits is None:
        out = paged_attention(batch.q, k8, v8, *args, backend="triton", k_scale=k_scale,
                              v_scale=v_scale, sinks=sinks)
    else:
        out = triton_decode.paged_decode(batch.q, k8, v8, *args, scale=batch.scale, window=None,
                                         num_splits=num_splits,
                                         max_span=int(batch.seq_lens.max()), k_scale=k_scale,
                                         v_scale=v_scale, sinks=sinks)
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, torch.float32),
                                  dequantize(v8, v_scale, torch.float32), *args,
                                  backend="torch", sinks=sinks)
    assert relative_error(out, dequantized.double()) < TIGHT[torch.float32]
    assert relative_error(out, batch.reference(sinks=sinks)) < LOOSE


def test_write_kv_kernel_quantizes_as_torch_does():
    # Rounding ties, subnormals, -0.0 and values beyond the range all land on the same bytes.
    k = torch.randn(20, 2, 32, generator=torch.Generator().manual_seed(0)) * 4
    k[0, 0, :6] = torch.tensor([1000.0, -1000.0, 1e-4, -0.0, 0.3125 + 2**-6, -3e-3])
    k = k.to(DEVICE)
    caches = torch.zeros(2, 4, 8, 2, 32, dtype=FP8_DTYPE, device=DEVICE)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:20].to(DEVICE)
    triton_write.write_kv(caches[0], caches[1], slots, k, -k, k_scale=0.05, v_scale=0.1)
    flat = caches.view(torch.uint8).view(2, 32, 2, 32)
    assert torch.equal(flat[0, slots], quantize(k, 0.05).view(torch.uint8))
    assert torch.equal(flat[1, slots], quantize(-k, 0.1).view(torch.uint8))


def test_write_kv_kernel_rounds_exact_ties_to_even_as_torch_does():
    # at a power-of-two scale each value divides exactly onto a midpoint of two e4m3 values
    # (4.25 of 4 and 4.5, 4.75 of 4.5 and 5; subnormals of 2**-9 apart); the even one wins
    halfway = torch.tensor([4.25, 4.75, -4.25, 1.5 * 2**-9, 2.5 * 2**-9, 3.5 * 2**-9])
    k = (halfway * 0.25).view(1, 1, 6).to(DEVICE)
    caches = torch.zeros(2, 1, 4, 1, 6, dtype=FP8_DTYPE, device=DEVICE)
    triton_write.write_kv(caches[0], caches[1], torch.tensor([0], device=DEVICE), k, k,
                          k_scale=0.25, v_scale=0.25)
    stored = caches[0, 0, 0, 0].float().cpu()
    assert stored.tolist() == [4.0, 5.0, -4.0, 2**-8, 2**-8, 4 * 2**-9]
    assert torch.equal(stored, quantize(k, 0.25).float().flatten().cpu())


def test_write_kv_kernel_keeps_nan_as_torch_does():
    # a NaN K/V must not become a large finite value; a GPU may drop a NaN's sign
    k = torch.tensor([[[math.nan, -math.nan, 1.0, math.inf]]], device=DEVICE)
    caches = torch.zeros(2, 1, 4, 1, 4, dtype=FP8_DTYPE, device=DEVICE)
    triton_write.write_kv(caches[0], caches[1], torch.tensor([0], device=DEVICE), k, k,
                          k_scale=0.5, v_scale=0.5)
    stored = caches[0, 0, 0, 0].float()
    assert stored[:2].isnan().all() and stored[2:].tolist() == [2.0, 448.0]


@cuda_only
@pytest.mark.parametrize(("batch_size", "context"), [(64, 1000), (4, 8000)])
def test_decode_matches_torch_path_at_real_sizes(batch_size, context):
    specs = [(context - 7 * b, 1) for b in range(batch_size)]
    batch = make_batch(specs, heads=32, kv_heads=8, head_dim=128, page_size=16,
                       dtype=torch.bfloat16)
    fast = batch.attend(backend="triton")
    reference = batch.attend(backend="torch")
    assert relative_error(fast, reference.double()) < 2e-2


def test_triton_backend_given_one_bound_reads_the_other_from_the_lengths():
    batch = make_batch(DECODES[:3], heads=2, kv_heads=1, head_dim=64, page_size=4,
                       dtype=torch.float32)
    out = batch.attend(backend="triton", max_seq_len=int(batch.seq_lens.max()))
    assert relative_error(out, batch.reference()) < 1e-5


def test_triton_backend_refuses_a_max_query_len_above_max_seq_len():
    batch = make_batch(DECODES[:3], heads=2, kv_heads=1, head_dim=64, page_size=4,
                       dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(
            "need 1 <= max_query_len (40) <= max_seq_len (39) <= 11 pages of 4 tokens")):
        batch.attend(backend="triton", max_seq_len=39, max_query_len=40)


@cuda_only
def test_prefill_matches_torch_path_at_real_sizes():
    specs = [(1500, 1500), (2100, 600), (700, 1), (4000, 512)]
    batch = make_batch(specs, heads=32, kv_heads=8, head_dim=128, page_size=16,
                       dtype=torch.bfloat16)
    fast = batch.attend(backend="triton")
    reference = batch.attend(backend="torch")
    assert relative_error(fast, reference.double()) < 2e-2


@cuda_only
def test_triton_backend_with_bounds_does_not_synchronise():
    batch = make_batch(DECODES, heads=32, kv_heads=8, head_dim=128, page_size=16,
                       dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The bounds a captured step passes: the page tables' capacity, one query token.
        capacity = batch.page_tables.shape[1] * batch.k_cache.shape[1]
        batch.attend(backend="triton", max_seq_len=capacity, max_query_len=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
