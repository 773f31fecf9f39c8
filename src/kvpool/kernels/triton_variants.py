"""Every Triton kernel variant kvpool launches, compiled ahead of time for real GPUs with no GPU.

A variant is one kernel with the constexprs and options its launcher picks (the launcher's own
`*_launch` function gives them) and the argument types and 16-byte alignments a launch passes.
`variants()` walks what the launchers choose from: the query dtypes, fp8 pages or not, every
split count, softcapped scores or attention sinks or neither (Gemma 2's cap, GPT-OSS's sinks;
in bfloat16 only, the dtype of their checkpoints: their code is the same in every dtype), and
the head geometries of the model
families kvpool runs, for sm_80, sm_89 and sm_90, each at its shared memory (sm_86 gives
sm_89's and compiles sm_80's code);
`compile_variant` runs Triton's compiler (to cubin, with the ptxas of the triton wheel). Used by
tests/test_triton_compile.py and benchmarks/kernels.py.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia_compiler
from triton.compiler import ASTSource

from kvpool.kernels import (
    MAX_DECODE_SPLITS,
    triton_decode,
    triton_fused,
    triton_prefill,
    triton_write,
)
from kvpool.kernels.triton_support import Launch, compiles_fp8, tile_bytes
from kvpool.memory.fp8 import FP8_DTYPE

ARCHS = (80, 89, 90)  # A100; L4, L40S, RTX 4090; H100/H200
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # bf16 first: what models run in
# Most shared memory one program may take (bytes): the opt-in maximum per block, which the
# launchers size their tiles to (triton_support.shared_memory).
MAX_SHARED = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


class Geometry(NamedTuple):
    """The head shape of a model family, which the kernels' constexprs depend on."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # what RMSNorm normalises
    latent: bool = False  # MLA latent pages: decode only (the absorbed path), no write_kv


GEOMETRIES = (
    Geometry("tiny", 8, 2, 32, 256),  # the built-in preset
    Geometry("llama3", 32, 8, 128, 4096),  # Llama 3 8B; Qwen3, Mistral, Bamba: same constexprs
    Geometry("gemma3", 8, 4, 256, 2560),  # Gemma 3 4B; Gemma 2 2B's heads too
    Geometry("mla-v2-lite", 16, 1, 576, 2048, latent=True),  # DeepSeek-V2-Lite: 512 + rope 64
    Geometry("mla-v3", 128, 1, 576, 7168, latent=True),  # DeepSeek-V3
)

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          FP8_DTYPE: "fp8e4nv", torch.int32: "i32", torch.int64: "i64"}
_FLOATS = ("scale_log2", "softcap", "eps")
# Integers compiled as any value: per model (window, group) or per step (the kernels do not
# specialise on those: tests/test_triton_compile.py).
UNALIGNED = ("window", "group", "num_splits", "stride_table")
_SHAPES = ("NUM_KV_HEADS", "HEAD_DIM", "BLOCK_H", "BLOCK_D", "BLOCK_G", "BLOCK_M", "BLOCK_N",
           "NUM_HEADS", "BLOCK_QH", "ROTARY_DIM", "BLOCK")


@dataclass(frozen=True, slots=True)
class Variant:
    """One kernel compiled as a launcher launches it; `name` says which launch (an id)."""

    name: str
    arch: int
    kernel: triton.runtime.JITFunction
    launch: Launch
    pointers: dict[str, torch.dtype]  # pointer arguments and their element dtypes

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__

    def branches(self) -> tuple:
        """What picks the kernel's code paths, shapes aside: the arch, the kernel, its
        constexprs other than tile sizes and head shape (fp8, precision, split, residual),
        whether it rotates, and its pipeline stages (which set its shared memory)."""
        flags = {k: v for k, v in self.launch.constexprs.items() if k not in _SHAPES}
        rotates = self.launch.constexprs.get("ROTARY_DIM", 0) > 0
        return (self.arch, self.kernel_name, tuple(sorted(flags.items())), rotates,
                self.launch.num_stages)

    def key(self) -> tuple:
        """What it compiles, but the arch: its kernel, launch and pointer dtypes."""
        return (self.kernel_name, repr(self.launch),
                tuple(sorted((k, str(v)) for k, v in self.pointers.items())))

    def tile_bytes(self) -> int:
        """The shared memory its launcher sized the tile for (`triton_support.tile_bytes`):
        an attention kernel's; 0 for the others, which hold no tiles."""
        c = self.launch.constexprs
        rows = c.get("BLOCK_M", c.get("BLOCK_G"))
        if rows is None or "BLOCK_N" not in c:
            return 0
        compute = self.pointers["q"] if c["FP8"] else self.pointers["k_cache"]
        return tile_bytes(rows, c["BLOCK_N"], c["BLOCK_D"], self.launch.num_stages, compute)

    def source(self) -> ASTSource:
        """The kernel with this variant's argument types, 16-byte alignments and constexprs:
        pointers and strides aligned (head dims here are multiples of 16, pages of 16 tokens),
        the other integers not."""
        signature, attrs = {}, {}
        for i, arg in enumerate(self.kernel.arg_names):
            if arg in self.launch.constexprs:
                signature[arg] = "constexpr"
                continue
            if arg in self.pointers:
                signature[arg] = "*" + _TYPES[self.pointers[arg]]
            else:
                signature[arg] = "fp32" if arg in _FLOATS else "i32"
            if arg not in _FLOATS and arg not in UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
        return ASTSource(self.kernel, signature, dict(self.launch.constexprs), attrs)


def compile_variant(variant: Variant):
    """The variant compiled for its GPU (a triton CompiledKernel with its cubin)."""
    return triton.compile(variant.source(), target=GPUTarget("cuda", variant.arch, 32),
                          options=variant.launch.options())


def variants() -> list[Variant]:
    """Every distinct variant the launchers make, for each of ARCHS (fp8 pages where Triton
    compiles them), in a stable order."""
    found: dict[tuple, Variant] = {}
    for arch in ARCHS:
        for dtype in DTYPES:
            for fp8 in (False, True) if compiles_fp8(arch) else (False,):
                cache = FP8_DTYPE if fp8 else dtype
                tag = f"sm{arch}-{_TYPES[dtype]}{'-fp8' if fp8 else ''}"
                for geometry in GEOMETRIES:
                    for variant in _launches(arch, dtype, cache, geometry, tag):
                        found.setdefault((arch, *variant.key()), variant)
    return list(found.values())


def _launches(arch: int, dtype: torch.dtype, cache: torch.dtype, geometry: Geometry, tag: str):
    """The variants of one dtype, page dtype and geometry: the fused elementwise kernels,
    write_kv with and without RoPE, prefill at both tiles, decode at every tile split and
    unsplit (on bfloat16 pages, of heads other than MLA's, each also softcapped and each with
    sinks), and the merge (with sinks or not)."""
    name = f"{tag}-{geometry.name}"
    scored = cache == torch.bfloat16 and not geometry.latent
    # (softcap, sinks): neither, or one of them
    options = ((False, False), (True, False), (False, True)) if scored else ((False, False),)
    group = geometry.num_heads // geometry.num_kv_heads
    scale = torch.float32 if cache == FP8_DTYPE else cache  # no scales: the cache stands in
    scales = {"k_scale": scale, "v_scale": scale}
    pages = {"k_cache": cache, "v_cache": cache, **scales}
    tables = {"page_tables": torch.int32, "seq_lens": torch.int32, "cu_seqlens_q": torch.int32}
    yield from _fused(arch, dtype, geometry, name)
    if not geometry.latent:
        writes = {**pages, "slots": torch.int64, "k": dtype, "v": dtype, "q": dtype,
                  "cos": dtype, "sin": dtype}
        yield Variant(f"{name}-write", arch, triton_write._write_kv,
                      triton_write.write_launch(cache, geometry.num_kv_heads, geometry.head_dim),
                      writes)
        yield Variant(f"{name}-write-rope", arch, triton_write._write_kv,
                      triton_write.write_launch(cache, geometry.num_kv_heads, geometry.head_dim,
                                                geometry.num_heads, geometry.head_dim),
                      writes)
        for query_len, (softcap, sinks) in itertools.product((1, triton_prefill.LONG_QUERY),
                                                             options):
            launch = triton_prefill.prefill_launch(dtype, cache, geometry.head_dim, query_len,
                                                   MAX_SHARED[arch], softcap, sinks)
            yield Variant(f"{name}-prefill-n{launch.constexprs['BLOCK_N']}"
                          f"{_suffix(softcap, sinks)}", arch,
                          triton_prefill._prefill, launch,
                          {**pages, **tables, "q": dtype, "out": dtype,
                           "sinks": torch.float32 if sinks else dtype})
    # Every tile decode_launch picks: a split of one block of 16 tokens up to BLOCK_N.
    for split_tokens, num_splits, (softcap, sinks) in itertools.product(
            (16, 32, triton_decode.BLOCK_N), (1, MAX_DECODE_SPLITS), options):
        split = num_splits > 1
        parts = torch.float32 if split else dtype  # unsplit: `out` stands in
        try:
            launch = triton_decode.decode_launch(dtype, cache, geometry.head_dim, group,
                                                 num_splits, split_tokens, MAX_SHARED[arch],
                                                 softcap, sinks)
        except ValueError:  # no tile fits this arch (float32 MLA on sm_89): refused
            continue
        yield Variant(f"{name}-decode{'-split' if split else ''}"
                      f"-n{launch.constexprs['BLOCK_N']}{_suffix(softcap, sinks)}",
                      arch,
                      triton_decode._decode_split, launch,
                      {**pages, **tables, "q": dtype, "out": dtype, "part_out": parts,
                       "part_lse": parts, "sinks": torch.float32 if sinks else dtype})
    for sinks in sorted({sinks for _, sinks in options}):
        yield Variant(f"{name}-merge{_suffix(False, sinks)}", arch, triton_decode._merge_splits,
                      triton_decode.merge_launch(geometry.head_dim, sinks),
                      {"part_out": torch.float32, "part_lse": torch.float32,
                       "cu_seqlens_q": torch.int32, "out": dtype,
                       "sinks": torch.float32 if sinks else dtype})


def _suffix(softcap: bool, sinks: bool) -> str:
    """A variant name's ending for its scores' options."""
    return f"{'-softcap' if softcap else ''}{'-sinks' if sinks else ''}"


def _fused(arch: int, dtype: torch.dtype, geometry: Geometry, name: str):
    """The fused elementwise kernels of a model in `dtype`: RMSNorm of the hidden state (with
    and without the residual add) and of a head (Qwen3's q/k norm), and SiLU-and-mul."""
    rows = {"x": dtype, "residual": dtype, "weight": dtype, "out": dtype, "summed": dtype}
    for size, residual, what in ((geometry.hidden_size, True, "add-norm"),
                                 (geometry.hidden_size, False, "norm"),
                                 (geometry.head_dim, False, "head-norm")):
        yield Variant(f"{name}-{what}", arch, triton_fused._rms_norm,
                      triton_fused.norm_launch(size, residual), rows)
    yield Variant(f"{name}-silu-mul", arch, triton_fused._silu_mul, triton_fused.silu_launch(),
                  {"gate": dtype, "up": dtype, "out": dtype})


class Compiled(NamedTuple):
    """What compiling one variant gave: its resources per thread and program, or the error."""

    name: str
    arch: int
    registers: int = 0  # per thread
    spill_bytes: int = 0  # per thread: spill stores
    shared_bytes: int = 0  # per program
    error: str | None = None

    @property
    def fits(self) -> bool:
        """Whether a GPU of the variant's arch can launch it: shared memory within its limit."""
        return self.error is None and self.shared_bytes <= MAX_SHARED[self.arch]


def compile_report(variant: Variant, *, resources: bool = False) -> Compiled:
    """Compile `variant`; its registers and spills too when `resources` (ptxas -v once more)."""
    try:
        kernel = compile_variant(variant)
    except Exception as error:  # the compiler's own message is the report
        return Compiled(variant.name, variant.arch, error=f"{type(error).__name__}: {error}")
    registers = spills = 0
    if resources:
        registers, spills = _ptxas_resources(kernel.asm["ptx"], variant.arch)
    return Compiled(variant.name, variant.arch, registers, spills, kernel.metadata.shared)


def covering(found: list[Variant]) -> list[Variant]:
    """The first variant of each code path (`Variant.branches`): every kernel and constexpr
    switch on each arch once, at the smallest head shape that takes it, but on sm_89 only
    where its launch differs from every sm_80 launch (fp8 pages, smaller tiles; sm_89
    compiles sm_80's code otherwise); and on each arch the attention variant whose tile
    comes closest to the shared memory limit, where the sizing of tiles is tight."""
    on_sm80 = {v.key() for v in found if v.arch == 80}
    first: dict[tuple, Variant] = {}
    for variant in sorted(found, key=lambda v: v.launch.constexprs.get("BLOCK_D", 0)):
        if variant.arch != 89 or variant.key() not in on_sm80:
            first.setdefault(variant.branches(), variant)
    tightest = {arch: max((v for v in found if v.arch == arch), key=Variant.tile_bytes)
                for arch in {v.arch for v in found}}
    chosen = {id(v) for v in (*first.values(), *tightest.values())}
    return [v for v in found if id(v) in chosen]


def compile_all(names: list[str] | None = None, *, workers: int = 1,
                resources: bool = False) -> list[Compiled]:
    """The variants named (every one by default) compiled, in `workers` processes."""
    wanted = None if names is None else set(names)
    found = [v for v in variants() if wanted is None or v.name in wanted]
    if workers == 1:
        return [compile_report(v, resources=resources) for v in found]
    context = multiprocessing.get_context("fork")  # no CUDA here: nothing to re-initialise
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_name_variants) as pool:
        # By name: a kernel does not pickle.
        return list(pool.map(functools.partial(_compile_named, resources=resources),
                             [v.name for v in found]))


_NAMED: dict[str, Variant] = {}  # a compile worker's variants by name, found once


def _name_variants() -> None:
    _NAMED.update((v.name, v) for v in variants())


def _compile_named(name: str, *, resources: bool) -> Compiled:
    return compile_report(_NAMED[name], resources=resources)


def _ptxas_resources(ptx: str, arch: int) -> tuple[int, int]:
    """Registers and spill-store bytes per thread that ptxas reports for `ptx`, run with the
    ptxas Triton picks for `arch` (sm_90 PTX needs the newer of the two the wheel ships)."""
    gpu = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)  # sm_90a, not sm_90
    ptxas = nvidia_compiler.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [ptxas, "-v", f"--gpu-name={gpu}", str(source), "-o", f"{folder}/kernel.cubin"]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills
