"""The fused Triton kernels (kvpool/kernels/triton_fused.py, RoPE in triton_write.py) against
the torch code they replace: RMSNorm with the residual add, SiLU-and-mul, and the K/V write that
rotates q and K.

Without CUDA they run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets before triton is first imported), while the torch code runs on the same
CPU tensors: the models choose the kernels on CUDA only (`triton_support.fused_on`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

import torch.nn.functional as F  # noqa: E402

from kvpool.attention import write_kv  # noqa: E402
from kvpool.kernels import triton_fused, triton_support, triton_write  # noqa: E402
from kvpool.memory.fp8 import FP8_DTYPE  # noqa: E402
from kvpool.models.layers import RMSNorm  # noqa: E402
from kvpool.rope import Rotation, apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# One rounding of the output's dtype, plus the float32 sum's order and exp's last bit.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def torch_norm(x, weight, eps, residual=None):
    """What the models run off CUDA: RMSNorm's torch code, on the CPU."""
    norm = RMSNorm(x.shape[-1], eps, x.dtype)
    norm.weight.data = weight.cpu()
    args = (x.cpu(),) if residual is None else (x.cpu(), residual.cpu())
    return norm(*args)


def close(actual, expected, dtype):
    expected = expected.to(actual.device)
    scale = expected.float().abs().max().clamp(min=1.0)
    return ((actual.float() - expected.float()).abs().max() / scale).item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [256, 48])
def test_rms_norm_matches_the_torch_norm(dtype, size):
    torch.manual_seed(0)
    x = (3 * torch.randn(5, size)).to(dtype).to(DEVICE)
    weight = torch.randn(size).to(dtype).to(DEVICE)
    out = triton_fused.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert close(out, torch_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_adds_the_residual_first_and_returns_the_sum(dtype):
    torch.manual_seed(1)
    x, residual = (torch.randn(2, 7, 96).to(dtype).to(DEVICE) for _ in range(2))
    weight = torch.randn(96).to(dtype).to(DEVICE)
    normed, summed = triton_fused.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_summed = torch_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed.cpu(), expected_summed)  # one rounding of one add: exact
    assert close(normed, expected_normed, dtype)


def differing_share(actual, expected):
    """The share of values whose bits differ from torch's. A rounding left out (a product
    taken in float32 where torch rounds it to the dtype first) changes about a quarter of
    16-bit values; the float32 sum's order and exp's last bit, a few in ten thousand."""
    return (actual.cpu() != expected).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_rounds_the_norm_to_the_input_dtype_before_the_weight(dtype):
    torch.manual_seed(3)
    x = (3 * torch.randn(8, 256)).to(dtype).to(DEVICE)
    weight = torch.randn(256).to(dtype).to(DEVICE)
    out = triton_fused.rms_norm(x, weight, 1e-5)
    assert differing_share(out, torch_norm(x, weight, 1e-5)) < 0.02


def test_rms_norm_adds_eps_under_the_root():
    # Rows of mean square 1e-4 under eps 1e-2: eps sets the scale, ten times smaller.
    torch.manual_seed(4)
    x = (1e-2 * torch.randn(3, 64)).to(DEVICE)
    weight = torch.randn(64).to(DEVICE)
    for residual in (None, torch.zeros_like(x)):
        out = triton_fused.rms_norm(x, weight, 1e-2, residual)
        normed = out if residual is None else out[0]
        assert close(normed, torch_norm(x, weight, 1e-2), torch.float32)


def test_rms_norm_of_no_rows_is_empty():
    x = torch.empty(0, 64, device=DEVICE)
    normed, summed = triton_fused.rms_norm(x, torch.ones(64, device=DEVICE), 1e-5, x)
    assert normed.shape == summed.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_torch_across_several_blocks(dtype):
    torch.manual_seed(2)
    size = triton_fused.SILU_BLOCK + 300  # two programs a row, the second partly masked
    gate, up = ((4 * torch.randn(3, size)).to(dtype).to(DEVICE) for _ in range(2))
    out = triton_fused.silu_mul(gate, up)
    assert out.dtype == dtype
    assert close(out, F.silu(gate.cpu()) * up.cpu(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_rounds_the_activation_to_the_input_dtype_before_the_product(dtype):
    torch.manual_seed(5)
    gate, up = ((4 * torch.randn(8, 256)).to(dtype).to(DEVICE) for _ in range(2))
    out = triton_fused.silu_mul(gate, up)
    assert differing_share(out, F.silu(gate.cpu()) * up.cpu()) < 0.02


def caches(num_pages, page_size, kv_heads, head_dim, dtype):
    """NaN-filled K and V caches on DEVICE (fp8 ones zero: e4m3 NaN is one byte value)."""
    fill = 0.0 if dtype == FP8_DTYPE else float("nan")
    return tuple(torch.full((num_pages, page_size, kv_heads, head_dim), fill,
                            dtype=torch.float32, device=DEVICE).to(dtype) for _ in range(2))


def rotation_inputs(tokens, heads, kv_heads, head_dim, rotary_dim, dtype, seed=0):
    """q, k, v and the cos/sin of random positions, in `dtype` on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=generator)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator)
    positions = torch.randint(0, 4096, (tokens,), generator=generator).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = positions[:, None] * inv_freq
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return tuple(t.to(dtype).to(DEVICE) for t in (q, k, v, cos, sin))


# (heads, kv_heads, head_dim, rotary_dim, dtype, cache dtype)
ROTATION_CASES = [
    (8, 2, 64, 64, torch.float32, torch.float32),
    (4, 4, 32, 16, torch.float32, torch.float32),  # partial rotary
    (6, 2, 32, 24, torch.bfloat16, torch.bfloat16),  # 3/4 rotary (Phi-4-mini's), 12 angles
    (14, 2, 128, 128, torch.bfloat16, torch.bfloat16),
    (6, 3, 48, 48, torch.float16, torch.float16),  # head_dim not a power of two
    (8, 2, 64, 64, torch.bfloat16, FP8_DTYPE),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim", "dtype", "cache"),
                         ROTATION_CASES,
                         ids=["gqa4-fp32", "partial-fp32", "three-quarters-bf16",
                              "gqa7-d128-bf16", "d48-fp16",
                              "fp8-pages"])
def test_write_with_rotation_stores_what_torch_stores(heads, kv_heads, head_dim, rotary_dim,
                                                      dtype, cache):
    tokens, page_size = 9, 4
    q, k, v, cos, sin = rotation_inputs(tokens, heads, kv_heads, head_dim, rotary_dim, dtype)
    slots = torch.tensor([3, 0, 17, 5, 6, 30, 12, 1, 22], device=DEVICE)
    scales = {"k_scale": 0.02, "v_scale": 0.03} if cache == FP8_DTYPE else {}
    fused_caches = caches(9, page_size, kv_heads, head_dim, cache)
    fused_q = q.clone()
    triton_write.write_kv(*fused_caches, slots, k, v, rotation=Rotation(fused_q, cos, sin),
                          **scales)
    torch_caches = tuple(c.cpu() for c in caches(9, page_size, kv_heads, head_dim, cache))
    torch_q = q.cpu().clone()
    write_kv(*torch_caches, slots.cpu(), k.cpu(), v.cpu(),
             rotation=Rotation(torch_q, cos.cpu(), sin.cpu()), **scales)
    assert torch.equal(fused_q.cpu(), torch_q)
    for fused, expected in zip(fused_caches, torch_caches, strict=True):
        # Same bits: the products and sums round as torch rounds them; NaN in unwritten slots.
        assert torch.equal(fused.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_write_with_rotation_reads_strided_cos_and_sin():
    q, k, v, cos, sin = rotation_inputs(5, 4, 2, 32, 32, torch.float32, seed=2)
    wide = torch.zeros(5, 1, 48, device=DEVICE)
    wide[..., 1:33:2] = sin  # sin at another row stride than cos, and strided in its last dim
    sin = wide[..., 1:33:2]
    slots = torch.tensor([0, 3, 5, 6, 1], device=DEVICE)
    fused_caches, fused_q = caches(2, 4, 2, 32, torch.float32), q.clone()
    triton_write.write_kv(*fused_caches, slots, k, v, rotation=Rotation(fused_q, cos, sin))
    torch_caches = tuple(c.cpu() for c in caches(2, 4, 2, 32, torch.float32))
    torch_q = q.cpu().clone()
    write_kv(*torch_caches, slots.cpu(), k.cpu(), v.cpu(),
             rotation=Rotation(torch_q, cos.cpu(), sin.cpu().contiguous()))
    assert torch.equal(fused_q.cpu(), torch_q)
    assert torch.equal(fused_caches[0].cpu().nan_to_num(), torch_caches[0].nan_to_num())


def test_write_with_rotation_rotates_q_even_where_the_slot_is_skipped():
    q, k, v, cos, sin = rotation_inputs(2, 4, 2, 32, 32, torch.float32, seed=3)
    k_cache, v_cache = caches(2, 4, 2, 32, torch.float32)
    rotated = q.clone()
    triton_write.write_kv(k_cache, v_cache, torch.tensor([-1, 2], device=DEVICE), k, v,
                          rotation=Rotation(rotated, cos, sin))
    assert torch.equal(rotated.cpu(), apply_rotary(q.cpu(), cos.cpu(), sin.cpu()))
    assert k_cache.isnan().sum() == k_cache.numel() - 2 * 32  # only slot 2 written


def test_write_kv_refuses_a_rotation_that_does_not_fit_k():
    q, k, v, cos, sin = rotation_inputs(3, 4, 2, 32, 32, torch.float32)
    k_cache, v_cache = caches(2, 4, 2, 32, torch.float32)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"q must be \[3, heads, 32\]"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1, 2], device=DEVICE), k, v,
                 rotation=Rotation(q[:2], cos, sin))
    with pytest.raises(ValueError, match="rotary_dim <= 32"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1, 2], device=DEVICE), k, v,
                 rotation=Rotation(q, cos.repeat(1, 1, 2), sin.repeat(1, 1, 2)))
    assert torch.equal(k_cache.isnan(), before.isnan())


def test_fused_kernels_run_on_cuda_only():
    # Under the interpreter too, CPU tensors take the torch code: the kernels are its stand-in.
    assert not triton_support.fused_on(torch.device("cpu"))


def test_a_decoder_through_the_fused_kernels_generates_the_torch_tokens(monkeypatch):
    # The models' one dispatch point switched on for DEVICE (the CPU runs the kernels in the
    # interpreter): every norm, SwiGLU gate and K/V write of the tiny Llama takes its kernel.
    from kvpool.engine import LLM, SamplingParams

    calls = []

    def counted(module, name):
        kernel = getattr(module, name)

        def launch(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, launch)

    for module, name in ((triton_fused, "rms_norm"), (triton_fused, "silu_mul"),
                         (triton_write, "write_kv")):
        counted(module, name)
    prompts = [[5, 17, 99, 3], [7, 8]]
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(triton_support, "fused_on", lambda device, dtype=None, on=fused: on)
        llm = LLM("tiny", device=DEVICE, num_pages=32, enforce_eager=True)
        calls.clear()  # on CUDA the engine's start-up warm-up ran two forwards of its own
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        runs[fused] = [out.outputs[0].token_ids for out in outputs]
        assert bool(calls) == fused
    assert runs[True] == runs[False]
    # Per forward of 4 layers: 8 norms and 1 final, 4 gates, 4 writes (3 forwards).
    assert [calls.count(name) for name in ("rms_norm", "silu_mul", "write_kv")] == [27, 12, 12]
