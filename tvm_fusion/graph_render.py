"""Draw an ONNX graph before and after fusion, side by side (``tvm-fusion inspect --graph``).

matplotlib (a pip wheel) with a small layered layout of our own, so it works on a fresh
machine: Graphviz's ``dot`` binary is not there, and pip's ``graphviz`` package needs it.
Left: the ONNX nodes as imported (after shape simplification), each absorbed node tinted with
the color of the pattern that took it. Right: every fused group collapsed into one box that
names its pattern and the ops it absorbed.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import onnx

from .errors import ArtifactError
from .files import check_writable, write_file

FORMATS = (".svg", ".png")
_PALETTE = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5",
            "#bc80bd", "#ccebc5", "#ffed6f"]
_PLAIN = "#f2f2f2"


def check_graph_path(path: str | Path) -> Path:
    """The drawing's path if its format is one we write; raises ArtifactError otherwise."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ArtifactError(f"cannot draw the graph to {path}: unknown format {path.suffix or '(none)'}",
                            "give --graph a path ending in .svg or .png")
    if path.parent and path.parent.exists() and not path.parent.is_dir():
        raise ArtifactError(f"cannot draw the graph to {path}: {path.parent} is not a directory",
                            "give --graph a path in an existing directory")
    check_writable(path.parent, f"the graph {path.name}", "--graph")
    return path


def fused_graph(model: onnx.ModelProto, groups: Sequence) -> tuple[list[str], list[tuple[int, int]], dict]:
    """(labels, edges, pattern of each box) of the graph with every group collapsed into one box.

    ``groups`` are ``api.FusedNodes`` (pattern, variant, ops, indices into ``model.graph.node``).
    """
    owner = {}
    for number, group in enumerate(groups):
        for index in group.indices:
            owner.setdefault(index, number)
    labels, box_of, patterns = [], {}, {}
    for index, node in enumerate(model.graph.node):
        key = ("group", owner[index]) if index in owner else ("node", index)
        if key not in box_of:
            box_of[key] = len(labels)
            if key[0] == "group":
                group = groups[key[1]]
                labels.append(f"{group.variant}\n" + _op_summary(group.ops))
                patterns[box_of[key]] = group.pattern
            else:
                labels.append(node.op_type)
        box_of[("node", index)] = box_of[key]
    edges = {(box_of[("node", a)], box_of[("node", b)]) for a, b in node_edges(model)}
    return labels, sorted(e for e in edges if e[0] != e[1]), patterns


def node_edges(model: onnx.ModelProto) -> list[tuple[int, int]]:
    """(producer, consumer) node indices for every tensor passed between nodes."""
    producer = {out: i for i, node in enumerate(model.graph.node) for out in node.output}
    return sorted({(producer[name], i) for i, node in enumerate(model.graph.node)
                   for name in node.input if name in producer})


def layered_layout(count: int, edges: list[tuple[int, int]]) -> dict[int, tuple[float, float]]:
    """Longest-path layers top to bottom; in each layer, boxes ordered by their parents' mean x."""
    parents, children = collections.defaultdict(list), collections.defaultdict(list)
    for a, b in edges:
        parents[b].append(a)
        children[a].append(b)
    waiting = {box: len(parents[box]) for box in range(count)}
    ready = collections.deque(box for box in range(count) if not waiting[box])
    layer: dict[int, int] = {}
    while ready:  # Kahn's order: a collapsed group may come after boxes with higher numbers
        box = ready.popleft()
        layer[box] = 1 + max((layer[p] for p in parents[box]), default=-1)
        for child in children[box]:
            waiting[child] -= 1
            if not waiting[child]:
                ready.append(child)
    for box in range(count):  # boxes on a cycle (a group that is not convex in ONNX terms)
        if box not in layer:
            layer[box] = 1 + max((layer[p] for p in parents[box] if p in layer), default=-1)
    position: dict[int, tuple[float, float]] = {}
    for depth in range(max(layer.values(), default=-1) + 1):
        row = [b for b in range(count) if layer[b] == depth]
        row.sort(key=lambda b: _mean([position[p][0] for p in parents[b] if p in position], -1e9 + b))
        for slot, box in enumerate(row):
            position[box] = (slot - (len(row) - 1) / 2, -depth)
    return position


def render_fusion_graph(model: onnx.ModelProto, groups: Sequence, path: str | Path,
                        title: str = "") -> Path:
    """Draw ``model`` before and after fusion to ``path`` (.svg or .png), written atomically."""
    import matplotlib
    from matplotlib.figure import Figure

    path = check_graph_path(path)
    colors = {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(dict.fromkeys(g.pattern for g in groups))}
    owner = {i: g.pattern for g in groups for i in g.indices}
    before = ([n.op_type for n in model.graph.node], node_edges(model),
              {i: p for i, p in owner.items()})
    after = fused_graph(model, groups)
    panels = [("before fusion: %d ONNX nodes" % len(before[0]), before),
              ("after fusion: %d boxes (%d fused)" % (len(after[0]), len(groups)), after)]
    layouts = [layered_layout(len(labels), edges) for _, (labels, edges, _) in panels]
    depth = max(-min((y for _, y in layout.values()), default=0) for layout in layouts) + 1
    width = max(max((abs(x) for x, _ in layout.values()), default=0) for layout in layouts) * 2 + 2
    height = max(0.55 * depth, 4)
    figure = Figure(figsize=(2 * min(2.2 * width, 30), height))
    # Fixed margins in inches (the title and legend), not the default fractions of a tall figure.
    figure.subplots_adjust(left=0.01, right=0.99, bottom=0.2 / height, top=1 - 0.9 / height, wspace=0.02)
    for column, ((heading, (labels, edges, patterns)), layout) in enumerate(zip(panels, layouts)):
        axes = figure.add_subplot(1, 2, column + 1)
        axes.set_title(heading, fontsize=10)
        axes.axis("off")
        for a, b in edges:
            (xa, ya), (xb, yb) = layout[a], layout[b]
            axes.annotate("", xy=(xb, yb + 0.18), xytext=(xa, ya - 0.18),
                          arrowprops={"arrowstyle": "->", "color": "#777777", "lw": 0.6})
        for box, label in enumerate(labels):
            x, y = layout[box]
            pattern = patterns.get(box)
            axes.text(x, y, label, ha="center", va="center", fontsize=6.5 if pattern and column else 6,
                      bbox={"boxstyle": "round,pad=0.3", "lw": 0.8 if pattern else 0.4,
                            "fc": colors[pattern] if pattern else _PLAIN,
                            "ec": "#333333" if pattern and column else "#999999"})
        xs = [x for x, _ in layout.values()] or [0]
        axes.set_xlim(min(xs) - 1, max(xs) + 1)
        axes.set_ylim(-depth, 1)
    handles = [_legend_patch(color, pattern) for pattern, color in colors.items()]
    if handles:
        figure.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height),
                      ncol=min(len(handles), 6), fontsize=8, frameon=False)
    figure.suptitle(title, y=1 - 0.05 / height, fontsize=11, va="top")

    def save(staging: Path) -> None:
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: small, searchable
            figure.savefig(staging, format=path.suffix[1:].lower(), bbox_inches="tight", dpi=110)

    return write_file(path, save, "the graph", "--graph")


def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def _op_summary(ops: Sequence[str]) -> str:
    """'Add x2 + LayerNormalization' for the ops a group absorbed, in graph order."""
    counts = collections.Counter(ops)
    names = list(dict.fromkeys(ops))
    return " + ".join(f"{op} x{counts[op]}" if counts[op] > 1 else op for op in names)


def _legend_patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(facecolor=color, edgecolor="#333333", label=label)
