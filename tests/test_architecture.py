"""The package layout is the architecture: each package imports only the packages below it
(the rules each package's `__init__` docstring states), and no module imports itself back
through others. Imports under `if TYPE_CHECKING:` are annotations, not dependencies."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpool"

# The shared modules at the top of the package that any part may use.
BASE = {"errors", "numeric", "devices", "threads", "formats", "rope"}
# What each part may import besides itself and BASE. `kvpool` (the package's lazy exports),
# the CLI, which puts everything together, and `python -m kvpool` (`__main__`, the CLI's
# entry) import anything.
ALLOWED = {
    "memory": set(),
    "kernels": {"memory"},
    "attention": {"kernels", "memory"},
    "cache": {"memory"},
    "planning": {"memory"},  # takes a model geometry, imports no model code
    "forward_context": {"attention", "memory"},
    "models": {"forward_context", "attention", "kernels", "memory", "planning"},
    "engine": {"cache", "planning", "models", "forward_context", "attention", "kernels",
               "memory"},
    "server": {"engine", "models", "cache", "memory"},
}


def _modules() -> dict[str, Path]:
    return {".".join(("kvpool", *path.relative_to(SRC).with_suffix("").parts))
            .removesuffix(".__init__"): path for path in SRC.rglob("*.py")}


def _part(module: str) -> str:
    """The part of kvpool a module belongs to: `kvpool.cache.tiers` -> `cache`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvpool"


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The kvpool modules `path` imports (anywhere in it, or only at its top level)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                for alias in node.names:  # a submodule, or a name of `base`
                    name = f"{base}.{alias.name}"
                    found.add(name if name in MODULES else base)
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return {name for name in found if name.startswith("kvpool")}


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layering(module):
    part = _part(module)
    if part in ("kvpool", "cli", "__main__") or part in BASE:
        if part in BASE:  # the shared modules import no other part
            imported = {_part(m) for m in _imports(MODULES[module], module, False)
                        if m in MODULES}
            assert imported <= BASE, f"{module} imports {sorted(imported - BASE)}"
        return
    allowed = ALLOWED[part] | BASE | {part}
    bad = sorted(m for m in _imports(MODULES[module], module, False)
                 if m in MODULES and _part(m) not in allowed)
    assert not bad, f"{module} ({part}) may import {sorted(allowed)}, imports {bad}"


def test_no_import_cycles():
    graph = {m: {i for i in _imports(p, m, True) if i in MODULES and i != m}
             for m, p in MODULES.items()}
    done, path = set(), []

    def walk(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(
                path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            walk(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        walk(module)


def test_every_package_states_its_rules():
    for init in SRC.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init.parent.name}/__init__.py: say what it may import"


def test_kvpool_re_exports_every_error_the_library_defines():
    import kvpool
    from kvpool import errors
    from kvpool.memory.workspace import WorkspaceFull

    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception)
               and value.__module__ == errors.__name__} | {WorkspaceFull.__name__}
    assert defined - set(kvpool.__all__) == set()
    for name in defined:
        assert issubclass(getattr(kvpool, name), Exception)
