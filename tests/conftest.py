import importlib.util
import os

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
# alone at the end.
LONGEST_FIRST = ("test_tensor_parallel", "test_triton_kernels", "test_tensor_parallel_hybrid",
                 "test_server_cli", "test_cache_props", "test_gguf", "test_disaggregated",
                 "test_numerics", "test_fake_trace", "test_redis_tier", "test_server_limits",
                 "test_hybrid_engine", "test_models", "test_engine_props", "test_server")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: modules stay whole


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
