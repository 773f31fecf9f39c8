"""fp8 latent pages for MLA (DeepSeek-V2/V3): one scale per layer for the whole latent, written
quantized and saturating, read dequantized by the absorbed decode and the expanded prefill; the
pool, write_latent, the model and the engine with their bad inputs. The cache's state machine
runs on fp8 latent pages in tests/test_cache_props.py. Without CUDA the Triton decode runs in
Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before triton is first
imported)."""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
import torch

from kvpool.attention import paged_attention, write_latent
from kvpool.cache import KVCache
from kvpool.cache.tiers import HostTier
from kvpool.engine.config import EngineConfig
from kvpool.engine.llm import LLM
from kvpool.kernels import triton_support
from kvpool.memory.fp8 import E4M3_MAX, FP8_DTYPE, dequantize, quantize, scale_of
from kvpool.memory.layout import KVLayout
from kvpool.memory.pool import KVPool
from kvpool.models import mla
from kvpool.models.config import ModelConfig
from kvpool.models.loader import load_model
from models_util import PagedRunner, make_hf_model, prompts, relative_error, save_hf_model
from test_deepseek import CONFIGS, GREEDY, V2_LITE, mixed_batch
from test_models import MAX_TOKENS

LAYOUT = KVLayout(2, 1, 24, FP8_DTYPE, page_size=4, kind="mla")
# A latent scale every layer of the random DeepSeek configs can share: their latents reach
# about 7 in magnitude (2 x 7 / 448 is what calibration would take), this one stores up to 16.
GIVEN_SCALE = 16 / E4M3_MAX


def exactly(message: str) -> str:
    """A pytest `match` pattern for exactly `message`."""
    return f"^{re.escape(message)}$"


# ---- layout and pool -------------------------------------------------------------------------

def test_deepseek_v2_lite_fp8_latent_pages_hold_one_byte_a_value():
    layout = ModelConfig.from_hf(V2_LITE).kv_layout(kv_cache_dtype="fp8_e4m3")
    assert (layout.kind, layout.dtype) == ("mla", FP8_DTYPE)
    assert layout.bytes_per_token == 27 * 576 == 15_552  # half of bf16's 31,104


def test_latent_round_trip_through_the_pool_is_within_half_an_e4m3_step(device):
    pool = KVPool(LAYOUT, 8, device=device)
    latent = torch.randn(20, 1, 24, generator=torch.Generator().manual_seed(0)).to(device) * 3
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:20].to(device)
    pool.write(1, slots, latent)
    assert pool.scales.shape == (2, 1)  # one scale per layer: the latent's
    scale = pool.scales[1, 0]
    assert scale.item() == pytest.approx(latent.abs().max().item() * 2 / 448)
    back = dequantize(pool.k_cache(1).reshape(-1, 1, 24)[slots], scale, torch.float32)
    error = (back - latent).abs()
    normal = latent.abs() / scale >= 2.0**-6
    assert (error[normal] <= latent[normal].abs() * 2.0**-4).all()  # 3 mantissa bits
    assert (error[~normal] <= scale * 2.0**-10).all()  # subnormal step 2^-9
    assert not pool.scales_ready  # layer 0 has none yet
    pool.check()


def test_later_latents_beyond_the_first_ones_range_saturate(device):
    pool = KVPool(LAYOUT, 8, device=device)
    pool.write(0, torch.tensor([0], device=device), torch.full((1, 1, 24), 2.0, device=device))
    pool.write(0, torch.tensor([1], device=device), torch.full((1, 1, 24), -1e6, device=device))
    assert pool.scales[0, 0].item() == pytest.approx(2 * 2 / 448)  # unchanged
    assert pool.k_cache(0)[0, 1].float().unique().tolist() == [-E4M3_MAX]


def test_given_latent_scales_for_every_layer_or_one_per_layer(device):
    assert KVPool(LAYOUT, 4, device=device, kv_scales=0.5).scales.tolist() == [[0.5], [0.5]]
    pool = KVPool(LAYOUT, 4, device=device, kv_scales=[0.5, 0.25])
    assert pool.scales.tolist() == [[0.5], [0.25]] and pool.scales_ready
    k_scale, v_scale = pool.kv_scales(1)
    assert k_scale.item() == v_scale.item() == 0.25  # K and V are both the latent plane
    pool.write(1, torch.tensor([2], device=device), torch.ones(1, 1, 24, device=device))
    assert pool.k_cache(1)[0, 2].float().unique().tolist() == [4.0]  # 1 / 0.25


@pytest.mark.parametrize(("kv_scales", "message"), [
    ((1.0, 1.0, 1.0), "an mla layout's kv_scales must be one latent scale (a number), or one "
                      "per layer (2); got (1.0, 1.0, 1.0)"),
    ([(1.0, 1.0), (1.0, 1.0)], "an mla layout's kv_scales must be one latent scale (a number), "
                               "or one per layer (2); got [(1.0, 1.0), (1.0, 1.0)]"),
    ([1.0, -1.0], "latent_scale of layer 1 must be a positive finite number, got -1.0"),
    (math.nan, "latent_scale of layer 0 must be a positive finite number, got nan"),
])
def test_bad_latent_scales_are_refused_naming_them(kv_scales, message):
    with pytest.raises(ValueError, match=exactly(message)):
        KVPool(LAYOUT, 4, device="cpu", kv_scales=kv_scales)


def test_set_scales_takes_one_latent_scale_and_a_refusal_changes_nothing():
    pool = KVPool(LAYOUT, 4, device="cpu")
    with pytest.raises(TypeError, match=exactly(
            "an mla pool takes latent_scale for each layer, got 2 scales: (0.5, 0.5)")):
        pool.set_scales(0, 0.5, 0.5)
    assert pool.scales.tolist() == [[1.0], [1.0]] and not pool.scales_ready
    pool.set_scales(0, 0.5)
    assert pool.scales.tolist() == [[0.5], [1.0]]


def test_an_mha_pool_refuses_one_number_as_its_scales():
    with pytest.raises(ValueError, match=exactly(
            "kv_scales must be one (k_scale, v_scale) pair, or one per layer (2); got 0.5")):
        KVPool(KVLayout(2, 2, 16, FP8_DTYPE), 4, device="cpu", kv_scales=0.5)


def test_write_latent_stores_the_quantized_latent(device):
    cache = torch.zeros(2, 4, 1, 8, dtype=FP8_DTYPE, device=device)
    latent = torch.randn(3, 1, 8, device=device)
    write_latent(cache, torch.tensor([6, 0, 3], device=device), latent, scale=0.01)
    flat = cache.view(torch.uint8).view(8, 1, 8)
    assert torch.equal(flat[[6, 0, 3]], quantize(latent, 0.01).view(torch.uint8))
    assert torch.count_nonzero(flat[[1, 2, 4, 5, 7]]) == 0


@pytest.mark.parametrize(("dtype", "scale", "message"), [
    (FP8_DTYPE, None, "write_latent: a torch.float8_e4m3fn cache needs a scale; got scale None"),
    (torch.float32, 0.5, "write_latent: a torch.float32 cache takes no scale; got scale 0.5"),
])
def test_write_latent_refuses_a_missing_or_stray_scale_and_writes_nothing(dtype, scale, message,
                                                                        device):
    cache = torch.zeros(2, 4, 1, 8, dtype=dtype, device=device)
    ones = torch.ones(1, 1, 8, device=device)
    with pytest.raises(ValueError, match=exactly(message)):
        write_latent(cache, torch.tensor([1], device=device), ones, scale=scale)
    assert torch.count_nonzero(cache.view(torch.uint8)) == 0


def test_write_latent_refuses_a_latent_of_another_dtype_than_its_16_or_32_bit_cache(device):
    cache = torch.zeros(2, 4, 1, 8, device=device)
    ones = torch.ones(1, 1, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=exactly(
            "write_latent expects latent in the cache's torch.float32, got torch.bfloat16")):
        write_latent(cache, torch.tensor([1], device=device), ones)
    assert not cache.any()


def test_a_tier_keys_latent_pages_on_their_scale():
    tier = HostTier(4)
    KVCache(LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier, kv_scales=0.125)
    KVCache(LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier, kv_scales=0.125)
    with pytest.raises(ValueError, match="cannot share it"):
        KVCache(LAYOUT, 4, device="cpu", prefix_caching=True, tier=tier, kv_scales=0.25)


# ---- attention and the model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def v3_folder(tmp_path_factory):
    return save_hf_model(make_hf_model("v3-yarn", configs=CONFIGS),
                         tmp_path_factory.mktemp("v3-fp8"))


@pytest.fixture(scope="module")
def v3(v3_folder):
    return load_model(v3_folder, device="cpu").model


def test_absorbed_and_expanded_attention_read_fp8_latent_pages_dequantized(v3):
    layer = v3.model.layers[0].self_attn
    q_nope, q_pe, meta, host, cache = mixed_batch(layer)
    scale = scale_of(cache)
    pages = quantize(cache, scale)
    dequantized = dequantize(pages, scale, torch.float32)
    for attend in (layer.attend_absorbed, partial(layer.attend_expanded, host=host),
                   partial(layer.attend, host=host)):
        torch.testing.assert_close(attend(q_nope, q_pe, meta, cache=pages, latent_scale=scale),
                                   attend(q_nope, q_pe, meta, cache=dequantized),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_support.triton_installed(), reason="triton is not installed")
def test_triton_decode_reads_fp8_latent_pages_as_the_torch_path(v3):
    # The call the absorbed decode makes: one KV head, K and V the same latent pages, a head of
    # 48 values (32 + 16, not a power of two), under the latent scale.
    # Triton runs on CUDA, or on the CPU in its interpreter: every tensor on that one device.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = v3.model.layers[0].self_attn
    _, _, meta, _, cache = mixed_batch(layer)
    scale = scale_of(cache).to(device)
    pages = quantize(cache.to(device), scale)
    q = torch.randn(3, layer.num_heads, cache.shape[-1], generator=torch.Generator().manual_seed(2))
    q = q.to(device)
    args = (meta.page_tables.to(device), meta.seq_lens.to(device),
            torch.arange(4, dtype=torch.int32, device=device))
    out = {backend: paged_attention(q, pages, pages, *args, scale=layer.scale, backend=backend,
                                    k_scale=scale, v_scale=scale)
           for backend in ("triton", "torch")}
    assert relative_error(out["triton"], out["torch"]) < 1e-5


def with_given_scale(runner: PagedRunner) -> PagedRunner:
    for layer in range(runner.cache.layout.num_layers):
        runner.cache.pool.set_scales(layer, GIVEN_SCALE)
    return runner


# What is asserted against: the same model on float32 pages whose latents were rounded to
# e4m3 under the same scale before the write, so the bound is float32 rounding's (1e-5). Against
# unrounded pages these random MoE models are no guide: a latent moved by up to 1/16 of itself
# (half an e4m3 step) can change a token's experts, and the logits then moved by 14-98% of their
# largest on the five configs (prefill of 4 prompts).
def test_the_model_on_fp8_pages_computes_as_on_latents_rounded_to_e4m3(v3, monkeypatch):
    batch = prompts(v3.config.vocab_size)
    decode = {seq_id: [7] for seq_id in batch}
    fp8_runner = with_given_scale(PagedRunner(v3, kv_dtype=FP8_DTYPE))
    got = [fp8_runner.step(batch, all_logits=True), fp8_runner.step(decode)]

    def write_rounded(cache, slots, latent, *, scale=None):
        rounded = dequantize(quantize(latent, GIVEN_SCALE), GIVEN_SCALE, latent.dtype)
        write_latent(cache, slots, rounded, scale=scale)

    monkeypatch.setattr(mla, "write_latent", write_rounded)
    runner = PagedRunner(v3)
    expected = [runner.step(batch, all_logits=True), runner.step(decode)]
    for ours, reference in zip(got, expected, strict=True):
        assert relative_error(ours, reference) < 1e-5


# ---- the engine ------------------------------------------------------------------------------

def test_engine_on_fp8_latent_pages_with_prefix_hits_chunks_and_preemption_decodes_as_the_model(
        v3_folder):
    shared = prompts(160, lengths=(24,), seed=2)["seq0"]
    batch = list(prompts(160, lengths=(5, 13, 30, 41), seed=3).values())
    batch += [shared + tail for tail in prompts(160, lengths=(1, 6, 9, 17), seed=4).values()]
    llm = LLM(v3_folder, kv_cache_dtype="fp8_e4m3", kv_scales=GIVEN_SCALE, num_pages=24,
              page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert llm.cache.pool.kv.dtype == FP8_DTYPE
    assert llm.cache.pool.scales.tolist() == [[pytest.approx(GIVEN_SCALE)]] * 3
    assert llm.cache.stats().prefix_hit_tokens > 0 and llm.stats().num_preemptions > 0
    runner = with_given_scale(PagedRunner(llm.model, kv_dtype=FP8_DTYPE, num_pages=256))
    expected = runner.greedy({i: prompt for i, prompt in enumerate(batch)}, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == list(expected.values())
    llm.check()


def test_engine_calibrates_each_layers_latent_scale_from_the_first_prefill(v3_folder):
    llm = LLM(v3_folder, kv_cache_dtype="fp8_e4m3", num_pages=32, page_size=4)
    llm.generate([list(range(1, 30))], GREEDY, use_tqdm=False)
    scales = llm.cache.pool.scales
    assert scales.shape == (3, 1) and llm.cache.pool.scales_ready
    assert all(0 < s < GIVEN_SCALE for s in scales.flatten().tolist())
    llm.check()


@pytest.mark.parametrize(("model", "kv_scales", "message"), [
    ("v3", (1.0, 1.0), "an MLA model's latent pages have one scale per layer: kv_scales must be "
                       "one number, got (1.0, 1.0)"),
    ("tiny", 0.5, "K/V pages have a K and a V scale per layer: kv_scales must be a (k_scale, "
                  "v_scale) pair, got 0.5"),
])
def test_engine_refuses_scales_of_the_other_layout(v3_folder, model, kv_scales, message):
    with pytest.raises(ValueError, match=exactly(message)):
        LLM(v3_folder if model == "v3" else model, kv_cache_dtype="fp8_e4m3",
            kv_scales=kv_scales, num_pages=16)


@pytest.mark.parametrize(("kv_scales", "message"), [
    ((1.0,), "kv_scales must be a (k_scale, v_scale) pair, or one number for MLA latent pages; "
             "got (1.0,)"),
    ((1.0, 1.0, 1.0), "kv_scales must be a (k_scale, v_scale) pair, or one number for MLA "
                      "latent pages; got (1.0, 1.0, 1.0)"),
    (True, "kv_scales must be a (k_scale, v_scale) pair, or one number for MLA latent pages; "
           "got True"),
    (0.0, "latent_scale must be a positive finite number, got 0.0"),
])
def test_engine_options_refuse_a_malformed_scale(kv_scales, message):
    with pytest.raises(ValueError, match=exactly(message)):
        EngineConfig(kv_cache_dtype="fp8_e4m3", kv_scales=kv_scales)
