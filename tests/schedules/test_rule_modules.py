"""The modules of schedules/cpu/ keep rules self-contained: a rule module (one that defines a
ScheduleRule) imports shared helpers from helper modules only, never from another rule's module
(and a helper module imports from no rule module either), and no module imports another
module's private (underscore) names.

Read statically with ``ast``, like tests/test_import_graph.py: every import in a module counts,
at top level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tvm_fusion.schedules import cpu
from tvm_fusion.schedules.registry import builtin_cpu_rules

CPU_DIR = Path(cpu.__file__).resolve().parent
PACKAGE = cpu.__name__  # tvm_fusion.schedules.cpu


def _defines_rule(tree: ast.Module) -> bool:
    """True if the module defines a class deriving from ScheduleRule (named or dotted)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name == "ScheduleRule":
                    return True
    return False


def _imports(tree: ast.Module, modules: set[str]) -> list[tuple[str | None, str, int]]:
    """(sibling module imported from or None, imported name, line) for every import in ``tree``;
    the sibling is a module of ``PACKAGE`` named in ``modules``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                prefix, _, rest = alias.name.partition(PACKAGE + ".")
                sibling = rest.split(".")[0] if not prefix and rest.split(".")[0] in modules else None
                found.append((sibling, alias.name.rsplit(".", 1)[-1], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(PACKAGE.split(".")[:len(PACKAGE.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if base == PACKAGE and alias.name in modules:  # from . import attention
                    found.append((alias.name, alias.name, node.lineno))
                    continue
                _, _, rest = base.partition(PACKAGE + ".")
                sibling = rest.split(".")[0] if base.startswith(PACKAGE + ".") else None
                found.append((sibling if sibling in modules else None, alias.name, node.lineno))
    return found


def violations(sources: dict[str, str]) -> tuple[set[str], list[str]]:
    """The rule modules among ``sources`` (module name -> source text) and what breaks the rules."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    rules = {name for name, tree in trees.items() if _defines_rule(tree)}
    found = []
    for name, tree in sorted(trees.items()):
        for sibling, imported, line in _imports(tree, set(trees)):
            if sibling in rules and sibling != name:
                found.append(f"{name}.py:{line}: imports from rule module {sibling} "
                             f"(move {imported!r} into a helper module)")
            if imported.startswith("_") and not imported.startswith("__"):
                found.append(f"{name}.py:{line}: imports the private name {imported!r}")
    return rules, found


def _cpu_sources() -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(CPU_DIR.glob("*.py")) if path.stem != "__init__"}


def test_rule_modules_import_only_helpers_and_no_private_names():
    rules, found = violations(_cpu_sources())
    assert not found, "\n".join(found)
    # The static reading finds exactly the modules whose rules the registry finds.
    assert rules == {type(rule).__module__.rpartition(".")[2] for rule in builtin_cpu_rules()}


def test_the_check_flags_imports_from_rule_modules_and_private_names():
    rule = "from tvm.s_tir.dlight.base import ScheduleRule\n{}\nclass {}(ScheduleRule):\n    pass\n"
    sources = {
        "helpers": "def shared():\n    pass\n\ndef _private():\n    pass\n",
        "first": rule.format("from .helpers import shared", "First"),
        "second": rule.format("from .first import First\nfrom . import first", "Second"),
        "third": rule.format("from tvm_fusion.schedules.cpu.helpers import _private", "Third"),
        "fourth": rule.format("def late():\n    from .first import helper", "Fourth"),
        "other_helper": "from .first import _internal\n",
    }
    rules, found = violations(sources)
    assert rules == {"first", "second", "third", "fourth"}
    assert [line.split(":")[0] for line in found] == [
        "fourth.py", "other_helper.py", "other_helper.py", "second.py", "second.py", "third.py"]
