"""The package's shape: a small root, no long modules, one owner of the pipeline's phases."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "tvm_fusion"
MAX_ROOT_MODULES = 20
MAX_LINES = 400


def test_the_root_holds_at_most_twenty_modules():
    root = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root: {root}"


def test_no_module_is_longer_than_four_hundred_lines():
    long = {str(p.relative_to(PACKAGE_DIR)): n for p in PACKAGE_DIR.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules: {long}"


def test_only_the_session_composes_the_pipeline_phases():
    """``fusion_pipeline`` is the session's business: a command asks the session for a stage."""
    callers = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                    "fusion_pipeline":
                callers.add(str(path.relative_to(PACKAGE_DIR)))
    assert callers == {"session.py"}


def test_deferred_imports_say_why():
    """An import inside a function hides a dependency: each one carries a ``#`` comment, on its
    line or the line above, saying why it is not at the top (TVM kept out of ``--help``, an
    optional extra, an import cost only one path pays)."""
    silent = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                line = lines[node.lineno - 1]
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if "#" not in line and not above.startswith("#"):
                    silent.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}: {line.strip()}")
    assert not silent, "imports inside functions with no comment saying why:\n" + "\n".join(sorted(set(silent)))
