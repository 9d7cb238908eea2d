"""Draw the fused graph (``tvm-fusion inspect --graph``): .png, .svg, or a zoomable, searchable .html.

Each fused instance is one box naming its variant and the ONNX ops it absorbed; every other
ONNX node is a box of its own. Shape arithmetic (nodes whose inputs are all constant once
shapes are bound, as TVM folds them) is not drawn. Our own layered layout, so it works on a
fresh machine (Graphviz's ``dot`` binary is not there): boxes sized to their text in inches,
layers top to bottom, the layers wrapped into side-by-side columns so a long model keeps a
readable aspect; an edge that skips layers runs down a lane at the column's right, one that
crosses columns is a numbered connector pair. In .png/.svg, a run of identical blocks
(transformer layers, repeated conv stages) is drawn once, framed, with its count; the .html
draws every box (so search finds every node) with wheel zoom, drag, search and, on hover,
the ONNX nodes each box absorbed, all inline: no network needed to open it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import html
from collections.abc import Sequence
from pathlib import Path

import onnx

from .errors import ArtifactError
from .files import check_writable, write_file

FORMATS = (".svg", ".png", ".html")
_PALETTE = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5",
            "#bc80bd", "#ccebc5", "#ffed6f"]
_PLAIN = "#f2f2f2"
FONT_SIZE = 7.5  # points; at the .png's 110 dpi a line is 11 px, the size of small UI text
_LINE = FONT_SIZE * 1.3 / 72  # inches per text line
_PAD_X, _PAD_Y = 0.09, 0.06  # inches between a box's text and its border
_GAP_X, _GAP_Y = 0.2, 0.34  # between boxes in a layer, between layers
_COLUMN_GAP = 0.45
_LANE = 0.11  # between the lanes of layer-skipping edges
_WRAP = 40  # characters per line of a fused box's op summary
_ASPECT = 1.5  # width / height the columns aim for (a landscape screen or page)
_DPI = 110


def check_graph_path(path: str | Path) -> Path:
    """The drawing's path if its format is one we write; raises ArtifactError otherwise."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ArtifactError(f"cannot draw the graph to {path}: unknown format {path.suffix or '(none)'}",
                            "give --graph a path ending in .svg, .png or .html")
    if path.parent and path.parent.exists() and not path.parent.is_dir():
        raise ArtifactError(f"cannot draw the graph to {path}: {path.parent} is not a directory",
                            "give --graph a path in an existing directory")
    check_writable(path.parent, f"the graph {path.name}", "--graph")
    return path


# the graph to draw ------------------------------------------------------------------------------

@dataclasses.dataclass
class Box:
    lines: list[str]  # the text drawn: variant and wrapped op summary, or the op type
    pattern: str | None  # the pattern of a fused box
    members: list[str]  # "name (OpType)" of each ONNX node in it, for hover and search


@dataclasses.dataclass
class Graph:
    boxes: list[Box]
    edges: list[tuple[int, int]]
    folded_nodes: int  # shape-arithmetic nodes not drawn
    frames: list[tuple[list[int], int]] = dataclasses.field(default_factory=list)  # (boxes of a block, count)


def fused_graph(model: onnx.ModelProto, groups: Sequence) -> Graph:
    """The graph with every group (``api.FusedNodes``: pattern, variant, ops, indices into
    ``model.graph.node``) collapsed into one box and shape arithmetic left out."""
    owner = {}
    for number, group in enumerate(groups):
        for index in group.indices:
            owner.setdefault(index, number)
    hidden = constant_nodes(model) - set(owner)
    boxes: list[Box] = []
    box_of: dict = {}
    for index, node in enumerate(model.graph.node):
        if index in hidden:
            continue
        key = ("group", owner[index]) if index in owner else ("node", index)
        if key not in box_of:
            box_of[key] = len(boxes)
            if key[0] == "group":
                group = groups[key[1]]
                members = [f"{model.graph.node[i].name or f'#{i}'} ({model.graph.node[i].op_type})"
                           for i in group.indices]
                boxes.append(Box([group.variant, *_op_summary(group.ops)], group.pattern, members))
            else:
                boxes.append(Box([node.op_type], None, [f"{node.name or f'#{index}'} ({node.op_type})"]))
        box_of[("node", index)] = box_of[key]
    edges = {(box_of[("node", a)], box_of[("node", b)]) for a, b in node_edges(model)
             if ("node", a) in box_of and ("node", b) in box_of}
    return Graph(boxes, sorted(e for e in edges if e[0] != e[1]), len(hidden))


def constant_nodes(model: onnx.ModelProto) -> set[int]:
    """Nodes computing constants once shapes are bound (Shape, Size, Constant and whatever reads
    only initializers and their outputs): TVM folds them, they are no kernel."""
    constant = {t.name for t in model.graph.initializer}
    found = set()
    for index, node in enumerate(model.graph.node):
        if node.op_type in ("Constant", "Shape", "Size") or (
                node.input and all(not name or name in constant for name in node.input)
                and not node.op_type.startswith("Random") and node.op_type != "Dropout"):
            found.add(index)
            constant.update(node.output)
    return found


def node_edges(model: onnx.ModelProto) -> list[tuple[int, int]]:
    """(producer, consumer) node indices for every tensor passed between nodes."""
    producer = {out: i for i, node in enumerate(model.graph.node) for out in node.output}
    return sorted({(producer[name], i) for i, node in enumerate(model.graph.node)
                   for name in node.input if name in producer})


# repeated blocks ---------------------------------------------------------------------------------

def find_repeats(graph: Graph, min_period: int = 3) -> list[tuple[int, int, int]]:
    """(start, period, count) of runs of identical consecutive blocks of boxes, largest saving
    first, not overlapping: same texts box by box, the same edges inside each block, each block
    connected and reading the one before it (layers in sequence, not parallel branches that
    happen to look alike, such as an FPN's levels)."""
    texts = [tuple(box.lines) for box in graph.boxes]
    parents = collections.defaultdict(set)
    for a, b in graph.edges:
        parents[b].add(a)
    count = len(texts)

    def inner(start: int, period: int) -> tuple:
        """The block's own edges, relative to its start; edges from outside it are not compared."""
        return tuple(sorted((p - start, b - start) for b in range(start, start + period)
                            for p in parents[b] if start <= p < start + period))

    runs = []
    taken: set[int] = set()
    while True:
        best = None
        for start in range(count):
            for period in range(min_period, (count - start) // 2 + 1):
                if texts[start] != texts[start + period] or texts[start:start + period] != texts[
                        start + period:start + 2 * period]:
                    continue
                shape, repeats = inner(start, period), 1
                if not _connected(period, shape):
                    continue
                while (start + (repeats + 1) * period <= count
                       and texts[start:start + period] == texts[start + repeats * period:start + (repeats + 1) * period]
                       and inner(start + repeats * period, period) == shape
                       and _follows(parents, start + (repeats - 1) * period, start + repeats * period, period)):
                    repeats += 1
                span = set(range(start, start + repeats * period))
                if repeats > 1 and not span & taken and (best is None or (repeats - 1) * period > best[0]):
                    best = ((repeats - 1) * period, start, period, repeats)
        if best is None:
            return sorted(runs)
        _, start, period, repeats = best
        runs.append((start, period, repeats))
        taken |= set(range(start, start + repeats * period))


def _follows(parents: dict, before: int, after: int, period: int) -> bool:
    """True if the block at ``after`` reads the block at ``before`` and nothing before it reads
    the block at ``after`` (in sequence, not a chain running the other way through the copies)."""
    reads = any(before <= p < after for b in range(after, after + period) for p in parents[b])
    read_back = any(after <= p < after + period for b in range(after) for p in parents[b])
    return reads and not read_back


def _connected(count: int, edges: tuple) -> bool:
    """True if ``edges`` (between 0..count-1) join all of 0..count-1, directions ignored."""
    reached, frontier = {0}, [0]
    while frontier:
        box = frontier.pop()
        for a, b in edges:
            for here, there in ((a, b), (b, a)):
                if here == box and there not in reached:
                    reached.add(there)
                    frontier.append(there)
    return len(reached) == count


def fold_repeats(graph: Graph) -> Graph:
    """The graph with each run of identical blocks drawn once: edges of the later copies go to
    the first; edges from one copy to the next are left out (the frame says it repeats)."""
    runs = find_repeats(graph)
    if not runs:
        return graph
    target, copy_of = {}, {}
    for start, period, repeats in runs:
        for box in range(start, start + period * repeats):
            target[box] = start + (box - start) % period
            copy_of[box] = (start, (box - start) // period)
    kept = [box for box in range(len(graph.boxes)) if target.get(box, box) == box]
    renumber = {box: new for new, box in enumerate(kept)}
    edges = set()
    for a, b in graph.edges:
        if a in copy_of and b in copy_of and copy_of[a][0] == copy_of[b][0] and copy_of[a][1] != copy_of[b][1]:
            continue
        edge = (renumber[target.get(a, a)], renumber[target.get(b, b)])
        if edge[0] != edge[1]:
            edges.add(edge)
    frames = [([renumber[box] for box in range(start, start + period)], repeats) for start, period, repeats in runs]
    return Graph([graph.boxes[box] for box in kept], sorted(edges), graph.folded_nodes, frames)


# layout -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _advances() -> dict[str, float]:
    """Advance width of each ASCII character of DejaVu Sans (matplotlib's font), in em."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font, LoadFlags

    font = FT2Font(font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans")))
    font.set_size(100, 72)
    return {chr(c): font.load_char(c, flags=LoadFlags.NO_HINTING).linearHoriAdvance / 65536 / 100
            for c in range(32, 127)}


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """Width of ``text`` in inches (10% spare for browsers' other sans-serif fonts)."""
    advances = _advances()
    return 1.1 * size / 72 * sum(advances.get(c, 1.0) for c in text)


@dataclasses.dataclass
class Placed:
    x: float  # center, inches from the left
    y: float  # top, inches from the top
    width: float
    height: float
    column: int


@dataclasses.dataclass
class Scene:
    """Everything to draw, in inches from the top left."""

    graph: Graph
    boxes: list[Placed]
    paths: list[list[tuple[float, float]]]  # edges as polylines, the arrow at the end
    connectors: list[tuple[float, float, str]]  # numbered ends of edges that cross columns
    frames: list[tuple[float, float, float, float, str]]  # x, y, width, height, label
    width: float
    height: float


def layers_of(count: int, edges: list[tuple[int, int]]) -> list[int]:
    """Longest-path layer of each box (Kahn's order: a collapsed group may come after boxes
    with higher numbers; a box on a cycle, a group not convex in ONNX terms, goes after its
    placed parents)."""
    parents, children = collections.defaultdict(list), collections.defaultdict(list)
    for a, b in edges:
        parents[b].append(a)
        children[a].append(b)
    waiting = {box: len(parents[box]) for box in range(count)}
    ready = collections.deque(box for box in range(count) if not waiting[box])
    layer: dict[int, int] = {}
    while ready:
        box = ready.popleft()
        layer[box] = 1 + max((layer[p] for p in parents[box]), default=-1)
        for child in children[box]:
            waiting[child] -= 1
            if not waiting[child]:
                ready.append(child)
    for box in range(count):
        if box not in layer:
            layer[box] = 1 + max((layer[p] for p in parents[box] if p in layer), default=-1)
    return [layer[box] for box in range(count)]


def layout(graph: Graph) -> Scene:
    """Place the boxes in layers, wrap the layers into columns, route the edges."""
    count = len(graph.boxes)
    sizes = [(max(map(text_width, box.lines)) + 2 * _PAD_X, len(box.lines) * _LINE + 2 * _PAD_Y)
             for box in graph.boxes]
    layer = layers_of(count, graph.edges)
    rows = [[b for b in range(count) if layer[b] == d] for d in range(max(layer, default=-1) + 1)]
    row_height = [max(sizes[b][1] for b in row) for row in rows]
    row_width = [sum(sizes[b][0] for b in row) + _GAP_X * (len(row) - 1) for row in rows]
    inside_frames = {r for members, _ in graph.frames
                     for r in range(min(layer[b] for b in members) + 1, max(layer[b] for b in members) + 1)}
    breaks = _column_breaks(row_height, row_width, layer, graph.edges, inside_frames)
    parents = collections.defaultdict(list)
    for a, b in graph.edges:
        parents[b].append(a)
    boxes: list[Placed | None] = [None] * count
    row_top, column_width = {}, []
    for column, (first, end) in enumerate(zip(breaks, breaks[1:])):  # x from the column's left for now
        width, y = max(row_width[first:end]), 0.0
        for d in range(first, end):
            row = sorted(rows[d], key=lambda b: _mean([boxes[p].x for p in parents[b] if boxes[p]], b * 1e-6))
            x = (width - row_width[d]) / 2
            for b in row:
                boxes[b] = Placed(x + sizes[b][0] / 2, y, sizes[b][0], sizes[b][1], column)
                x += sizes[b][0] + _GAP_X
            row_top[d] = y
            y += row_height[d] + _GAP_Y
        column_width.append(width)
    lanes: dict[int, list[list[tuple[int, int]]]] = collections.defaultdict(list)
    lane_of = {}
    for a, b in graph.edges:  # an edge that skips layers and would cross a box gets a lane free over its span
        if boxes[a].column == boxes[b].column and layer[b] - layer[a] > 1 and _crosses(
                boxes[a], boxes[b], [boxes[c] for d in range(layer[a] + 1, layer[b]) for c in rows[d]]):
            used = lanes[boxes[a].column]
            lane = next(i for i in range(len(used) + 1)
                        if i == len(used) or all(s[1] <= layer[a] or s[0] >= layer[b] for s in used[i]))
            if lane == len(used):
                used.append([])
            used[lane].append((layer[a], layer[b]))
            lane_of[(a, b)] = lane
    left, lefts = 0.0, []
    for column, width in enumerate(column_width):
        lefts.append(left)
        left += width + (_LANE * (len(lanes[column]) + 1) if lanes[column] else 0) + _COLUMN_GAP
    for box in boxes:
        box.x += lefts[box.column]
    paths, connectors, tags, arriving = [], [], {}, collections.Counter()
    for a, b in graph.edges:
        source, target = boxes[a], boxes[b]
        start, end = (source.x, source.y + source.height), (target.x, target.y)
        if source.column != target.column:  # a numbered connector at each end
            tag = tags.setdefault(a, str(len(tags) + 1))
            out = (source.x + source.width / 4, source.y + source.height + _GAP_Y / 2)
            if (*out, tag) not in connectors:
                connectors.append((*out, tag))
                paths.append([(out[0], start[1]), (out[0], out[1] - _CONNECTOR)])
            arriving[b] += 1
            into = (target.x - target.width / 4 - (arriving[b] - 1) * 3 * _CONNECTOR, target.y - _GAP_Y / 2)
            connectors.append((*into, tag))
            paths.append([(into[0], into[1] + _CONNECTOR), (into[0], end[1])])
        elif (a, b) in lane_of:  # down a lane right of the column, clear of the boxes in between
            lane = lane_of[(a, b)]
            x_lane = lefts[source.column] + column_width[source.column] + _LANE * (lane + 1)
            offset = _GAP_Y * (0.25 + 0.5 * (lane % 4) / 4)  # horizontal runs of lanes apart
            below = row_top[layer[a]] + row_height[layer[a]] + offset
            above = target.y - offset
            paths.append([start, (start[0], below), (x_lane, below), (x_lane, above), (end[0], above), end])
        else:
            paths.append([start, end])
    frames = []
    for members, repeats in graph.frames:
        for column in sorted({boxes[b].column for b in members}):
            inside = [boxes[b] for b in members if boxes[b].column == column]
            x0 = min(b.x - b.width / 2 for b in inside) - _FRAME
            y0 = min(b.y for b in inside) - _FRAME
            x1 = max(b.x + b.width / 2 for b in inside) + _FRAME
            y1 = max(b.y + b.height for b in inside) + _FRAME
            frames.append((x0, y0, x1 - x0, y1 - y0, f"this block x{repeats}"))
    width = left - _COLUMN_GAP
    height = max([b.y + b.height for b in boxes] + [y + _CONNECTOR for _, y, _ in connectors], default=0.0)
    return Scene(graph, boxes, paths, connectors, frames, width, height)


def _crosses(source: Placed, target: Placed, between: list[Placed]) -> bool:
    """True if the straight edge from ``source`` to ``target`` passes over one of ``between``."""
    (x0, y0), (x1, y1) = (source.x, source.y + source.height), (target.x, target.y)
    for box in between:
        for y in (box.y - 0.03, box.y + box.height + 0.03):  # the edge's x at the box's top and bottom
            x = x0 + (x1 - x0) * (y - y0) / (y1 - y0)
            if abs(x - box.x) <= box.width / 2 + 0.05:
                return True
    return False


_CONNECTOR = 0.075  # radius of a connector circle, inches
_FRAME = 0.06  # between a frame and the boxes inside


def _column_breaks(row_height: list[float], row_width: list[float], layer: list[int],
                   edges: list[tuple[int, int]], inside_frames: set[int]) -> list[int]:
    """Row indices where columns start (and the end): as many columns as bring the picture
    nearest ``_ASPECT``, each break at the row boundary fewest edges cross near the even split,
    not inside a folded block's frame (rows in ``inside_frames``) unless no other is near."""
    total = sum(h + _GAP_Y for h in row_height)
    widest = max(row_width, default=1.0)
    columns = min(range(1, len(row_height) + 1 or 2),
                  key=lambda c: abs((c * (widest + _COLUMN_GAP)) / (total / c) - _ASPECT))
    crossing = [0] * (len(row_height) + 1)
    for a, b in edges:
        for boundary in range(layer[a] + 1, layer[b] + 1):
            crossing[boundary] += 1
    tops = [0.0]
    for h in row_height:
        tops.append(tops[-1] + h + _GAP_Y)
    breaks = [0]
    for k in range(1, columns):
        ideal = total * k / columns
        rows = range(breaks[-1] + 1, len(row_height))
        near = [r for r in rows if abs(tops[r] - ideal) <= 0.1 * total / columns and r not in inside_frames]
        outside = [r for r in rows if abs(tops[r] - ideal) <= 0.4 * total / columns and r not in inside_frames]
        if near:
            breaks.append(min(near, key=lambda r: (crossing[r], abs(tops[r] - ideal))))
        elif outside or rows:
            breaks.append(min(outside or rows, key=lambda r: abs(tops[r] - ideal)))
    return breaks + [len(row_height)]


# drawing ----------------------------------------------------------------------------------------

def render_fusion_graph(model: onnx.ModelProto, groups: Sequence, path: str | Path, title: str = "") -> Path:
    """Draw the fused graph of ``model`` to ``path`` (.png, .svg or .html), written atomically."""
    path = check_graph_path(path)
    graph = fused_graph(model, groups)
    suffix = path.suffix.lower()
    heading = (f"{title}: " if title else "") + (
        f"{len(model.graph.node)} ONNX nodes, {len(groups)} fused instances, {len(graph.boxes)} boxes"
        + (f" ({graph.folded_nodes} shape-arithmetic nodes folded, not drawn)" if graph.folded_nodes else ""))
    if suffix != ".html":
        graph = fold_repeats(graph)
    scene = layout(graph)
    colors = {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(dict.fromkeys(g.pattern for g in groups))}
    if suffix == ".png":
        return write_file(path, lambda staging: _draw_png(scene, staging, heading, colors), "the graph", "--graph")
    text = _svg(scene, heading, colors, interactive=suffix == ".html")
    if suffix == ".html":
        text = _HTML.replace("$TITLE", html.escape(heading)).replace("$SVG", text)
    else:
        text = '<?xml version="1.0" encoding="utf-8"?>\n' + text
    return write_file(path, lambda staging: staging.write_text(text, encoding="utf-8"), "the graph", "--graph")


_HEADER = 0.55  # inches above the graph: the heading and the legend
_MARGIN = 0.2


def _legend(colors: dict[str, str], width: float) -> list[list[tuple[str, str]]]:
    """The legend's entries (pattern, color) in lines that fit ``width`` inches."""
    lines, current, used = [], [], 0.0
    for pattern, color in colors.items():
        entry = text_width(pattern) + 0.35
        if current and used + entry > width:
            lines.append(current)
            current, used = [], 0.0
        current.append((pattern, color))
        used += entry
    return lines + ([current] if current else [])


def _draw_png(scene: Scene, path: Path, heading: str, colors: dict[str, str]) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Rectangle
    from matplotlib.path import Path as MplPath

    width = max(scene.width, text_width(heading, 9)) + 2 * _MARGIN
    legend = _legend(colors, width - 2 * _MARGIN)
    top = _HEADER + _LINE * 1.4 * len(legend)
    height = scene.height + top + _MARGIN
    figure = Figure(figsize=(width, height))
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(-_MARGIN, width - _MARGIN)
    axes.set_ylim(height - top, -top)  # inches, y down
    axes.axis("off")
    axes.text(0, -top + 0.1, heading, fontsize=9, va="top", ha="left")
    for number, entries in enumerate(legend):
        x, y = 0.0, -top + 0.38 + number * _LINE * 1.4
        for pattern, color in entries:
            axes.add_patch(Rectangle((x, y - 0.05), 0.18, 0.1, fc=color, ec="#333333", lw=0.6))
            axes.text(x + 0.24, y, pattern, fontsize=FONT_SIZE, va="center")
            x += text_width(pattern) + 0.35
    for x, y, w, h, label in scene.frames:
        axes.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06", fc="#fafafa",
                                      ec="#555555", lw=0.9, ls="--", zorder=0))
        axes.text(x + 0.08, y, label, fontsize=FONT_SIZE, fontweight="bold", va="center", ha="left", zorder=4,
                  bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none"})
    for points in scene.paths:
        codes = [MplPath.MOVETO] + [MplPath.LINETO] * (len(points) - 1)
        axes.add_patch(FancyArrowPatch(path=MplPath(points, codes), arrowstyle="-|>,head_length=3,head_width=1.6",
                                       color="#777777", lw=0.7, zorder=1, shrinkA=0, shrinkB=0))
    for x, y, tag in scene.connectors:
        axes.add_patch(Circle((x, y), _CONNECTOR, fc="white", ec="#555555", lw=0.7, zorder=3))
        axes.text(x, y, tag, fontsize=FONT_SIZE - 1.5, ha="center", va="center", zorder=4)
    for box, placed in zip(scene.graph.boxes, scene.boxes):
        fill = colors.get(box.pattern, _PLAIN)
        axes.add_patch(FancyBboxPatch((placed.x - placed.width / 2, placed.y), placed.width, placed.height,
                                      boxstyle="round,pad=0,rounding_size=0.05", fc=fill,
                                      ec="#333333" if box.pattern else "#999999", lw=0.8 if box.pattern else 0.5,
                                      zorder=2))
        axes.text(placed.x, placed.y + placed.height / 2, "\n".join(box.lines), fontsize=FONT_SIZE,
                  ha="center", va="center", linespacing=1.1, zorder=3)
    figure.savefig(path, format="png", dpi=_DPI)


def _svg(scene: Scene, heading: str, colors: dict[str, str], interactive: bool) -> str:
    """The scene as SVG (1 unit = 1 pt); with ``interactive``, the boxes carry ids and search text."""
    unit = 72.0
    width = max(scene.width, text_width(heading, 9)) + 2 * _MARGIN
    legend = _legend(colors, width - 2 * _MARGIN)
    top = _HEADER + _LINE * 1.4 * len(legend)
    height = scene.height + top + _MARGIN

    def pt(value: float) -> str:
        return f"{value * unit:.1f}"

    def xy(x: float, y: float) -> str:
        return f"{pt(x + _MARGIN)},{pt(y + top)}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {pt(width)} {pt(height)}" '
           f'width="{pt(width)}pt" height="{pt(height)}pt" font-family="DejaVu Sans, Verdana, sans-serif" '
           f'font-size="{FONT_SIZE}">',
           '<defs><marker id="arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="6" markerHeight="6" '
           'orient="auto"><path d="M0,0.8 L6,3 L0,5.2 z" fill="#777"/></marker></defs>',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{pt(_MARGIN)}" y="{pt(0.1 + 9 / 72)}" font-size="9">{html.escape(heading)}</text>']
    for number, entries in enumerate(legend):
        x, y = 0.0, -top + 0.38 + number * _LINE * 1.4
        for pattern, color in entries:
            out.append(f'<rect x="{pt(x + _MARGIN)}" y="{pt(y - 0.05 + top)}" width="{pt(0.18)}" height="{pt(0.1)}" '
                       f'fill="{color}" stroke="#333" stroke-width="0.6"/>'
                       f'<text x="{pt(x + 0.24 + _MARGIN)}" y="{pt(y + top)}" dominant-baseline="central">'
                       f'{html.escape(pattern)}</text>')
            x += text_width(pattern) + 0.35
    for x, y, w, h, label in scene.frames:
        out.append(f'<rect x="{pt(x + _MARGIN)}" y="{pt(y + top)}" width="{pt(w)}" height="{pt(h)}" rx="4" '
                   f'fill="#fafafa" stroke="#555" stroke-dasharray="4 3"/>'
                   f'<rect x="{pt(x + 0.06 + _MARGIN)}" y="{pt(y + top - _LINE / 2)}" '
                   f'width="{pt(text_width(label) + 0.04)}" height="{pt(_LINE)}" fill="white"/>'
                   f'<text x="{pt(x + 0.08 + _MARGIN)}" y="{pt(y + top)}" font-weight="bold" '
                   f'dominant-baseline="central">{html.escape(label)}</text>')
    for points in scene.paths:
        out.append(f'<polyline points="{" ".join(xy(x, y) for x, y in points)}" fill="none" stroke="#777" '
                   f'stroke-width="0.7" marker-end="url(#arrow)"/>')
    for x, y, tag in scene.connectors:
        out.append(f'<circle cx="{pt(x + _MARGIN)}" cy="{pt(y + top)}" r="{pt(_CONNECTOR)}" fill="white" '
                   f'stroke="#555" stroke-width="0.7"/><text x="{pt(x + _MARGIN)}" y="{pt(y + top)}" '
                   f'font-size="{FONT_SIZE - 1.5}" text-anchor="middle" dominant-baseline="central">{tag}</text>')
    for number, (box, placed) in enumerate(zip(scene.graph.boxes, scene.boxes)):
        fill = colors.get(box.pattern, _PLAIN)
        members = "\n".join(box.members)
        search = " ".join([*box.lines, *box.members]).lower()
        attributes = f' id="box{number}" class="box" data-search="{html.escape(search)}"' if interactive else ""
        left, first_line = placed.x - placed.width / 2, placed.y + _PAD_Y + _LINE * 0.78
        out.append(f'<g{attributes}><title>{html.escape(members)}</title>'
                   f'<rect x="{pt(left + _MARGIN)}" y="{pt(placed.y + top)}" width="{pt(placed.width)}" '
                   f'height="{pt(placed.height)}" rx="3.5" fill="{fill}" '
                   f'stroke="{"#333" if box.pattern else "#999"}" stroke-width="{0.8 if box.pattern else 0.5}"/>')
        for index, line in enumerate(box.lines):
            out.append(f'<text x="{pt(placed.x + _MARGIN)}" y="{pt(first_line + index * _LINE + top)}" '
                       f'text-anchor="middle">{html.escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


_HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>$TITLE</title>
<style>
body { margin: 0; font: 13px DejaVu Sans, Verdana, sans-serif; overflow: hidden; }
#bar { position: fixed; top: 0; left: 0; right: 0; padding: 6px 10px; background: #eee; border-bottom: 1px solid #bbb;
       display: flex; gap: 10px; align-items: center; z-index: 1; }
#bar input { width: 22em; }
#view { position: absolute; top: 36px; left: 0; right: 0; bottom: 0; cursor: grab; }
#view svg { width: 100%; height: 100%; }
#info { position: fixed; right: 10px; bottom: 10px; max-width: 40em; max-height: 40vh; overflow: auto; background: #fff;
        border: 1px solid #999; padding: 6px 10px; white-space: pre; display: none; }
.box.dim { opacity: 0.25; }
.box.match rect { stroke: #d00; stroke-width: 2.5; }
.box.current rect { stroke: #00c; stroke-width: 3.5; }
</style></head><body>
<div id="bar"><input id="search" type="search" placeholder="search ops, variants, ONNX node names (Enter: next)">
<span id="count"></span><button id="fit">fit</button>
<span>wheel: zoom, drag: pan, hover or click a box: the ONNX nodes in it</span></div>
<div id="view">$SVG</div><div id="info"></div>
<script>
const svg = document.querySelector("#view svg"), full = svg.viewBox.baseVal;
const home = [full.x, full.y, full.width, full.height];
let box = home.slice(), matches = [], current = -1;
svg.removeAttribute("width"); svg.removeAttribute("height");
function show() { svg.setAttribute("viewBox", box.join(" ")); }
function point(event) {
  const r = svg.getBoundingClientRect(), s = Math.max(box[2] / r.width, box[3] / r.height);
  return [box[0] + (event.clientX - r.left - (r.width - box[2] / s) / 2) * s,
          box[1] + (event.clientY - r.top - (r.height - box[3] / s) / 2) * s];
}
svg.addEventListener("wheel", e => {
  e.preventDefault();
  const [x, y] = point(e), k = Math.exp(e.deltaY * 0.0015);
  box = [x - (x - box[0]) * k, y - (y - box[1]) * k, box[2] * k, box[3] * k]; show();
}, {passive: false});
let drag = null;
svg.addEventListener("mousedown", e => { drag = point(e); });
window.addEventListener("mouseup", () => { drag = null; });
window.addEventListener("mousemove", e => {
  if (!drag) return;
  const [x, y] = point(e); box[0] -= x - drag[0]; box[1] -= y - drag[1]; show();
});
document.getElementById("fit").onclick = () => { box = home.slice(); show(); };
function focus(g) {
  const b = g.getBBox(), w = Math.max(b.width * 4, 500), h = w * box[3] / box[2];
  box = [b.x + b.width / 2 - w / 2, b.y + b.height / 2 - h / 2, w, h]; show();
}
const boxes = Array.from(document.querySelectorAll(".box")), info = document.getElementById("info");
document.getElementById("search").addEventListener("input", e => {
  const q = e.target.value.trim().toLowerCase();
  matches = q ? boxes.filter(g => g.dataset.search.includes(q)) : [];
  boxes.forEach(g => { g.classList.toggle("match", matches.includes(g)); g.classList.toggle("dim", !!q && !matches.includes(g));
                       g.classList.remove("current"); });
  document.getElementById("count").textContent = q ? matches.length + " match" + (matches.length == 1 ? "" : "es") : "";
  current = -1;
});
document.getElementById("search").addEventListener("keydown", e => {
  if (e.key != "Enter" || !matches.length) return;
  if (current >= 0) matches[current].classList.remove("current");
  current = (current + 1) % matches.length; matches[current].classList.add("current"); focus(matches[current]);
});
if (location.hash.startsWith("#search=")) {  // a link to a search: file:///...html#search=softmax
  const input = document.getElementById("search");
  input.value = decodeURIComponent(location.hash.slice(8));
  input.dispatchEvent(new Event("input"));
  input.dispatchEvent(new KeyboardEvent("keydown", {key: "Enter"}));
}
boxes.forEach(g => g.addEventListener("click", () => {
  info.textContent = g.querySelector("title").textContent; info.style.display = "block";
}));
</script></body></html>
"""


def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def _op_summary(ops: Sequence[str]) -> list[str]:
    """'Add x2 + LayerNormalization' for the ops a group absorbed, in graph order, in lines of
    at most ``_WRAP`` characters broken between ops."""
    counts = collections.Counter(ops)
    lines = [""]
    for op in dict.fromkeys(ops):
        item = f"{op} x{counts[op]}" if counts[op] > 1 else op
        if lines[-1] and len(lines[-1]) + len(item) + 3 > _WRAP:
            lines[-1] += " +"
            lines.append(item)
        else:
            lines[-1] += (" + " if lines[-1] else "") + item
    return lines
