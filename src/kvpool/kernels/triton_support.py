"""What the Triton kernels share: whether Triton can run here, the GPU's size and shared
memory, dot precision, the attention tiles that fit, and the `Launch` each launcher compiles
its kernel with."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from kvpool.memory.fp8 import is_fp8

# Triton compiles float8_e4m3fn (its fp8e4nv) for sm_89 and later only (Ada, Hopper, ...).
FP8_MIN_ARCH = 89
# Shared memory one program may take (bytes) under the interpreter: sm_90's, so that the tiles
# interpreted are the ones an H100 runs.
INTERPRETED_SHARED = 227 * 1024
MIN_TILE = 16  # tl.dot's smallest tile side


@dataclass(frozen=True, slots=True)
class Launch:
    """How one kernel launch is compiled: its constexpr arguments and compile options. Each
    launcher takes its Launch from one function of its module, which the ahead-of-time compile
    (kvpool.kernels.triton_variants) calls too, so every variant a launcher makes is compiled
    in CI."""

    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    fp_fusion: bool = True  # False: a * b + c rounds twice, as torch's separate kernels do

    def options(self) -> dict[str, object]:
        """The compile options."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages,
                "enable_fp_fusion": self.fp_fusion}

    def kwargs(self) -> dict[str, object]:
        """The launch's keyword arguments: the constexprs and the compile options."""
        return {**self.constexprs, **self.options()}


def triton_installed() -> bool:
    """Whether the `triton` package can be imported (it is optional)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`), as in tests."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compiles_fp8(arch: int) -> bool:
    """Whether Triton compiles the fp8 kernels for compute capability `arch` (90 for sm_90)."""
    return arch >= FP8_MIN_ARCH


def runs_on(device: torch.device, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the Triton kernels can run on tensors of `device` with pages of `cache_dtype`:
    CUDA (fp8 pages from sm_89 on), or any under the interpreter."""
    if not triton_installed():
        return False
    if interpreted():
        return True
    if device.type != "cuda":
        return False
    return cache_dtype is None or not is_fp8(cache_dtype) or compiles_fp8(_cuda_arch(device))


def fused_on(device: torch.device, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the fused Triton kernels (the K/V write with RoPE, RMSNorm with the residual
    add, SiLU-and-mul) run for tensors on `device` (and pages of `cache_dtype`): on CUDA
    where Triton runs. Everywhere else, the CPU included, the torch code they replace runs.
    The one place that chooses between them."""
    return device.type == "cuda" and runs_on(device, cache_dtype)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_arch(device: torch.device) -> int:
    major, minor = _cuda_capability(_index(device))
    return 10 * major + minor


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(_index(device))


@functools.cache
def _cuda_shared(index: int) -> int:
    import triton  # optional: only where a CUDA device runs the kernels

    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may take on `device`, the limit Triton launches
    against: the opt-in maximum per block on CUDA (99 KiB on sm_86 and sm_89, 163 on sm_80,
    227 on sm_90); INTERPRETED_SHARED elsewhere."""
    if device.type != "cuda":
        return INTERPRETED_SHARED
    return _cuda_shared(_index(device))


def tile_bytes(rows: int, block_n: int, block_d: int, stages: int, dtype: torch.dtype) -> int:
    """Shared memory an attention program takes, at most (bytes): its `rows x block_d` query
    tile, `stages` buffered `block_n x block_d` key tiles and its `rows x block_n` scores, in
    `dtype`, the dtype its dots multiply, and a float32 a row for the softmax's reductions. An
    upper bound of what Triton's compiler allocates, equal to it in float32
    (tests/test_triton_compile.py checks the variants it compiles)."""
    tiles = rows * block_d + stages * block_n * block_d + rows * block_n
    return dtype.itemsize * tiles + 4 * rows


def fitting_tile(rows: int, block_n: int, block_d: int, dtype: torch.dtype, shared: int, *,
                 min_rows: int) -> tuple[int, int, int]:
    """The largest tile within `shared` bytes (`tile_bytes`), as (rows, block_n, stages):
    the tile asked for with two pipeline stages, else one, then half the keys a step down to
    MIN_TILE, then half the rows down to `min_rows`. Raises ValueError naming the bytes when
    even the smallest does not fit."""
    while True:
        for stages in (2, 1):
            if tile_bytes(rows, block_n, block_d, stages, dtype) <= shared:
                return rows, block_n, stages
        if block_n > MIN_TILE:
            block_n //= 2
        elif rows > min_rows:
            rows //= 2
        else:
            need = tile_bytes(rows, block_n, block_d, 1, dtype)
            raise ValueError(
                f"attention over {block_d}-wide {dtype} tiles needs {need} bytes of shared "
                f"memory a program at its smallest tile, and this GPU gives {shared}: run the "
                f"model in bfloat16 or float16")


def dot_precision(dtype: torch.dtype) -> str:
    """How the kernels' `tl.dot` multiplies tiles of a `dtype` cache: "ieee" in full float32
    (float32 caches: TF32 would lose three digits), "native" for 16-bit tiles with float32
    accumulation, or "upcast" (16-bit tiles widened to float32 first) under the interpreter,
    whose dot of bfloat16 tiles is wrong (numpy has no bfloat16). Widening is exact, so both
    16-bit forms multiply the same numbers."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if interpreted() else "native"


def scale_args(k_cache: torch.Tensor, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' K and V scale arguments: float32 tensors `[]` on the cache's device (a
    float becomes one); for caches without scales the cache itself, which no kernel reads
    as a scale (their FP8 switch is off)."""
    if k_scale is None:
        return k_cache, k_cache
    return tuple(s if isinstance(s, torch.Tensor)
                 else torch.tensor(s, dtype=torch.float32, device=k_cache.device)
                 for s in (k_scale, v_scale))
