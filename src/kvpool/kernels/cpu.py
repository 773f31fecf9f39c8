"""The fused CPU decode kernel (paged_decode.c): compiled once per machine, loaded with ctypes.

The shared library lands in `$KVPOOL_CACHE_DIR` (default `~/.cache/kvpool`) under a name hashed
from the source, compiler, flags and CPU, written atomically so parallel processes can race.
`KVPOOL_CPU_KERNEL=0` turns the kernel off; without a working C compiler it stays off, with one
warning carrying the compiler's error. The kernel runs on torch's OpenMP thread team when torch
has one (it calls `GOMP_parallel`, already loaded by torch), else on pthreads of its own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from kvpool.kernels.checks import check_index_dtype, check_page_tables

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
VEC = 16  # floats per vector in the kernel; head_dim must be a multiple
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_lock = threading.Lock()


class _Problem(ctypes.Structure):
    """Mirror of the C `Problem` struct, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("k_strides", ctypes.c_int64 * 3),
        ("v_strides", ctypes.c_int64 * 3),
        ("page_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("num_pages", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("sinks", ctypes.c_void_p),
        ("bf16", ctypes.c_int32),
        ("fp8", ctypes.c_int32),
        ("k_scale", ctypes.c_double),
        ("v_scale", ctypes.c_double),
    ]


def compiler() -> list[str] | None:
    """The C compiler command: Python's own CC if it is on PATH, else `cc` or `gcc`; None if
    there is none."""
    configured = shlex.split(sysconfig.get_config_var("CC") or "")
    for command in (configured, ["cc"], ["gcc"]):
        if command and shutil.which(command[0]):
            return command
    return None


def enabled() -> bool:
    """False when the environment turns the kernel off (`KVPOOL_CPU_KERNEL=0`)."""
    return os.environ.get("KVPOOL_CPU_KERNEL", "1") != "0"


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` can take these inputs: enabled and compiled; CPU tensors, q of
    float32 or bfloat16 and the caches of q's dtype or both float8_e4m3fn; head_dim a multiple
    of VEC and dense in the cache; no autograd."""
    tensors = (q, k_cache, v_cache)
    return (
        enabled()
        and all(t.device.type == "cpu" for t in tensors)
        and k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and q.dtype in _DTYPES
        and q.shape[-1] % VEC == 0
        and k_cache.stride(3) == v_cache.stride(3) == 1
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and library() is not None
    )


def paged_decode(q, k_cache, v_cache, page_tables, seq_lens, scale: float, window: int | None,
                 *, softcap: float | None = None, sinks=None, k_scale=None, v_scale=None):
    """Decode attention of `q [batch, num_heads, head_dim]`, one query token per sequence and
    the last of its `seq_lens[b]` tokens, over K/V read straight from the pages (fp8 pages
    through their `k_scale`/`v_scale`, floats or tensors `[]`); scores capped at
    `softcap * tanh(score / softcap)` unless `softcap` is None; `sinks` (float32
    `[num_heads]`, or None) join each head's softmax denominator."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    check_page_tables(page_tables, k_cache.shape[0])  # before narrowing: 2**32 + 1 is not 1
    check_index_dtype("seq_lens", seq_lens)
    q = q.contiguous()
    page_tables = page_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if sinks is not None:
        sinks = sinks.contiguous()
    problem = _Problem(
        q=q.data_ptr(),
        out=out.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        k_strides=(ctypes.c_int64 * 3)(*k_cache.stride()[:3]),
        v_strides=(ctypes.c_int64 * 3)(*v_cache.stride()[:3]),
        page_tables=page_tables.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        table_stride=page_tables.shape[1],
        batch=q.shape[0],
        num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        page_size=k_cache.shape[1],
        num_pages=k_cache.shape[0],
        window=window or 0,
        scale=scale,
        softcap=softcap or 0.0,
        sinks=None if sinks is None else sinks.data_ptr(),
        bf16=_DTYPES[q.dtype],
        fp8=int(fp8),
        k_scale=float(k_scale) if fp8 else 1.0,
        v_scale=float(v_scale) if fp8 else 1.0,
    )
    threads = torch.get_num_threads()
    status = library().kvpool_paged_decode(ctypes.byref(problem), threads, _openmp_parallel())
    if status == -2:
        raise IndexError(f"paged_decode: a page table entry lies outside [0, {k_cache.shape[0]})")
    if status:
        raise MemoryError(f"paged_decode: no memory for scratch of {q.shape[1]} query heads")
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first call; None (after one warning) if it cannot be."""
    command = compiler()
    if command is None:
        warnings.warn("kvpool: no C compiler on PATH; paged decode uses the torch path",
                      RuntimeWarning, stacklevel=2)
        return None
    try:
        with _lock:
            path = _build(command)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        warnings.warn(f"kvpool: compiling {SOURCE.name} failed, paged decode uses the torch "
                      f"path: {detail[-2000:]}", RuntimeWarning, stacklevel=2)
        return None
    lib.kvpool_paged_decode.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int, ctypes.c_void_p]
    lib.kvpool_paged_decode.restype = ctypes.c_int
    return lib


@functools.cache
def _openmp_parallel() -> int | None:
    """Address of `GOMP_parallel` in the OpenMP runtime torch runs its ops on, or None (then
    the kernel starts threads of its own). Sharing torch's thread team matters: its idle
    workers spin for milliseconds after every torch op, and would share the cores with ours."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        return ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None


def _build(command: list[str]) -> Path:
    """Compile SOURCE unless this machine's build is cached; return the library's path."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([
        source, " ".join(command + list(FLAGS)).encode(), _cpu_id().encode(),
    ])).hexdigest()[:16]
    cache_dir = Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")
    path = cache_dir / f"paged_decode-{key}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=path.stem, suffix=".tmp")
    os.close(fd)
    try:
        subprocess.run([*command, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpu_id() -> str:
    """Names the CPU, since -march=native code may not run on another one."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
            return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
