"""The tvm_fusion modules import each other without a circle: dependencies point down.

The graph is read statically: every ``import`` and ``from ... import`` in every module of the
package, at top level and inside functions (a deferred import hides a circle, it does not
remove it), with relative imports resolved. Importing ``a.b.c`` also runs the ``__init__`` of
``a.b``, so it counts as an edge to that package too, unless the importer lives inside it (a
package's own modules always run after its ``__init__`` has started). There is no allow-list:
a circle is broken by moving what both sides need into a lower module.

Beyond having no circles, the package is layered: each top-level module or subpackage sits in
one layer of ``LAYERS`` (lowest first) and imports only from its own layer or lower ones.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = "tvm_fusion"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

def _module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()

# Lowest first. A unit is a root module or a subpackage (its name below tvm_fusion).
LAYERS = [
    ("foundations", {"errors", "files", "native_log", "ordering", "plugins", "bundled", "verify", "report", "accuracy",
                     "render"}),
    ("fusion rules", {"kernels", "patterns"}),
    ("import", {"frontend", "dispatch"}),
    ("configuration and kernel generation", {"config", "targets", "schedules"}),
    ("tuning and runtime", {"tuning", "runtime"}),
    ("passes and export", {"passes", "export", "onnx_export"}),
    ("preparation", {"provenance", "preparation"}),
    ("stage helpers", {"build", "fusion_gate", "metadata"}),
    ("session", {"session"}),
    ("probes", {"machine_peak"}),
    ("commands", {"commands"}),
    ("api", {"api"}),
    ("cli", {"cli"}),
]


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imported_modules(module: str) -> set[str]:
    """The tvm_fusion modules that ``module`` imports anywhere in its file."""
    package = module if _is_package(module) else module.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            named.add(base)
            # `from pkg import name` imports the submodule pkg.name when there is one.
            named.update(f"{base}.{alias.name}" for alias in node.names)
    imported = set()
    for name in named:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        parts = name.split(".")
        # The module itself and every package above it that the importer is not inside.
        for end in range(2, len(parts) + 1):
            target = ".".join(parts[:end])
            if target in MODULES and not (module + ".").startswith(target + "."):
                imported.add(target)
    imported.discard(module)
    return imported


def import_graph() -> dict[str, set[str]]:
    return {module: _imported_modules(module) for module in MODULES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a module path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_every_module_imports():
    for module in MODULES:
        importlib.import_module(module)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in tvm_fusion:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles)


def test_cycle_finder_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def test_every_unit_has_a_layer():
    layered = set().union(*(units for _, units in LAYERS))
    units = {_unit(m) for m in MODULES} - {PACKAGE}
    assert units - layered == set(), "give these a layer in LAYERS"
    assert layered - units == set(), "these units in LAYERS no longer exist"


def test_imports_point_down_the_layers():
    """Nothing imports from a higher layer (the package's own __init__ sits above all)."""
    layer = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}
    upward = []
    for module, imported in import_graph().items():
        if module == PACKAGE:
            continue
        for target in imported:
            if target != PACKAGE and layer[_unit(target)] > layer[_unit(module)]:
                upward.append(f"{module} ({LAYERS[layer[_unit(module)]][0]}) imports {target} "
                              f"({LAYERS[layer[_unit(target)]][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))
