"""`kvpool serve`: an OpenAI-compatible HTTP server over the engine, with Prometheus metrics.

Its dependencies are the `server` extra (`pip install 'kvpool[server]'`); importing this
package needs none of them, so the command line can say what is missing.

May import: engine, models, memory and kvpool's shared modules; not the CLI.
"""

from __future__ import annotations

import importlib.util

REQUIRED_MODULES = ("starlette", "uvicorn", "prometheus_client", "jinja2")
INSTALL_HINT = "pip install 'kvpool[server]'"


def missing_modules() -> list[str]:
    """The server's dependencies that cannot be imported."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ValueError:  # a module set to None in sys.modules
            found = False
        if not found:
            missing.append(name)
    return missing
