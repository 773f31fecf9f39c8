import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import settings

# No per-example deadline in any property test: on a loaded 2-core machine a slow example is
# the machine, not the code (performance is measured by benchmarks/, never by tests).
settings.register_profile("kvpool", deadline=None)
settings.load_profile("kvpool")

# Without CUDA the Triton kernels run on CPU tensors in Triton's interpreter, which must be
# chosen before any module imports triton (kernels imported compiled cannot run on the CPU):
# here, so that every test file, collected in any order or alone, sees the same kernels.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The suite runs many tiny forwards; one thread per process keeps them fast and steady on a
# small shared machine (two threads contend with each other and with the test runner).
torch.set_num_threads(1)

# Every case that touches tensors runs on an explicit device: the CPU always, CUDA as well
# when present (skipped with a reason otherwise), so a reference built on the wrong device
# fails on a GPU machine instead of passing by coincidence on a CPU-only one.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")),
]


# The server tests need the server extra and the HTTP clients of the test extra. A machine
# without them (a GPU machine with no package index) leaves those files out and says so in the
# report's header, instead of failing at import.
SERVER_MODULES = ("starlette", "uvicorn", "prometheus_client", "jinja2", "httpx", "aiohttp",
                  "openai")
MISSING_SERVER_MODULES = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
collect_ignore_glob = ["test_server*.py"] if MISSING_SERVER_MODULES else []


# The modules that take longest (seconds of CPU on 2 cores), collected first: `dev.py test`
# hands whole modules to its workers in collection order, so none of these is left running
# alone at the end. test_triton_compile leads: with Triton's cache empty (a fresh machine)
# its compiles take half a minute of both cores.
LONGEST_FIRST = ("test_triton_compile", "test_tensor_parallel", "test_server_cli",
                 "test_disaggregated", "test_cache_props", "test_triton_kernels", "test_gguf",
                 "test_server", "test_tensor_parallel_hybrid", "test_redis_tier",
                 "test_server_limits", "test_models", "test_windows", "test_deepseek",
                 "test_fake_trace")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: modules stay whole
    _patch_the_language_once_a_launch()


def _patch_the_language_once_a_launch():
    """Triton's interpreter patches triton.language (hundreds of attributes, found by
    inspect.getmembers) when a kernel launches, restoring it when the launch ends, and again
    at every call of a @triton.jit device function inside the kernel: a third of the time
    the kernels take in the interpreter. An inner patch of a language module patched already
    in this launch changes nothing (it sets what was set, the builtins found wrapped
    already), so a device function runs without one unless it sees a module not yet patched
    in the launch (triton.language.core, for tl.sum and the like): patched once, then.
    Only where the test files imported the interpreter (the Triton tests collected, no
    CUDA)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None or os.environ.get("TRITON_INTERPRET") != "1" or getattr(
            interpreter, "_kvpool_patched_once", False):
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or not hasattr(interpreter, "_LangPatchScope"):
        return  # another Triton: its interpreter as it is
    launch = executor.__call__
    running = {"fn": None, "langs": None}  # the kernel launching or running, its modules

    def languages(fn) -> set[int]:
        tl = interpreter.tl
        return {id(value) for value in fn.__globals__.values()
                if value is tl or value is tl.core}

    def _patch_lang(fn):
        if running["fn"] is fn and running["langs"] is None:  # the launch's own patch
            running["langs"] = languages(fn)
        elif running["langs"] is not None:  # a device function inside the launch
            seen = languages(fn)
            if seen and seen <= running["langs"]:  # (none seen: Triton's assertion fails)
                return interpreter._LangPatchScope()  # nothing to patch, nothing to restore
            running["langs"] |= seen  # its patch is left in place, as Triton leaves it
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        running["fn"], running["langs"] = self.fn, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            running["fn"] = running["langs"] = None

    interpreter._patch_lang = _patch_lang
    executor.__call__ = launch_patching_once
    interpreter._kvpool_patched_once = True


def pytest_report_header(config):
    if MISSING_SERVER_MODULES:
        return (f"server tests left out: {', '.join(MISSING_SERVER_MODULES)} not installed "
                f"(pip install -e '.[test]')")
    return None


@pytest.fixture(scope="session", autouse=True)
def cuda_memory_share():
    """Under `python3 dev.py gpu-check` several workers share one GPU: each takes the share of
    its memory the variable gives, so a test that overflows it fails alone."""
    share = os.environ.get("KVPOOL_TEST_CUDA_MEMORY_FRACTION")
    if share and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(share))


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    """The device a test builds everything on, its references included (session-scoped, so
    that a module's fixtures, models loaded once, take it too)."""
    return torch.device(request.param)
