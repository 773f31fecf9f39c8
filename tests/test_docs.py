"""The Python examples of README.md and docs/*.md run as written, and the values their comments
state are the values the code gives.

Each file's ```python blocks run in order, in one namespace, in a scratch folder. A block that
names `device="cuda"` (a GPU-sized example) runs where CUDA is; a block after a line
`<!-- not run: why -->` never runs. A statement whose comment starts with a Python literal
(`alloc.allocate(4)  # [0, 1, 2, 3]`, `pool.k_cache(0).shape  # (65, 16, 2, 64): ...`) must
give that value: an expression its value, an assignment its target's."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- not run: [^\n]*-->\n)?```python\n(.*?)```", re.S)
NOTHING = object()


def _blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line of its first line of code, code, whether it runs here) of each python block."""
    blocks = []
    for found in BLOCK.finditer(text):
        code = found.group(2)
        runs = found.group(1) is None and ('device="cuda"' not in code
                                           or torch.cuda.is_available())
        blocks.append((text.count("\n", 0, found.start(2)) + 1, code, runs))
    return blocks


def _stated(comment: str) -> object:
    """The literal a comment starts with (before any ': explanation'), else NOTHING."""
    text = comment.lstrip("#").strip()
    for candidate in (text, text.partition(": ")[0]):
        try:
            return ast.literal_eval(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return NOTHING


def _run(code: str, first_line: int, path: Path, namespace: dict) -> None:
    """Run one block statement by statement, checking each value a comment states."""
    comments = {token.start[0]: token.string
                for token in tokenize.generate_tokens(io.StringIO(code).readline)
                if token.type == tokenize.COMMENT}
    tree = ast.parse(code)
    ast.increment_lineno(tree, first_line - 1)
    for statement in tree.body:
        stated = _stated(comments.get(statement.lineno - first_line + 1, ""))
        if isinstance(statement, ast.Expr) and stated is not NOTHING:
            value = eval(compile(ast.Expression(statement.value), str(path), "eval"), namespace)
        else:
            exec(compile(ast.Module([statement], []), str(path), "exec"), namespace)
            targets = statement.targets if isinstance(statement, ast.Assign) else []
            if stated is NOTHING or len(targets) != 1 or not isinstance(targets[0], ast.Name):
                continue
            value = namespace[targets[0].id]
        assert value == stated, (f"{path.name}:{statement.lineno}: {ast.unparse(statement)} "
                                 f"gives {value!r}; its comment says {stated!r}")


# The pages with an example that runs somewhere.
FILES = [path for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
         if any(found.group(1) is None for found in BLOCK.finditer(path.read_text()))]


@pytest.mark.parametrize("path", FILES, ids=[path.name for path in FILES])
def test_python_examples_run_and_give_the_values_their_comments_state(path, tmp_path,
                                                                         monkeypatch):
    blocks = [(line, code) for line, code, runs in _blocks(path.read_text()) if runs]
    if not blocks:
        pytest.skip(f"{path.name}'s examples need CUDA")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        _run(code, line, path, namespace)


def test_a_wrong_stated_value_fails(tmp_path):
    with pytest.raises(AssertionError, match=r"x.md:2: .* gives 3; its comment says 4"):
        _run("a = 1\na + 2   # 4: the sum\n", 1, tmp_path / "x.md", {})
    _run("pages = [0, 1]   # [0, 1]: both\nlen(pages)   # two of them\n", 1,
         tmp_path / "x.md", {})
