"""What the Triton kernels share: whether Triton can run here, the GPU's size, dot precision."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def triton_installed() -> bool:
    """Whether the `triton` package can be imported (it is optional)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`), as in tests."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: CUDA, or any under the
    interpreter."""
    return triton_installed() and (device.type == "cuda" or interpreted())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


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
