"""The Triton kernels compile for real GPUs (sm_80, sm_89, sm_90) on a machine without one,
within each one's shared memory.

Every variant comes from kvpool.kernels.triton_variants, which takes each kernel's constexprs
and options from the same function its launcher calls. CI compiles the variants that cover
every code path (each kernel and constexpr switch on each arch, at the smallest head shape)
and each arch's tile closest to its shared memory;
KVPOOL_COMPILE_ALL=1 compiles every variant, every head shape and dtype too (minutes: see
benchmarks/kernel_resources.py, which prints their registers, spills and shared memory).
Sliding windows and page sizes are runtime arguments: no variant of their own.

The compiles run in a child process: the kernels' modules, once imported under the CPU
interpreter (TRITON_INTERPRET=1, which other test files set), cannot be compiled for a GPU.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: there is no kernel to compile")

from kvpool.kernels import triton_support, triton_variants  # noqa: E402
from kvpool.memory.fp8 import FP8_DTYPE  # noqa: E402

VARIANTS = triton_variants.variants()
ALL = os.environ.get("KVPOOL_COMPILE_ALL", "0") == "1"
# What this run compiles: the covering variants, or with KVPOOL_COMPILE_ALL=1 every one.
COMPILED = VARIANTS if ALL else triton_variants.covering(VARIANTS)
# The child, with the compiled kernels as a GPU runs them: first the integer arguments each
# kernel leaves unspecialised, as imported (see PER_STEP below), then the variants compiled.
CHILD = """
import json, sys
from kvpool.kernels import triton_decode, triton_prefill
kernels = (triton_prefill._prefill, triton_decode._decode_split, triton_decode._merge_splits)
plain = {k.fn.__name__: [p.name for p in k.params if p.do_not_specialize] for k in kernels}
from kvpool.kernels import triton_variants
results = triton_variants.compile_all(sys.argv[1:], workers=2)
json.dump({"plain": plain, "compiled": [result._asdict() for result in results]}, sys.stdout)
"""


@pytest.fixture(scope="module")
def child() -> dict:
    """What the child process (one for the module) gave: "compiled", what compiling each
    selected variant gave, by name; "plain", each kernel's unspecialised arguments."""
    names = [v.name for v in COMPILED]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", CHILD, *names], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    return {"plain": out["plain"],
            "compiled": {result["name"]: result for result in out["compiled"]}}


@pytest.fixture(scope="module")
def compiled(child) -> dict[str, dict]:
    """What compiling each selected variant gave, by name."""
    return child["compiled"]


@pytest.mark.parametrize("variant", COMPILED, ids=[v.name for v in COMPILED])
def test_kernel_compiles_to_cubin_and_fits_shared_memory(variant, compiled):
    result = compiled[variant.name]
    if result["error"] is not None:
        pytest.fail(result["error"], pytrace=False)
    limit = triton_variants.MAX_SHARED[variant.arch]
    assert result["shared_bytes"] <= limit, (
        f"{variant.name} needs {result['shared_bytes']} bytes of shared memory, "
        f"sm_{variant.arch} gives a program at most {limit}")
    # The launchers size attention tiles by triton_support.tile_bytes: it must bound them.
    assert result["shared_bytes"] <= variant.tile_bytes() or not variant.tile_bytes(), (
        f"{variant.name} takes {result['shared_bytes']} bytes of shared memory, more than "
        f"the {variant.tile_bytes()} its tile was sized for")


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_launch_gives_every_constexpr_of_its_kernel(variant):
    parameters = inspect.signature(variant.kernel.fn).parameters.values()
    constexprs = {p.name for p in parameters if "constexpr" in str(p.annotation)}
    assert set(variant.launch.constexprs) == constexprs


def test_variants_cover_each_kernel_switch_on_each_arch():
    kernels = {"_write_kv", "_prefill", "_decode_split", "_merge_splits", "_rms_norm",
               "_silu_mul"}
    for arch in triton_variants.ARCHS:
        found = [v for v in VARIANTS if v.arch == arch]
        assert {v.kernel_name for v in found} == kernels
        decode = {v.branches()[2] for v in found if v.kernel_name == "_decode_split"}
        assert {dict(flags)["SPLIT"] for flags in decode} == {False, True}
        # 16-bit tiles: "native" on a GPU, "upcast" in this process if it interprets.
        sixteen_bit = triton_support.dot_precision(torch.bfloat16)
        assert {dict(flags)["PRECISION"] for flags in decode} == {sixteen_bit, "ieee"}
        for kernel in ("_prefill", "_decode_split"):  # Gemma 2's softcapped scores and others
            assert {v.launch.constexprs["SOFTCAP"] for v in found
                    if v.kernel_name == kernel} == {False, True}
        for kernel in ("_prefill", "_decode_split", "_merge_splits"):  # GPT-OSS's sinks
            assert {v.launch.constexprs["SINKS"] for v in found
                    if v.kernel_name == kernel} == {False, True}
    fp8 = {v.arch for v in VARIANTS if v.launch.constexprs.get("FP8")}
    assert fp8 == {89, 90}  # Triton has no e4m3 for sm_80: those GPUs read fp8 pages in torch
    assert any(v.launch.constexprs.get("HEAD_DIM") == 576 for v in VARIANTS)  # MLA latent
    assert any(v.launch.constexprs.get("ROTARY_DIM") for v in VARIANTS)  # RoPE in the write
    assert {v.launch.constexprs["RESIDUAL"] for v in VARIANTS
            if v.kernel_name == "_rms_norm"} == {False, True}


def test_ci_compiles_the_softcapped_attention_kernels_for_each_arch_of_its_own_code():
    # sm_89 compiles sm_80's code for bfloat16 pages (the dtype softcapped variants take)
    covered = triton_variants.covering(VARIANTS)
    for arch in (80, 90):
        softcapped = {(v.kernel_name, v.launch.constexprs.get("SPLIT")) for v in covered
                      if v.arch == arch and v.launch.constexprs.get("SOFTCAP")}
        assert softcapped == {("_prefill", None), ("_decode_split", False),
                              ("_decode_split", True)}


def test_ci_compiles_the_attention_kernels_with_sinks_for_each_arch_of_its_own_code():
    covered = triton_variants.covering(VARIANTS)
    for arch in (80, 90):
        with_sinks = {(v.kernel_name, v.launch.constexprs.get("SPLIT")) for v in covered
                      if v.arch == arch and v.launch.constexprs.get("SINKS")}
        assert with_sinks == {("_prefill", None), ("_decode_split", False),
                              ("_decode_split", True), ("_merge_splits", None)}


# Integer arguments whose value changes from one step to the next. Triton compiles a kernel
# again for each new specialisation of an integer (1, divisible by 16, other) unless told not
# to: specialising on these would compile during serving, variants this file never compiles.
PER_STEP = {"_prefill": "stride_table", "_decode_split": "stride_table",
            "_merge_splits": "num_splits"}


def test_no_kernel_compiles_again_for_a_value_that_changes_every_step(child):
    plain = child["plain"]  # the compiled kernels, as a GPU runs them (the child's)
    for name, argument in PER_STEP.items():
        assert argument in plain[name], f"{name} specialises on {argument}"
        assert argument in triton_variants.UNALIGNED  # compiled here as any value


def test_compile_workers_find_the_variants_once_each(monkeypatch):
    # Each compile worker looks its variants up by name: finding every variant again for
    # each one (605 under KVPOOL_COMPILE_ALL=1) took longer than the compiles from the cache.
    found = multiprocessing.get_context("fork").Value("i", 0)
    real = triton_variants.variants

    def counted():
        with found.get_lock():
            found.value += 1
        return real()

    monkeypatch.setattr(triton_variants, "variants", counted)
    monkeypatch.setattr(triton_variants, "compile_report",
                        lambda variant, resources: triton_variants.Compiled(variant.name,
                                                                           variant.arch))
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)  # a name is one variant
    names = [v.name for v in VARIANTS[:8]]
    results = triton_variants.compile_all(names, workers=2)
    assert [(r.name, r.arch) for r in results] == [(v.name, v.arch) for v in VARIANTS[:8]]
    assert found.value <= 3  # the caller, then each of the 2 workers once


@pytest.mark.parametrize(("arch", "fp8_runs"), [(80, False), (89, True), (90, True)])
def test_fp8_pages_take_triton_only_where_it_compiles_e4m3(monkeypatch, arch, fp8_runs):
    monkeypatch.setattr(triton_support, "interpreted", lambda: False)
    monkeypatch.setattr(triton_support, "_cuda_arch", lambda device: arch)
    cuda = torch.device("cuda", 0)
    assert triton_support.runs_on(cuda, FP8_DTYPE) is fp8_runs
    assert triton_support.runs_on(cuda, torch.bfloat16)
