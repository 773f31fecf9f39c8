"""The package runs on the oldest Python it claims (`requires-python`), though CI runs a newer
one: the sources use no module, function or syntax that version lacks (read by vermin, which
knows when each entered the standard library)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def oldest_python() -> str:
    """`requires-python`'s lower bound, e.g. "3.10" (read as text: tomllib is 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'requires-python = ">=(\d+\.\d+)"', text).group(1)


def test_the_sources_need_no_newer_python_than_requires_python():
    target = oldest_python()
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from vermin.main import main; sys.exit(main())",
         "--no-tips", "--violations", "--eval-annotations", f"-t={target}-",
         str(ROOT / "src"), str(ROOT / "dev.py")],
        capture_output=True, text=True)
    assert result.returncode == 0, f"needs a Python newer than {target}:\n{result.stdout}"
