"""The fused graph to draw: one box per fused instance (its variant and the ONNX ops it absorbed),
one per other ONNX node; shape arithmetic, which TVM folds into constants, is left out."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import onnx

_WRAP = 40  # characters per line of a fused box's op summary


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
