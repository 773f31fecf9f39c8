"""fp8 KV pages: quantization bounds, per-layer scales (calibrated or given), attention over fp8
pages in every CPU backend, the cache (prefix hits, copy-on-write, tiers), planning and the
engine option."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvpool.attention import paged_attention, write_kv, write_latent
from kvpool.cache import KVCache
from kvpool.cache.tiers import HostTier
from kvpool.cli.main import main
from kvpool.engine.config import EngineConfig
from kvpool.engine.llm import LLM
from kvpool.engine.params import SamplingParams
from kvpool.kernels import cpu as cpu_kernel
from kvpool.memory import fp8
from kvpool.memory.fp8 import FP8_DTYPE, dequantize, quantize, scale_of
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.models.config import ModelConfig
from kvpool.planning.planner import plan_memory
from test_attention import (  # noqa: F401 (kernel: a fixture)
    MIXED,
    SOFTCAP,
    Batch,
    kernel,
    relative_error,
    sinks_for,
    softcap_batch,
)

FP8_LAYOUT = KVLayout(2, 2, 16, FP8_DTYPE, page_size=4)
# Attention over fp8 pages against the same attention over the dequantized pages: the kernels
# fold the scales into the scores and the output instead of rounding each dequantized value
# to q's dtype, so only rounding differs.
TIGHT = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Against 16/32-bit pages: e4m3 keeps 3 mantissa bits, so each K/V value is off by at most
# 1/16 of itself (half a step); over unit-normal K/V this moves the output by about 4% of its
# largest value (measured), bounded here at 10%.
LOOSE = 0.1


def fp8_pages(batch):
    """The batch's caches as fp8 pages under scales taken from its K/V, with those scales (on
    the caches' device)."""
    device = batch.k_cache.device
    k_scale = scale_of(torch.cat(batch.keys)).to(device)
    v_scale = scale_of(torch.cat(batch.values)).to(device)
    return quantize(batch.k_cache, k_scale), quantize(batch.v_cache, v_scale), k_scale, v_scale


# ---- quantization ----------------------------------------------------------------------------

def test_round_trip_error_is_at_most_half_a_step(device):
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).to(device) * 3
    scale = 0.05  # |x| / scale stays below 448: no value saturates
    error = (dequantize(quantize(x, scale), scale, torch.float32) - x).abs()
    normal = x.abs() / scale >= 2.0**-6
    assert (error[normal] <= x[normal].abs() * 2.0**-4).all()  # 3 mantissa bits
    assert (error[~normal] <= scale * 2.0**-10).all()  # subnormal step 2^-9


def test_values_beyond_the_range_saturate_instead_of_becoming_inf_or_nan(device):
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, 449.0, 1.0], device=device)
    assert quantize(x, 1.0).float().tolist() == [448, -448, 448, -448, 448, 1]


def test_scale_is_the_largest_finite_magnitude_with_headroom(device):
    x = torch.tensor([[0.5, -3.5], [math.nan, math.inf]], device=device)
    assert scale_of(x).item() == pytest.approx(3.5 * 2 / 448)


def test_scale_of_all_zeros_uses_the_amax_floor(device):
    floor = 2.0**-10 * 2 / 448
    assert scale_of(torch.zeros(8, device=device)).item() == pytest.approx(floor)
    assert scale_of(torch.empty(0, 4, device=device)).item() == pytest.approx(floor)  # no value


def test_kv_cache_dtype_names():
    assert fp8.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert fp8.kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE
    with pytest.raises(ValueError, match="'fp8_e5m2'"):
        fp8.kv_cache_dtype("fp8_e5m2", torch.bfloat16)


# ---- layout and pool -------------------------------------------------------------------------

def test_fp8_layout_holds_half_the_bytes_of_bfloat16():
    bf16 = KVLayout(32, 8, 128, torch.bfloat16)
    assert KVLayout(32, 8, 128, FP8_DTYPE).bytes_per_token * 2 == bf16.bytes_per_token


def test_other_8_bit_dtypes_are_refused():
    with pytest.raises(TypeError, match="float8_e5m2"):
        KVLayout(2, 2, 16, torch.float8_e5m2)


def test_first_write_sets_the_layer_scales_and_later_writes_saturate(device):
    pool = KVPool(FP8_LAYOUT, 8, device=device)
    k = torch.full((3, 2, 16), 4.0, device=device)
    pool.write(1, torch.tensor([0, 1, 2], device=device), k, -k / 2)
    assert pool.scales[1].tolist() == pytest.approx([4 * 2 / 448, 2 * 2 / 448])
    assert not pool.scales_ready  # layer 0 has none yet
    pool.write(1, torch.tensor([3], device=device), k[:1] * 100, k[:1])
    assert pool.scales[1, 0].item() == pytest.approx(4 * 2 / 448)  # unchanged
    assert pool.k_cache(1)[0, 3].float().unique().tolist() == [448.0]
    pool.check()


def test_writes_while_calibration_is_paused_set_no_scales():
    pool = KVPool(FP8_LAYOUT, 8, device="cpu")
    with pool.calibration_paused():
        pool.calibrate(0, torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    pool.calibrate(0, torch.full((1, 2, 16), 2.0), torch.ones(1, 2, 16))
    assert pool.scales[0, 0].item() == pytest.approx(2 * 2 / 448)


def test_calibration_resumes_after_a_paused_block_that_raises():
    pool = KVPool(FP8_LAYOUT, 8, device="cpu")
    with pytest.raises(RuntimeError, match="capture failed"), pool.calibration_paused():
        raise RuntimeError("capture failed")
    pool.write(0, torch.tensor([0]), torch.full((1, 2, 16), 2.0), torch.ones(1, 2, 16))
    assert pool.scales[0].tolist() == pytest.approx([2 * 2 / 448, 2 / 448])


def test_a_paused_block_inside_another_leaves_calibration_paused():
    pool = KVPool(FP8_LAYOUT, 8, device="cpu")
    with pool.calibration_paused():
        with pool.calibration_paused():
            pass
        pool.calibrate(0, torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    assert not pool.scales_ready and pool.scales[0].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("shape", [(3, 1), ()])
def test_a_write_whose_slots_are_not_one_dimensional_is_refused_and_sets_no_scales(shape,
                                                                                   device):
    pool = KVPool(FP8_LAYOUT, 8, device=device)
    slots = torch.zeros(shape, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=re.escape(f"slots must be one-dimensional [n], got "
                                                   f"shape {tuple(shape)}")):
        pool.write(0, slots, torch.ones(3, 2, 16, device=device),
                   torch.ones(3, 2, 16, device=device))
    pool.set_scales(0, 0.5, 0.5)  # the layer has none yet


def test_a_write_that_fails_after_its_checks_sets_no_scales(monkeypatch):
    pool = KVPool(FP8_LAYOUT, 8, device="cpu")

    def out_of_memory(*args):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(torch.Tensor, "index_copy_", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.write(0, torch.tensor([0]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    monkeypatch.undo()
    pool.set_scales(0, 0.5, 0.5)


def test_given_scales_are_used_for_every_layer_and_cannot_change(device):
    pool = KVPool(FP8_LAYOUT, 8, device=device, kv_scales=(0.5, 0.25))
    assert pool.scales.tolist() == [[0.5, 0.25], [0.5, 0.25]] and pool.scales_ready
    ones = torch.ones(1, 2, 16, device=device)
    pool.write(0, torch.tensor([5], device=device), ones, ones)
    assert pool.k_cache(0)[1, 1].float().unique().tolist() == [2.0]  # 1 / 0.5
    with pytest.raises(ValueError, match="layer 0 has its scales already"):
        pool.set_scales(0, 1.0, 1.0)
    assert pool.scales[0].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, 1e39, 10**400, 1e-46, 1e-39])
def test_a_scale_that_is_not_a_positive_normal_float32_is_refused_naming_it(bad):
    pool = KVPool(FP8_LAYOUT, 8, device="cpu")
    shown = re.escape(repr(bad))
    with pytest.raises(ValueError, match=f"v_scale must be a positive finite .* got {shown}"):
        pool.set_scales(1, 1.0, bad)
    assert not pool._has_scales[1]
    with pytest.raises(ValueError, match=f"k_scale of layer 0 .* got {shown}"):
        KVPool(FP8_LAYOUT, 8, device="cpu", kv_scales=(bad, 1.0))


def test_scales_are_refused_for_pages_that_are_not_fp8():
    with pytest.raises(ValueError, match="fp8 pages"):
        KVPool(KVLayout(2, 2, 16, torch.bfloat16), 8, device="cpu", kv_scales=(1.0, 1.0))


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf, -math.inf])
def test_check_finds_a_broken_scale(bad):
    pool = KVPool(FP8_LAYOUT, 8, device="cpu", kv_scales=(1.0, 1.0))
    pool.check()
    pool.scales[1, 0] = bad
    with pytest.raises(AssertionError, match=re.escape(f"layer 1 has scales [{bad}, 1.0], not")):
        pool.check()


# ---- attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["torch", "cpu-kernel"])
def test_attention_over_fp8_pages_equals_attention_over_the_dequantized_pages(
        path, dtype, monkeypatch):
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1" if path == "cpu-kernel" else "0")
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=16, dtype=dtype,
                  device="cpu")
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(batch.q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale,
                          backend="cpu")
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, dtype),
                                  dequantize(v8, v_scale, dtype), *args, backend="torch")
    assert relative_error(out, dequantized.double()) < TIGHT[dtype]
    assert relative_error(out, batch.reference()) < LOOSE


@pytest.mark.usefixtures("kernel")
def test_cpu_kernel_reads_every_fp8_byte_exactly():
    # One token: its softmax weight is 1, so the output is its V row read back, times v_scale.
    every_byte = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    v_cache = every_byte.view(1, 1, 1, 256)
    k_cache = torch.zeros_like(v_cache)
    out = cpu_kernel.paged_decode(torch.ones(1, 1, 256), k_cache, v_cache,
                              torch.zeros(1, 1, dtype=torch.int32),
                              torch.ones(1, dtype=torch.int32), 1.0, None,
                              k_scale=1.0, v_scale=0.5)
    torch.testing.assert_close(out.view(256), every_byte.float() * 0.5, rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("scale", [1e30, 1e38, 3.4e38])
def test_cpu_kernel_stays_finite_at_the_largest_scales(scale):
    # K's scale goes on the scores: folded into q, q times a scale near float32's top
    # overflowed, and infinity times a zero byte gave NaN where the torch path gives zeros.
    pages = torch.zeros(3, 4, 1, 16, dtype=FP8_DTYPE)
    k_cache, v_cache = pages, pages.clone()
    write_kv(k_cache, v_cache, torch.arange(10), torch.randn(10, 1, 16) * 1e-30,
             torch.randn(10, 1, 16) * 1e-30, k_scale=scale, v_scale=scale)
    q = torch.randn(1, 2, 16) * 4
    args = (torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))
    outs = [paged_attention(q, k_cache, v_cache, *args, backend=backend, k_scale=scale,
                            v_scale=scale) for backend in ("cpu", "torch")]
    assert outs[0].isfinite().all()
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("path", ["torch", "cpu-kernel"])
def test_softcap_over_fp8_pages_caps_the_scores_k_scale_included(path, monkeypatch):
    # The kernel folds K's scale into the scores: the cap must come after it.
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1" if path == "cpu-kernel" else "0")
    batch = softcap_batch(MIXED)
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(batch.q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale,
                          sliding_window=5, softcap=SOFTCAP, backend="cpu")
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, torch.float32),
                                  dequantize(v8, v_scale, torch.float32), *args,
                                  sliding_window=5, softcap=SOFTCAP, backend="torch")
    assert relative_error(out, dequantized.double()) < 1e-5


@pytest.mark.parametrize("path", ["torch", "cpu-kernel"])
def test_sinks_over_fp8_pages_join_the_softmax_v_scale_included(path, monkeypatch):
    # The kernel folds V's scale into the output: the sink's weight must share its divisor.
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1" if path == "cpu-kernel" else "0")
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float32,
                  device="cpu")
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    sinks = sinks_for(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(batch.q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale,
                          sliding_window=5, sinks=sinks, backend="cpu")
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, torch.float32),
                                  dequantize(v8, v_scale, torch.float32), *args,
                                  sliding_window=5, sinks=sinks, backend="torch")
    assert relative_error(out, dequantized.double()) < 1e-5
    assert relative_error(out, batch.reference(window=5, sinks=sinks)) < LOOSE


def test_sliding_window_over_fp8_pages_in_the_cpu_kernel(monkeypatch):
    monkeypatch.setenv("KVPOOL_CPU_KERNEL", "1")
    batch = Batch(MIXED, heads=8, kv_heads=2, head_dim=64, page_size=4, dtype=torch.float32,
                  device="cpu")
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(batch.q, k8, v8, *args, k_scale=k_scale, v_scale=v_scale,
                          sliding_window=5, backend="cpu")
    dequantized = paged_attention(batch.q, dequantize(k8, k_scale, torch.float32),
                                  dequantize(v8, v_scale, torch.float32), *args,
                                  sliding_window=5, backend="torch")
    assert relative_error(out, dequantized.double()) < 1e-5


def test_write_kv_stores_the_quantized_values(device):
    caches = torch.zeros(2, 4, 4, 2, 16, dtype=FP8_DTYPE, device=device)
    k, v = torch.randn(3, 2, 16, device=device), torch.randn(3, 2, 16, device=device)
    slots = torch.tensor([9, 0, 4], device=device)
    write_kv(caches[0], caches[1], slots, k, v, k_scale=0.01, v_scale=0.02)
    flat = caches.view(torch.uint8).view(2, 16, 2, 16)
    assert torch.equal(flat[0, [9, 0, 4]], quantize(k, 0.01).view(torch.uint8))
    assert torch.equal(flat[1, [9, 0, 4]], quantize(v, 0.02).view(torch.uint8))


def test_fp8_caches_need_both_scales_and_other_caches_take_none(device):
    batch = Batch([(5, 5)], heads=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32,
                  device=device)
    k8, v8, k_scale, _ = fp8_pages(batch)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        paged_attention(batch.q, k8, v8, *args, k_scale=k_scale)
    with pytest.raises(ValueError, match="take no k_scale or v_scale"):
        paged_attention(batch.q, batch.k_cache, batch.v_cache, *args, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        write_kv(k8, v8, torch.tensor([0], device=device), batch.keys[0][:1],
                 batch.values[0][:1])


@pytest.mark.parametrize(("change", "shown"), [
    (lambda scale: scale.double(), "torch.float64 of shape ()"),
    # a rank-5 scale broadcast the dequantized K/V up to rank 5: a wrong answer, no error
    (lambda scale: scale.reshape(1), "torch.float32 of shape (1,)"),
    (lambda scale: scale.reshape(1, 1, 1, 1, 1), "torch.float32 of shape (1, 1, 1, 1, 1)"),
], ids=["float64", "rank-1", "rank-5"])
def test_a_scale_tensor_not_float32_or_not_0_d_is_refused_naming_it(device, change, shown):
    batch = Batch([(5, 2)], heads=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32,
                  device=device)
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    bad = change(k_scale)
    args = batch.page_tables, batch.seq_lens, batch.cu_seqlens_q
    message = f"k_scale must be a number or a float32 tensor [], got {shown}"
    with pytest.raises(ValueError, match=re.escape(f"paged_attention: {message}")):
        paged_attention(batch.q, k8, v8, *args, k_scale=bad, v_scale=v_scale)
    before = k8.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=re.escape(f"write_kv: {message}")):
        write_kv(k8, v8, torch.tensor([0], device=device), batch.keys[0][:1],
                 batch.values[0][:1], k_scale=bad, v_scale=v_scale)
    latent_message = message.replace("k_scale", "scale")
    with pytest.raises(ValueError, match=re.escape(f"write_latent: {latent_message}")):
        write_latent(k8, torch.tensor([0], device=device), batch.keys[0][:1], scale=bad)
    assert torch.equal(k8.view(torch.uint8), before)


@pytest.mark.parametrize("scale", [0.0, math.nan, "1.0"])
def test_write_latent_refuses_a_scale_the_pool_would_not_hold(scale):
    cache = torch.zeros(2, 4, 1, 16, dtype=FP8_DTYPE)
    with pytest.raises((ValueError, TypeError), match="write_latent scale must be a positive "
                                                      "finite number"):
        write_latent(cache, torch.tensor([0]), torch.ones(1, 1, 16), scale=scale)
    assert not cache.view(torch.uint8).any()


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, FP8_DTYPE, torch.float64])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_pages_refuse_q_not_float16_bfloat16_or_float32(backend, dtype):
    # With a softcap an int32 q came back as int32 "attention" of zeros.
    batch = Batch([(5, 1)], heads=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32,
                  device="cpu")
    k8, v8, k_scale, v_scale = fp8_pages(batch)
    with pytest.raises(ValueError, match=re.escape(f"q over fp8 caches must be float16, "
                                                   f"bfloat16 or float32, got {dtype}")):
        paged_attention(batch.q.to(dtype), k8, v8, batch.page_tables, batch.seq_lens,
                        batch.cu_seqlens_q, k_scale=k_scale, v_scale=v_scale, softcap=30.0,
                        backend=backend)


@pytest.mark.parametrize("specs", [[(7, 1)], [(7, 3)]], ids=["decode", "prefill"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_float16_q_reads_fp8_pages_under_a_large_scale_as_float32_q_does(backend, softcap,
                                                                           specs):
    # 448 * 400 is past float16's 65504: K/V dequantized in float16 were inf, the output NaN.
    batch = Batch(specs, heads=2, kv_heads=1, head_dim=16, page_size=4, dtype=torch.float32,
                  device="cpu")
    pages = torch.zeros(3, 4, 1, 16, dtype=FP8_DTYPE)
    k8, v8 = pages, pages.clone()
    slots = torch.arange(7)
    k = torch.linspace(-448, 448, 7 * 16).view(7, 1, 16) * 400.0
    write_kv(k8, v8, slots, k, k.flip(0), k_scale=400.0, v_scale=400.0)
    q = batch.q.half() * 1e-4
    args = torch.tensor([[0, 1]], dtype=torch.int32), batch.seq_lens, batch.cu_seqlens_q
    out = paged_attention(q, k8, v8, *args, k_scale=400.0, v_scale=400.0, softcap=softcap,
                          backend=backend)
    expected = paged_attention(q.float(), k8, v8, *args, k_scale=400.0, v_scale=400.0,
                               softcap=softcap, backend=backend)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected.half())


# ---- cache: pages are bytes ------------------------------------------------------------------

def _write_tokens(cache, seq_id, start, end):
    """Write recognisable K (= position + 1) and V (= -K) for tokens [start, end) of a
    sequence in every layer."""
    slots = torch.tensor(cache.slots(seq_id)[start:end])
    k = torch.arange(start + 1, end + 1, dtype=torch.float32)[:, None, None].expand(-1, 2, 16)
    for layer in range(FP8_LAYOUT.num_layers):
        cache.pool.write(layer, slots, k, -k)


def _read_k(cache, seq_id, layer=0):
    pages = torch.tensor(cache.pages(seq_id))
    k_scale, _ = cache.pool.kv_scales(layer)
    k = dequantize(cache.pool.k_cache(layer)[pages].flatten(0, 1), k_scale, torch.float32)
    return k[: cache.num_tokens(seq_id), 0, 0].tolist()


def test_prefix_hit_and_copy_on_write_keep_fp8_pages_and_their_meaning():
    cache = KVCache(FP8_LAYOUT, 16, device="cpu", prefix_caching=True,
                    kv_scales=(0.125, 0.125))  # 1..11 are exact in e4m3 under it
    cache.add_sequence("a", list(range(10)))
    _write_tokens(cache, "a", 0, 10)
    cache.commit("a")
    assert cache.add_sequence("b", list(range(9))) == 8  # two full pages shared
    cache.fork("a", "c")
    cache.append("c", 1)  # the last page is shared: copied first
    _write_tokens(cache, "c", 10, 11)
    assert _read_k(cache, "b")[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _read_k(cache, "c") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert _read_k(cache, "a") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert cache.stats().num_cow_copies == 1
    cache.check()


def test_a_tier_needs_given_scales_for_fp8_pages():
    with pytest.raises(ValueError, match="need kv_scales given"):
        KVCache(FP8_LAYOUT, 8, device="cpu", prefix_caching=True, tier=HostTier(4))


def test_tier_round_trip_keeps_fp8_pages_under_the_same_scales():
    tier = HostTier(8)
    scales = (0.125, 0.125)
    first = KVCache(FP8_LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier,
                    kv_scales=scales)
    first.add_sequence("a", list(range(9)))
    _write_tokens(first, "a", 0, 9)
    first.commit("a")
    first.free_sequence("a")
    first.prefix_cache.clear()  # the cached pages are gone from the pool, kept by the tier
    second = KVCache(FP8_LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier,
                     kv_scales=scales)
    assert second.add_sequence("b", list(range(9))) == 8
    assert _read_k(second, "b")[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="cannot share it"):
        KVCache(FP8_LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier,
                kv_scales=(1.0, 1.0))


# ---- planning, options, engine ---------------------------------------------------------------

def test_the_plan_holds_twice_the_tokens_of_bfloat16_in_the_same_budget():
    common = dict(device_memory=24 * 2**30, dtype=torch.bfloat16)
    model = ModelConfig.from_hf("Llama-3-8B")
    bf16 = plan_memory(model, **common)
    fp8_plan = plan_memory(model, **common, kv_cache_dtype="fp8_e4m3")
    assert fp8_plan.weight_bytes == bf16.weight_bytes
    assert fp8_plan.budget_bytes == bf16.budget_bytes
    assert fp8_plan.layout.bytes_per_token * 2 == bf16.layout.bytes_per_token
    assert fp8_plan.num_pages in (2 * bf16.num_pages, 2 * bf16.num_pages + 1)


def test_plan_command_takes_kv_cache_dtype(capsys):
    assert main(["plan", "Llama-3-8B", "--device-memory", "24GiB",
                 "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "KV dtype            float8_e4m3fn" in out
    assert "KV bytes per token  65,536 (64.00 KiB)" in out


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of .* got 'fp8'"),
    ({"kv_scales": (1.0, 1.0)}, "apply to fp8 pages"),
    ({"kv_cache_dtype": "fp8_e4m3", "kv_scales": (1.0, -2.0)}, "got -2.0"),
    # fp8 is a KV page dtype, not one the models compute in
    ({"dtype": torch.float8_e4m3fn}, "dtype torch.float8_e4m3fn is not one kvpool's models "
                                     "compute in"),
])
def test_engine_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_engine_generates_with_fp8_pages_and_serves_prefix_hits():
    llm = LLM("tiny", kv_cache_dtype="fp8_e4m3", num_pages=64)
    prompt = list(range(1, 40))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    assert llm.cache.pool.kv.dtype == FP8_DTYPE and llm.cache.pool.scales_ready
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 8
    assert llm.cache.stats().prefix_hit_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.check()


def test_the_start_up_warm_up_sets_no_scales_and_the_first_prefill_does(device):
    llm = LLM("tiny", kv_cache_dtype="fp8_e4m3", num_pages=64, device=device)
    llm.runner.warm_up([2, 40])  # on CUDA the engine has warmed up once already
    assert not llm.cache.pool.scales_ready
    llm.generate([list(range(1, 30))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.cache.pool.scales_ready
    llm.check()


def test_engine_samples_fork_and_copy_fp8_pages_on_write():
    llm = LLM("tiny", kv_cache_dtype="fp8_e4m3", num_pages=64)
    params = SamplingParams(max_tokens=6, temperature=0, n=2, ignore_eos=True)
    (out,) = llm.generate([list(range(1, 22))], params, use_tqdm=False)  # 21: a partial page
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert llm.cache.stats().num_cow_copies == 1
    llm.check()


def test_a_write_to_a_slot_outside_the_pool_sets_no_scales():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=FP8_DTYPE, page_size=4)
    pool = KVPool(layout, 2, device="cpu")
    k = torch.ones(1, 1, 4)
    with pytest.raises(IndexError, match=r"\[0, 12\)"):  # the padding page's slots included
        pool.write(0, torch.tensor([12]), k, k)
    assert not pool.scales_ready


def test_a_write_of_no_token_or_of_misshapen_kv_sets_no_scales_and_writes_nothing():
    pool = KVPool(FP8_LAYOUT, 2, device="cpu")
    before = pool.kv.clone()
    none = torch.empty(0, 2, 16)
    pool.write(0, torch.tensor([], dtype=torch.long), none, none)
    pool.calibrate(0, none, none)
    ones = torch.ones(2, 2, 16)
    for k, v, message in ((ones, ones[:1], r"v must be \[2, 2, 16\], got \[1, 2, 16\]"),
                          (ones[..., :8], ones, r"k must be \[2, 2, 16\], got \[2, 2, 8\]"),
                          (ones, None, "a mha pool writes both K and V")):
        with pytest.raises(ValueError, match=message):
            pool.write(0, torch.tensor([0, 1]), k, v)
    with pytest.raises(ValueError, match="a mha pool writes both K and V"):
        pool.calibrate(0, ones)
    assert not any(pool._has_scales) and torch.equal(pool.kv.view(torch.uint8),
                                                     before.view(torch.uint8))
    pool.write(0, torch.tensor([0]), ones[:1] * 3, ones[:1])  # the first real K/V calibrate
    assert pool.scales[0].tolist() == pytest.approx([3 * 2 / 448, 2 / 448])


def test_fp8_pages_take_fp8_data_only():
    pool = KVPool(FP8_LAYOUT, 2, device="cpu", kv_scales=(0.01, 0.01))
    with pytest.raises(TypeError, match="float8_e4m3fn pages takes data of that dtype"):
        pool.write_pages([0], torch.ones(2, 2, 1, 4, 2, 16))
    pool.write_pages([0], pool.read_pages([1]))


def test_per_layer_scales_reach_each_layer_in_a_cache_of_a_full_and_a_window_pool():
    layout = KVLayout(4, 2, 16, FP8_DTYPE, page_size=4, layer_windows=(None, 8, None, 8))
    scales = [(0.1 * (i + 1), 0.2 * (i + 1)) for i in range(4)]
    cache = KVCache(layout, [8, 8], device="cpu", kv_scales=scales)
    for layer in range(4):
        pool, pool_layer, _ = cache.kv_pools.locate(layer, (None, None))
        assert [x.item() for x in pool.kv_scales(pool_layer)] == pytest.approx(scales[layer])
    with pytest.raises(ValueError, match=r"one per layer \(4\)"):
        KVCache(layout, [8, 8], device="cpu", kv_scales=scales[:2])
