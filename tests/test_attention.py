"""paged_attention and write_kv against a float64 reference on contiguous K/V."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import pytest
import torch

from kvpool import attention
from kvpool.attention import AttentionMetadata, paged_attention, write_kv
from kvpool.kernels import cpu as cpu_kernel
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.rope import Rotation

# (seq_len, q_len) per sequence: decode, full prefill, prefill on a cached prefix, a chunk of a
# chunked prefill (tokens 21..32 of a longer prompt: the rest of its page is unwritten), and
# decodes of one token, of exactly one page, and of several pages.
MIXED = [(37, 1), (20, 20), (45, 9), (33, 12), (1, 1), (16, 1), (64, 1)]


def reference(q, keys, values, q_lens, scale, window=None, softcap=None, sinks=None):
    """Float64 attention, one query at a time over its allowed keys; keys[b]: [seq_len, kvh, d].
    With a softcap each scaled score s is `softcap * tanh(s / softcap)`; with sinks `[heads]`
    head h's softmax takes sinks[h] as one more score, of no value."""
    out, row = [], 0
    group = q.shape[1] // keys[0].shape[1]
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        seq_len = k.shape[0]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            heads = []
            for h in range(q.shape[1]):
                kh = k[lo : pos + 1, h // group].double()
                vh = v[lo : pos + 1, h // group].double()
                scores = kh @ q[row + i, h].double() * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                weights = torch.softmax(scores, dim=0)[: kh.shape[0]]
                heads.append(weights @ vh)
            out.append(torch.stack(heads))
        row += q_len
    return torch.stack(out)


class Batch:
    """A packed batch laid out in a shuffled paged cache, with the contiguous K/V it came from,
    all on `device`. The values come from a CPU generator, so every device gets the same."""

    def __init__(self, specs, *, heads, kv_heads, head_dim, page_size, dtype, device, seed=0,
                 fill=0.0):
        gen = torch.Generator().manual_seed(seed)
        max_pages = max(-(-n // page_size) for n, _ in specs) + 1  # +1: a padding column
        num_pages = sum(-(-n // page_size) for n, _ in specs) + 3  # +3: pages nobody owns
        shape = (num_pages, page_size, kv_heads, head_dim)
        k_cache = torch.full(shape, fill, dtype=dtype)
        v_cache = torch.full(shape, fill, dtype=dtype)
        order = torch.randperm(num_pages, generator=gen).tolist()
        page_tables = torch.full((len(specs), max_pages), order[-1], dtype=torch.int32)
        keys, values = [], []
        for b, (n, _) in enumerate(specs):
            pages = [order.pop(0) for _ in range(-(-n // page_size))]
            page_tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            slots = torch.tensor(
                [pages[t // page_size] * page_size + t % page_size for t in range(n)]
            )
            k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            write_kv(k_cache, v_cache, slots, k, v)
            keys.append(k)
            values.append(v)
        self.q_lens = [q_len for _, q_len in specs]
        starts = [0] + torch.tensor(self.q_lens).cumsum(0).tolist()
        q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
        self.scale = 1 / math.sqrt(head_dim)
        self.device = torch.device(device)
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        self.page_tables = page_tables.to(device)
        self.seq_lens = torch.tensor([n for n, _ in specs], dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.tensor(starts, dtype=torch.int32, device=device)
        self.q = q.to(device)
        self.keys = [k.to(device) for k in keys]
        self.values = [v.to(device) for v in values]

    def attend(self, **kwargs):
        return paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.page_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            **kwargs,
        )

    def reference(self, window=None, scale=None, softcap=None, sinks=None):
        """The float64 reference, on the batch's device."""
        scale = self.scale if scale is None else scale
        return reference(self.q, self.keys, self.values, self.q_lens, scale, window, softcap,
                         sinks)


def relative_error(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def kernel(monkeypatch):
    """The fused CPU decode kernel, switched on. Fails (not skips) if it did not compile: only a
    machine without any C compiler skips."""
    if cpu_kernel.compiler() is None:
        pytest.skip("no C compiler on PATH: the CPU decode kernel cannot be built")
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1")
    assert cpu_kernel.library() is not None, "the CPU decode kernel failed to compile"
    return cpu_kernel


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Runs a test once through the fused CPU kernel and once through the torch path."""
    if request.param == "kernel":
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setenv("KVPOOL_CPU_KERNEL", "0")
    return request.param


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size"),
    [(4, 4, 64, 16), (8, 2, 128, 16), (7, 1, 64, 1), (14, 2, 128, 1)],
    ids=["mha-d64-p16", "gqa4-d128-p16", "gqa7-d64-p1", "gqa7-d128-p1"],
)
@pytest.mark.usefixtures("decode_path")
def test_mixed_batch_matches_reference_in_float32(heads, kv_heads, head_dim, page_size):
    batch = Batch(
        MIXED,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=torch.float32, device="cpu")
    assert relative_error(batch.attend(), batch.reference()) < 1e-5


@pytest.mark.parametrize("window", [1, 4, 17, 100])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.usefixtures("decode_path")
def test_sliding_window_matches_reference(window, page_size):
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=page_size,
                  dtype=torch.float32, device="cpu")
    out = batch.attend(sliding_window=window)
    assert relative_error(out, batch.reference(window=window)) < 1e-5


@pytest.mark.usefixtures("decode_path")
def test_mixed_batch_matches_reference_in_bfloat16():
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=128, page_size=16,
                  dtype=torch.bfloat16, device="cpu")
    out = batch.attend()
    assert out.dtype == torch.bfloat16
    assert relative_error(out, batch.reference()) < 2e-2


@pytest.mark.parametrize(
    "specs",
    [[(24, 1), (40, 1), (16, 1), (33, 1), (50, 1)], [(24, 24), (40, 40), (17, 17)]],
    ids=["decode", "prefill"],
)
@pytest.mark.usefixtures("decode_path")
def test_uniform_batches_match_reference(specs):
    batch = Batch(specs, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    assert relative_error(batch.attend(), batch.reference()) < 1e-5


@pytest.mark.parametrize("window", [None, 7])
def test_decode_split_into_several_groups_matches_reference(monkeypatch, window, device):
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "0")  # groups belong to the torch path
    monkeypatch.setattr(attention, "_DECODE_GROUP_BYTES", 1)  # one sequence per group
    specs = [(24, 1), (40, 1), (3, 1), (33, 1)]
    batch = Batch(specs, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    out = batch.attend(sliding_window=window, backend="torch")
    assert relative_error(out, batch.reference(window=window)) < 1e-5


@pytest.mark.usefixtures("decode_path")
def test_windowed_decode_reads_page_tables_no_wider_than_the_longest_sequence():
    # Window 7: the 64-token sequence sees its last page only (column 3), the 17-token one its
    # two pages; a table of exactly 4 columns leaves no padding column to read past.
    batch = Batch([(64, 1), (17, 1)], heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables = batch.page_tables[:, :4]
    out = batch.attend(sliding_window=7)
    assert relative_error(out, batch.reference(window=7)) < 1e-5


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.usefixtures("decode_path")
def test_nan_in_unused_slots_does_not_change_output(window):
    kwargs = dict(heads=8, kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
    clean = Batch(MIXED, **kwargs, device="cpu").attend(sliding_window=window)
    poisoned = Batch(MIXED, fill=float("nan"), **kwargs, device="cpu")
    poisoned = poisoned.attend(sliding_window=window)
    assert torch.equal(clean, poisoned)


@pytest.mark.usefixtures("decode_path")
def test_explicit_scale_is_used():
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    out = batch.attend(scale=0.3)
    assert relative_error(out, batch.reference(scale=0.3)) < 1e-5


# A cap of 2 on scores of q scaled up 8 times (scores ~8 apart): far from the uncapped
# attention, so the tests below tell a cap applied from one left out.
SOFTCAP, SOFTCAP_SPREAD = 2.0, 8.0


def softcap_batch(specs, dtype=torch.float32, device="cpu", **shape) -> Batch:
    """A GQA batch (8 query heads on 2 kv heads) on `device` whose unwritten slots hold NaN
    and whose scores spread wide enough for SOFTCAP to change every output."""
    batch = Batch(specs, **{**dict(heads=8, kv_heads=2, head_dim=64, page_size=4), **shape},
                  dtype=dtype, device=device, fill=float("nan"))
    batch.q *= SOFTCAP_SPREAD
    return batch


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.usefixtures("decode_path")
def test_softcapped_scores_match_reference(window):
    batch = softcap_batch(MIXED)
    out = batch.attend(sliding_window=window, softcap=SOFTCAP)
    expected = batch.reference(window=window, softcap=SOFTCAP)
    assert relative_error(out, expected) < 1e-5
    assert relative_error(batch.attend(sliding_window=window), expected) > 0.5


@pytest.mark.parametrize("window", [None, 40])
def test_kernel_softcaps_bfloat16_decode_as_the_reference(kernel, monkeypatch, window):
    batch = softcap_batch(DECODES, dtype=torch.bfloat16, page_size=5)
    fused = decode_with("kernel", batch, monkeypatch, sliding_window=window, softcap=SOFTCAP)
    torch_path = decode_with("torch", batch, monkeypatch, sliding_window=window,
                             softcap=SOFTCAP)
    assert relative_error(fused, torch_path.double()) < 2e-2
    assert relative_error(fused, batch.reference(window=window, softcap=SOFTCAP)) < 2e-2


@pytest.mark.usefixtures("decode_path")
def test_a_softcap_bounds_scores_of_a_scale_near_float32s_top():
    # q times such a scale overflows: the scale goes on the scores, where the cap bounds them
    batch = softcap_batch(MIXED)
    out = batch.attend(scale=3e38, softcap=SOFTCAP)
    assert relative_error(out, batch.reference(scale=3e38, softcap=SOFTCAP)) < 1e-5


@pytest.mark.parametrize(("softcap", "error"), [(float("nan"), ValueError), (0.0, ValueError),
                                                (-50.0, ValueError), (1e39, ValueError),
                                                (1e-46, ValueError),  # 0 in float32
                                                ("50", TypeError), (True, TypeError)])
def test_paged_attention_rejects_a_softcap_that_is_not_a_positive_finite_float32(
        device, softcap, error):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(error, match="softcap must be"):
        batch.attend(softcap=softcap)


def sinks_for(batch) -> torch.Tensor:
    """GPT-OSS-like attention sinks for the batch's heads: from below every score to well
    above them, so that they take most of some heads' weight and little of others'."""
    return torch.linspace(-4.0, 6.0, batch.q.shape[1], device=batch.device)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, SOFTCAP)])
@pytest.mark.usefixtures("decode_path")
def test_sinks_join_the_softmax_as_the_reference(window, softcap):
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float32,
                  device="cpu", fill=float("nan"))
    sinks = sinks_for(batch)
    out = batch.attend(sliding_window=window, softcap=softcap, sinks=sinks)
    expected = batch.reference(window=window, softcap=softcap, sinks=sinks)
    assert relative_error(out, expected) < 1e-5
    assert relative_error(batch.attend(sliding_window=window, softcap=softcap), expected) > 0.5


@pytest.mark.parametrize("window", [None, 40])
def test_kernel_takes_sinks_in_bfloat16_decode_as_the_reference(kernel, monkeypatch, window):
    batch = Batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=5,
                  dtype=torch.bfloat16, device="cpu")
    sinks = sinks_for(batch)
    fused = decode_with("kernel", batch, monkeypatch, sliding_window=window, sinks=sinks)
    assert relative_error(fused, batch.reference(window=window, sinks=sinks)) < 2e-2
    assert relative_error(fused, batch.reference(window=window)) > 0.5


@pytest.mark.usefixtures("decode_path")
def test_sinks_strided_or_past_float32s_base_2_range_join_the_softmax_as_the_reference():
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float32,
                  device="cpu", fill=float("nan"))
    strided = torch.stack([sinks_for(batch), torch.full((8,), 100.0)], 1)[:, 0]
    out = batch.attend(sinks=strided)
    assert relative_error(out, batch.reference(sinks=strided)) < 1e-5
    # 3e38 times log2(e) is past float32: the sink takes every head's weight, never NaN
    huge = torch.full((8,), 3e38)
    assert batch.attend(sinks=huge).abs().max() < 1e-30


@pytest.mark.usefixtures("decode_path")
def test_an_infinite_sink_takes_all_its_heads_weight_in_decode_and_prefill_rows():
    # The kernels take an infinite sink as float32's largest; softmax over infinity is NaN.
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float32,
                  device="cpu")
    sinks = sinks_for(batch)
    sinks[0] = math.inf
    out = batch.attend(sinks=sinks)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert relative_error(out[:, 1:], batch.reference(sinks=sinks)[:, 1:]) < 1e-5


@pytest.mark.parametrize("sinks", [torch.zeros(4, dtype=torch.float64), torch.zeros(3),
                                   torch.zeros(1, 4), [0.0] * 4])
def test_paged_attention_rejects_sinks_other_than_float32_per_head(sinks):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"sinks must be a float32 tensor \[4\]"):
        batch.attend(sinks=sinks)


def test_write_kv_writes_exactly_the_given_slots(device):
    k_cache = torch.full((4, 16, 2, 8), float("nan"), device=device)
    v_cache = torch.full((4, 16, 2, 8), float("nan"), device=device)
    slots = torch.tensor([17, 3, 63, 40], device=device)
    k, v = torch.randn(4, 2, 8, device=device), torch.randn(4, 2, 8, device=device)
    write_kv(k_cache, v_cache, slots, k, v)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[slots], k)
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all()
    assert flat_v[untouched].isnan().all()


def test_write_kv_rejects_mismatched_shapes(device):
    cache = torch.zeros(4, 16, 2, 8, device=device)
    k = torch.zeros(2, 3, 8, device=device)
    with pytest.raises(ValueError, match="write_kv expects"):
        write_kv(cache, cache.clone(), torch.tensor([0, 1], device=device), k, k)


def test_paged_attention_rejects_heads_not_a_multiple_of_kv_heads(device):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    q = torch.zeros(8, 6, 64, device=device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(
            q, batch.k_cache, batch.v_cache, batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
        )


def test_paged_attention_rejects_query_longer_than_sequence(device):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    seq_lens = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="q_len <= seq_len"):
        paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.page_tables, seq_lens, batch.cu_seqlens_q
        )


def test_paged_attention_refuses_caches_not_dense_in_head_dim(device):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    strided = torch.zeros(*batch.k_cache.shape[:3], 128, device=device)[..., ::2]
    strided.copy_(batch.k_cache)
    with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype and be dense "
                                         "in head_dim"):
        paged_attention(batch.q, strided, batch.v_cache, batch.page_tables, batch.seq_lens,
                        batch.cu_seqlens_q)


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(0, 16), (1, 0)])
def test_paged_attention_refuses_no_kv_heads_or_an_empty_head_dim(device, kv_heads, head_dim):
    cache = torch.zeros(2, 4, kv_heads, head_dim, device=device)
    with pytest.raises(ValueError, match=r"num_kv_heads and head_dim must be at least 1; got "
                                         rf"q \(1, 2, {head_dim}\)"):
        paged_attention(torch.zeros(1, 2, head_dim, device=device), cache, cache.clone(),
                        torch.zeros(1, 1, dtype=torch.int32, device=device),
                        torch.ones(1, dtype=torch.int32, device=device),
                        torch.tensor([0, 1], dtype=torch.int32, device=device))


def test_paged_attention_refuses_page_tables_of_another_batch_size(device):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    tables = torch.cat([batch.page_tables, batch.page_tables[:1]])
    with pytest.raises(ValueError, match=r"expected page_tables \[batch, max_pages\]"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens,
                        batch.cu_seqlens_q)


def test_paged_attention_refuses_query_rows_past_the_end_of_cu_seqlens_q(device):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    q = torch.cat([batch.q, batch.q[:2]])
    with pytest.raises(ValueError, match=f"cu_seqlens_q must run from 0 to {q.shape[0]}, not "
                                         f"0..{batch.q.shape[0]}"):
        paged_attention(q, batch.k_cache, batch.v_cache, batch.page_tables, batch.seq_lens,
                        batch.cu_seqlens_q)


def test_paged_attention_refuses_a_sequence_without_query_tokens(device):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    cu_seqlens_q = batch.cu_seqlens_q.clone()
    cu_seqlens_q[1:] -= 1  # the first sequence's one query row left out
    with pytest.raises(ValueError, match="each sequence needs 1 <= q_len <= seq_len; q_lens "
                                         r"\[0, 20,"):
        paged_attention(batch.q[1:], batch.k_cache, batch.v_cache, batch.page_tables,
                        batch.seq_lens, cu_seqlens_q)


def test_metadata_keeps_its_field_names(device):
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        page_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device),
    )
    assert meta.seq_lens.tolist() == [1]
    assert (meta.max_seq_len, meta.max_query_len, meta.workspace) == (None, None, None)
    assert [f.name for f in dataclasses.fields(AttentionMetadata)] == [
        "slot_mapping", "page_tables", "seq_lens", "cu_seqlens_q",
        "max_seq_len", "max_query_len", "workspace",
    ]


@pytest.mark.parametrize("window", [0, 2.5, True, 2**70])
def test_paged_attention_rejects_a_window_that_is_not_a_positive_int(device, window):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=f"sliding_window must be an int64 of at least 1 "
                                         f"token, got {window!r}"):
        batch.attend(sliding_window=window)


@pytest.mark.parametrize(("scale", "error"), [(float("nan"), ValueError), (0.0, ValueError),
                                              (-1.0, ValueError), (1e39, ValueError),
                                              ("x", TypeError), (True, TypeError)])
def test_paged_attention_rejects_a_scale_that_is_not_a_positive_finite_float32(device, scale,
                                                                            error):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(error, match="scale must be"):
        batch.attend(scale=scale)


def test_paged_attention_refuses_q_of_another_dtype_than_the_caches(device):
    batch = Batch([(8, 8)], heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    batch.q = batch.q.double()
    with pytest.raises(ValueError, match="q must be in the caches' torch.float32, got "
                                         "torch.float64"):
        batch.attend()


def test_write_kv_refuses_a_v_cache_unlike_the_k_cache_before_writing(device):
    k_cache = torch.zeros(4, 2, 2, 8, device=device)
    q = torch.randn(1, 2, 8, device=device)
    kv = torch.randn(1, 2, 8, device=device)
    cos, sin = torch.ones(1, 1, 4, device=device), torch.zeros(1, 1, 4, device=device)
    slot = torch.tensor([7], device=device)
    for v_cache in (torch.zeros(1, 2, 2, 8, device=device),
                    torch.zeros(4, 2, 2, 8, dtype=torch.float64, device=device)):
        with pytest.raises(ValueError, match="caches .* of one shape and dtype"):
            write_kv(k_cache, v_cache, slot, kv, kv, rotation=Rotation(q.clone(), cos, sin))
        assert not k_cache.any()


def test_write_kv_refuses_slots_that_are_not_one_per_token_before_writing(device):
    k_cache = torch.zeros(4, 16, 2, 8, device=device)
    v_cache = torch.zeros(4, 16, 2, 8, device=device)
    ones = torch.ones(2, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"and slots \[n\]; got k \(2, 2, 8\), v \(2, 2, 8\), "
                                         r"slots \(3,\)"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1, 2], device=device), ones, ones)
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_refuses_a_v_of_another_dtype_than_the_caches(device):
    k_cache = torch.zeros(4, 16, 2, 8, device=device)
    v_cache = torch.zeros(4, 16, 2, 8, device=device)
    ones = torch.ones(2, 2, 8, device=device)
    with pytest.raises(ValueError, match="in the caches' torch.float32, got torch.float32 and "
                                         "torch.bfloat16"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1], device=device), ones, ones.bfloat16())
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("unfit", ["q-float64", "cos-float64", "q-strided"])
def test_write_kv_refuses_a_rotation_unlike_k_before_rotating_q_or_writing(device, unfit):
    caches = torch.zeros(2, 4, 16, 2, 8, device=device)
    kv = torch.randn(2, 2, 8, device=device)
    q = torch.randn(2, 4, 8, device=device)
    cos, sin = torch.rand(2, 1, 4, device=device), torch.rand(2, 1, 4, device=device)
    if unfit == "q-float64":
        q = q.double()
    elif unfit == "cos-float64":
        cos = cos.double()
    else:  # every other channel of a wider tensor: it could not be rotated in place densely
        q = torch.randn(2, 4, 16, device=device)[..., ::2]
    before = q.clone()
    with pytest.raises(ValueError, match="write_kv rotation: "):
        write_kv(caches[0], caches[1], torch.tensor([0, 5], device=device), kv, kv,
                 rotation=Rotation(q, cos, sin))
    assert torch.equal(q, before)
    assert not caches.any()


def test_write_kv_refuses_a_cache_it_cannot_view_before_rotating_q_or_writing():
    # Dense in head_dim (paged_attention reads it) but kv_heads outside page_size: no
    # [slots, kv_heads, head_dim] view, and writing through a copy would drop the write. (On
    # CUDA the Triton write kernel takes such caches.)
    device = "cpu"
    k_cache = torch.zeros(3, 4, 2, 8, device=device)
    v_cache = torch.zeros(3, 2, 4, 8, device=device).transpose(1, 2)
    q = torch.randn(2, 4, 8, device=device)
    before = q.clone()
    cos, sin = torch.rand(2, 1, 4, device=device), torch.rand(2, 1, 4, device=device)
    ones = torch.ones(2, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"write_kv: v_cache \(3, 4, 2, 8\) of strides "
                                         r"\(64, 8, 32, 1\) cannot be viewed"):
        write_kv(k_cache, v_cache, torch.tensor([0, 5], device=device), ones, ones,
                 rotation=Rotation(q, cos, sin))
    assert torch.equal(q, before)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, torch.ones(2)])
def test_write_kv_refuses_fp8_scales_the_pool_would_not_hold(device, scale):
    cache = torch.zeros(4, 2, 2, 8, device=device).to(torch.float8_e4m3fn)
    kv = torch.randn(1, 2, 8, device=device)
    with pytest.raises((ValueError, TypeError), match="k_scale"):
        write_kv(cache, cache.clone(), torch.tensor([1], device=device), kv, kv,
                 k_scale=scale, v_scale=1.0)


# The fused CPU decode kernel (kvpool/kernels): against the torch path, its dispatch and build.

DECODES = [(37, 1), (1, 1), (16, 1), (64, 1), (100, 1), (17, 1)]


def decode_with(path, batch, monkeypatch, **kwargs):
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1" if path == "kernel" else "0")
    return batch.attend(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size"),
    [(4, 4, 64, 16), (8, 2, 128, 16), (7, 1, 64, 1), (14, 2, 128, 1), (8, 2, 64, 5)],
    ids=["mha-d64-p16", "gqa4-d128-p16", "gqa7-d64-p1", "gqa7-d128-p1", "gqa4-d64-p5"],
)
def test_kernel_matches_torch_path_and_reference(
    kernel, monkeypatch, dtype, window, heads, kv_heads, head_dim, page_size
):
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size)
    batch = Batch(DECODES, **shape, dtype=dtype, fill=float("nan"), device="cpu")
    fused = decode_with("kernel", batch, monkeypatch, sliding_window=window)
    torch_path = decode_with("torch", batch, monkeypatch, sliding_window=window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert fused.dtype == dtype
    assert relative_error(fused, torch_path.double()) < tolerance
    assert relative_error(fused, batch.reference(window=window)) < tolerance


def test_kernel_rounds_bfloat16_output_to_nearest_even(kernel):
    # bf16 -> float32 is exact, so the bf16 kernel computes what the float32 one does on the
    # same values; only the final rounding differs, and must match torch's. A zero query
    # averages V rows, whose means often fall halfway between two bf16 numbers (ties).
    specs = [*DECODES, (2, 1), (2, 1)]
    batch = Batch(specs, heads=8, kv_heads=2, head_dim=128, page_size=16,
                  dtype=torch.bfloat16, device="cpu")
    batch.q.zero_()
    args = (batch.page_tables, batch.seq_lens, batch.scale, None)
    bf16 = kernel.paged_decode(batch.q, batch.k_cache, batch.v_cache, *args)
    fp32 = kernel.paged_decode(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), *args)
    assert torch.equal(bf16, fp32.to(torch.bfloat16))


def test_kernel_is_used_for_decode_unless_env_var_is_0(kernel, monkeypatch):
    calls = []
    torch_decode = attention._decode
    monkeypatch.setattr(attention, "_decode", lambda *args: calls.append(1) or torch_decode(*args))
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.attend()
    assert calls == []
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "0")
    batch.attend()
    assert calls == [1]


def test_kernel_is_on_when_the_environment_does_not_mention_it(kernel, monkeypatch):
    monkeypatch.delenv("KVPOOL_CPU_KERNEL")
    calls = []
    torch_decode = attention._decode
    monkeypatch.setattr(attention, "_decode", lambda *args: calls.append(1) or torch_decode(*args))
    batch = Batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    assert kernel.enabled()
    assert relative_error(batch.attend(), batch.reference()) < 1e-5
    assert calls == []


def test_float16_and_odd_head_dims_take_the_torch_path(kernel):
    q = torch.zeros(2, 4, 64)
    assert kernel.supports(q, torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64))
    half = torch.zeros(3, 16, 2, 64, dtype=torch.float16)
    assert not kernel.supports(q.half(), half, half)
    odd = torch.zeros(3, 16, 2, 24)
    assert not kernel.supports(torch.zeros(2, 4, 24), odd, odd)


def test_kernel_takes_no_caches_of_two_dtypes(kernel):
    q = torch.zeros(2, 4, 64)
    f32, bf16 = torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)
    assert kernel.supports(q, f32, f32)
    assert not kernel.supports(q, bf16, f32)
    assert not kernel.supports(q, f32, f32.to(torch.float8_e4m3fn))


def test_kernel_reads_layer_views_of_a_pool(kernel):
    batch = Batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    pool = KVPool(layout, num_pages=batch.k_cache.shape[0] + 4, device="cpu")
    pool.kv.fill_(float("nan"))
    pool.kv[1, 0, : batch.k_cache.shape[0]] = batch.k_cache
    pool.kv[1, 1, : batch.v_cache.shape[0]] = batch.v_cache
    out = paged_attention(
        batch.q, pool.k_cache(1), pool.v_cache(1), batch.page_tables, batch.seq_lens,
        batch.cu_seqlens_q,
    )
    assert relative_error(out, batch.reference()) < 1e-5


def test_kernel_reads_non_contiguous_strided_caches(kernel):
    batch = Batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.bfloat16, device="cpu")
    num_pages, page_size, kv_heads, head_dim = batch.k_cache.shape
    # K: pages interleaved with other data (page stride 3x); V: kv heads 2 apart.
    k_store = torch.full((num_pages, 3, page_size, kv_heads, head_dim), float("nan"), device="cpu")
    k_store = k_store.to(torch.bfloat16)
    k_store[:, 1] = batch.k_cache
    v_store = torch.full((num_pages, page_size, 2 * kv_heads, head_dim), float("nan"), device="cpu")
    v_store = v_store.to(torch.bfloat16)
    v_store[:, :, 1::2] = batch.v_cache
    k_view, v_view = k_store[:, 1], v_store[:, :, 1::2]
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    out = paged_attention(
        batch.q, k_view, v_view, batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    )
    assert relative_error(out, batch.reference()) < 2e-2


@pytest.mark.parametrize("team", ["openmp", "pthreads"])
def test_kernel_output_does_not_depend_on_threads(kernel, monkeypatch, team):
    if team == "pthreads":  # the kernel's own threads, used when torch does not run on OpenMP
        monkeypatch.setattr(kernel, "_openmp_parallel", lambda: None)
    batch = Batch(DECODES, heads=14, kv_heads=2, head_dim=128, page_size=16,
                  dtype=torch.float32, device="cpu")
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            outputs.append(batch.attend(sliding_window=30))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_kernel_rejects_page_ids_outside_the_cache(kernel):
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables[2, 0] = batch.k_cache.shape[0]
    with pytest.raises(IndexError, match="outside"):
        batch.attend()


def test_compile_failure_warns_once_and_falls_back_to_torch(kernel, monkeypatch, tmp_path):
    broken = tmp_path / "paged_decode.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    cpu_kernel.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="compiling paged_decode.c failed"):
            assert cpu_kernel.library() is None
        batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=16,
                      dtype=torch.float32, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            out = batch.attend()
        assert relative_error(out, batch.reference()) < 1e-5
    finally:
        cpu_kernel.library.cache_clear()


def test_kernel_is_built_once_into_the_cache_dir(kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    command = cpu_kernel.compiler()
    path = cpu_kernel._build(command)
    assert path.parent == tmp_path and path.suffix == ".so"
    built = path.stat().st_mtime_ns
    assert cpu_kernel._build(command) == path
    assert path.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left


# Bad inputs (issue 12): a clear typed error naming the numbers, and nothing changed.


# Slots are checked on the CPU only: on CUDA reading them back would synchronise.
def test_write_kv_with_one_slot_out_of_range_writes_nothing():
    k_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    v_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    slots = torch.tensor([17, 3, 64, 40], device="cpu")  # 64 is one past the last slot
    ones = torch.ones(4, 2, 8, device="cpu")
    with pytest.raises(IndexError, match=r"slot 64 \(token 2\) is outside the caches' \[0, 64\)"):
        write_kv(k_cache, v_cache, slots, ones, ones)
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_rejects_a_negative_slot():
    k_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    v_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    ones = torch.ones(2, 2, 8, device="cpu")
    with pytest.raises(IndexError, match="slot -1 "):
        write_kv(k_cache, v_cache, torch.tensor([0, -1], device="cpu"), ones, ones)
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_names_the_first_of_several_slots_outside_the_caches():
    k_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    v_cache = torch.zeros(4, 16, 2, 8, device="cpu")
    ones = torch.ones(3, 2, 8, device="cpu")
    with pytest.raises(IndexError, match=r"slot -1 \(token 1\) is outside"):
        write_kv(k_cache, v_cache, torch.tensor([0, -1, 64], device="cpu"), ones, ones)
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_rejects_float_or_bool_slots_and_a_dtype_unlike_the_caches(device):
    k_cache = torch.zeros(4, 16, 2, 8, device=device)
    v_cache = torch.zeros(4, 16, 2, 8, device=device)
    ones = torch.ones(2, 2, 8, device=device)
    with pytest.raises(TypeError, match="slots must be an integer tensor, got torch.float32"):
        write_kv(k_cache, v_cache, torch.tensor([0.0, 1.0], device=device), ones, ones)
    # bool slots would index as slots 1 and 0
    with pytest.raises(TypeError, match="slots must be an integer tensor, got torch.bool"):
        write_kv(k_cache, v_cache, torch.tensor([True, False], device=device), ones, ones)
    with pytest.raises(ValueError, match="in the caches' torch.float32, got torch.bfloat16"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1], device=device), ones.bfloat16(),
                 ones.bfloat16())
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.usefixtures("decode_path")
def test_page_id_past_int32_is_rejected_not_wrapped():
    # 2**32 + 1 narrowed to int32 is 1: the C kernel used to read page 1.
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    tables = batch.page_tables.long()
    tables[3, 2] = 2**32 + 1
    with pytest.raises(IndexError, match=r"entry \[3, 2\] is page id 4294967297, outside"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens,
                        batch.cu_seqlens_q)


def test_cpu_kernel_rejects_page_id_past_int32_when_called_directly(kernel):
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    tables = batch.page_tables.long()
    tables[0, 0] = 2**32 + 1
    with pytest.raises(IndexError, match="page id 4294967297"):
        kernel.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens,
                            batch.scale, None)


@pytest.mark.usefixtures("decode_path")
def test_negative_page_id_is_named():
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables[2, 1] = -1
    with pytest.raises(IndexError, match=r"entry \[2, 1\] is page id -1, outside the cache's "
                                         r"\[0, "):
        batch.attend()


@pytest.mark.usefixtures("decode_path")
def test_the_first_of_several_page_ids_outside_the_cache_is_named():
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables[1, 0] = batch.k_cache.shape[0]
    batch.page_tables[4, 2] = batch.k_cache.shape[0] + 1
    with pytest.raises(IndexError, match=rf"entry \[1, 0\] is page id {batch.k_cache.shape[0]},"):
        batch.attend()


def test_cpu_kernel_refuses_float_seq_lens_when_called_directly(kernel):
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor, got torch.float32"):
        kernel.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.page_tables,
                            batch.seq_lens.float(), batch.scale, None)


@pytest.mark.usefixtures("decode_path")
def test_float_page_table_is_rejected():
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="page_tables must be an integer tensor, got torch.float32"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.page_tables.float(),
                        batch.seq_lens, batch.cu_seqlens_q)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("index", ["page_tables", "seq_lens", "cu_seqlens_q"])
def test_narrow_integer_index_tensors_are_refused_by_name(backend, index):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    args = dict(page_tables=batch.page_tables, seq_lens=batch.seq_lens,
                cu_seqlens_q=batch.cu_seqlens_q)
    args[index] = args[index].to(torch.int16)
    with pytest.raises(TypeError, match=f"{index} must be int32 or int64, got torch.int16"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, backend=backend, **args)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="the bounded triton path checks page ids on CPU tensors only")
def test_bounded_triton_path_on_cpu_tensors_names_an_out_of_range_page_id():
    pytest.importorskip("triton")
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables[1, 0] = 10**6
    with pytest.raises(IndexError, match=r"entry \[1, 0\] is page id 1000000, outside"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.page_tables,
                        batch.seq_lens, batch.cu_seqlens_q, backend="triton",
                        max_seq_len=int(batch.seq_lens.max()), max_query_len=1)


def test_torch_path_names_an_out_of_range_page_id():
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.page_tables[1, 0] = batch.k_cache.shape[0] + 5
    bad = batch.k_cache.shape[0] + 5
    with pytest.raises(IndexError, match=rf"entry \[1, 0\] is page id {bad}, outside"):
        batch.attend(backend="torch")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_empty_batch_gives_an_empty_output(backend):
    cpu = torch.device("cpu")  # the CPU backends
    k_cache = torch.zeros(4, 16, 2, 64, device=cpu)
    out = paged_attention(
        torch.zeros(0, 8, 64, device=cpu), k_cache, k_cache.clone(),
        torch.zeros(0, 3, dtype=torch.int32, device=cpu),
        torch.zeros(0, dtype=torch.int32, device=cpu),
        torch.zeros(1, dtype=torch.int32, device=cpu), backend=backend,
    )
    assert out.shape == (0, 8, 64) and out.dtype == torch.float32


def test_empty_batch_with_query_tokens_is_rejected(device):
    k_cache = torch.zeros(4, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="an empty batch has no query tokens, got 3"):
        paged_attention(
            torch.zeros(3, 8, 64, device=device), k_cache, k_cache.clone(),
            torch.zeros(0, 3, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )


def test_bounds_below_the_batch_lengths_are_rejected(device):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="max_seq_len 63 is below the batch's 64"):
        batch.attend(max_seq_len=63)
    with pytest.raises(ValueError, match="max_query_len 19 is below the batch's 20"):
        batch.attend(max_query_len=19)


@pytest.mark.parametrize("bound", ["max_seq_len", "max_query_len"])
@pytest.mark.parametrize("value", [64.5, 64.0, True])
def test_bounds_that_are_not_ints_are_rejected_by_name(device, bound, value):
    batch = Batch(MIXED, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(TypeError, match=f"{bound} must be an int or None, got {value!r}"):
        batch.attend(**{bound: value})


# Backend choice.


def test_backends_agree_on_a_mixed_batch(kernel):
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    torch_out, cpu_out = batch.attend(backend="torch"), batch.attend(backend="cpu")
    assert relative_error(cpu_out, torch_out.double()) < 1e-5


def test_backend_none_picks_the_c_kernel_on_the_cpu(kernel, monkeypatch):
    calls = []
    torch_decode = attention._decode
    monkeypatch.setattr(attention, "_decode", lambda *args: calls.append(1) or torch_decode(*args))
    batch = Batch(DECODES, heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    batch.attend()
    assert calls == []
    batch.attend(backend="torch")
    assert calls == [1]


def test_unknown_backend_is_rejected(device):
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="backend must be one of .* got 'cuda'"):
        batch.attend(backend="cuda")


def test_triton_backend_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(attention.triton_support, "triton_installed", lambda: False)
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="triton backend needs the triton package, which is not"):
        batch.attend(backend="triton")


def test_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(attention.triton_support, "triton_installed", lambda: True)
    batch = Batch(DECODES, heads=4, kv_heads=4, head_dim=64, page_size=16,
                  dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        batch.attend(backend="triton")


def test_decode_rows_differentiate_through_the_pages():
    """The torch path serves autograd (the C kernel hands it caches that require grad):
    gradients reach the pages as through plain attention over the gathered K/V."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 4, 2, 32, generator=gen, dtype=torch.float64)
                        .requires_grad_() for _ in range(2))
    q = torch.randn(2, 4, 32, generator=gen, dtype=torch.float64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([7, 5], dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, tables, lens, torch.tensor([0, 1, 2]),
                          backend="torch")
    grads = torch.autograd.grad(out.sum(), (k_cache, v_cache))
    expected = 0
    for b in range(2):
        k = k_cache[tables[b]].flatten(0, 1)[:lens[b]].repeat_interleave(2, dim=1)
        v = v_cache[tables[b]].flatten(0, 1)[:lens[b]].repeat_interleave(2, dim=1)
        weights = torch.einsum("hd,thd->ht", q[b], k).div(32**0.5).softmax(-1)
        expected = expected + torch.einsum("ht,thd->hd", weights, v).sum()
    for ours, theirs in zip(grads, torch.autograd.grad(expected, (k_cache, v_cache)),
                            strict=True):
        assert torch.allclose(ours, theirs)


def test_decode_rows_differentiate_through_pages_with_nan_in_their_unused_slots():
    """Slots past a sequence's length hold anything, NaN included, in the autograd path too."""
    gen = torch.Generator().manual_seed(0)
    caches = torch.randn(2, 4, 4, 2, 32, generator=gen)
    q = torch.randn(2, 4, 32, generator=gen)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([7, 5], dtype=torch.int32)
    poisoned = caches.clone()
    poisoned[:, 1, 3] = poisoned[:, 3, 1:] = float("nan")  # slot 7 of the first, 5..7 of the second
    outs, grads = [], []
    for pages in (caches, poisoned):
        k_cache, v_cache = (c.clone().requires_grad_() for c in pages)
        out = paged_attention(q, k_cache, v_cache, tables, lens, torch.tensor([0, 1, 2]),
                              backend="torch")
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), (k_cache, v_cache)))
    assert outs[1].isfinite().all()
    assert torch.equal(outs[0], outs[1])
    for clean, dirty in zip(grads[0], grads[1], strict=True):
        assert torch.equal(clean, dirty)


def test_the_default_backend_differentiates_through_caches_that_require_grad(kernel):
    """The C kernel records no gradient: caches that need one take the torch path."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 4, 2, 32, generator=gen).requires_grad_()
                        for _ in range(2))
    q = torch.randn(2, 4, 32, generator=gen)
    args = (torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            torch.tensor([7, 5], dtype=torch.int32), torch.tensor([0, 1, 2]))
    assert kernel.supports(q, k_cache.detach(), v_cache.detach())
    grads = [torch.autograd.grad(paged_attention(q, k_cache, v_cache, *args, backend=b).sum(),
                                 (k_cache, v_cache)) for b in (None, "torch")]
    for ours, theirs in zip(*grads, strict=True):
        assert torch.equal(ours, theirs)
