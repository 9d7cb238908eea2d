"""Where the fused graph's boxes and edges go, in inches from the top left: our own layered layout,
so that drawing works on a fresh machine (Graphviz's ``dot`` binary is not there).

Boxes are sized to their text, layers run top to bottom, and the layers wrap into side-by-side
columns so that a long model keeps a readable aspect; an edge that skips layers runs down a lane
at its column's right, one that crosses columns becomes a numbered connector pair.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

from .model import Graph

FONT_SIZE = 7.5  # points; at the .png's 110 dpi a line is 11 px, the size of small UI text
LINE = FONT_SIZE * 1.3 / 72  # inches per text line
_PAD_X, PAD_Y = 0.09, 0.06  # inches between a box's text and its border
_GAP_X, _GAP_Y = 0.2, 0.34  # between boxes in a layer, between layers
_COLUMN_GAP = 0.45
_LANE = 0.11  # between the lanes of layer-skipping edges
_ASPECT = 1.5  # width / height the columns aim for (a landscape screen or page)
CONNECTOR = 0.075  # radius of a connector circle, inches
_FRAME = 0.06  # between a frame and the boxes inside


@functools.lru_cache(maxsize=1)
def _advances() -> dict[str, float]:
    """Advance width of each ASCII character of DejaVu Sans (matplotlib's font), in em."""
    # deferred: matplotlib takes ~0.3 s to import, which every `import tvm_fusion` (and so
    # `tvm-fusion --help`) would pay; only a drawing needs the font.
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font, LoadFlags  # deferred: the same

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
    sizes = [(max(map(text_width, box.lines)) + 2 * _PAD_X, len(box.lines) * LINE + 2 * PAD_Y)
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
                paths.append([(out[0], start[1]), (out[0], out[1] - CONNECTOR)])
            arriving[b] += 1
            into = (target.x - target.width / 4 - (arriving[b] - 1) * 3 * CONNECTOR, target.y - _GAP_Y / 2)
            connectors.append((*into, tag))
            paths.append([(into[0], into[1] + CONNECTOR), (into[0], end[1])])
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
    height = max([b.y + b.height for b in boxes] + [y + CONNECTOR for _, y, _ in connectors], default=0.0)
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



def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default
