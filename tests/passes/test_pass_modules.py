"""The graph passes depend on no schedule: what a pass and a schedule rule must agree on (a
Winograd conv's block names, the matmul kernels MatmulEpilogue takes, a kernel's blocks) lies
below both, in ``kernels/``. Only ``pipeline.py``, which composes the phases, imports the
schedule phase. Read statically, like tests/test_import_graph.py: every import counts, at top
level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

from tvm_fusion import passes

PASSES_DIR = Path(passes.__file__).resolve().parent
COMPOSER = "pipeline"


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports, relative ones resolved from ``tvm_fusion.passes``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "tvm_fusion.passes".split(".")[:3 - node.level] if node.level else []
            found.add(".".join([*base, *([node.module] if node.module else [])]))
    return found


def test_no_pass_imports_a_schedule():
    offending = {path.name: sorted(name for name in _imported(path) if name.startswith("tvm_fusion.schedules"))
                 for path in sorted(PASSES_DIR.glob("*.py")) if path.stem != COMPOSER}
    assert not {name: found for name, found in offending.items() if found}


def test_the_check_resolves_relative_imports(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("from ..schedules.cpu import helpers\nfrom .fold_constants import x\n"
                      "def late():\n    import tvm_fusion.schedules\n")
    assert _imported(source) == {"tvm_fusion.schedules.cpu", "tvm_fusion.passes.fold_constants",
                                 "tvm_fusion.schedules"}
