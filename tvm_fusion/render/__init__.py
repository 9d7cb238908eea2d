"""Draw the fused graph (``tvm-fusion inspect --graph``): .png, .svg, or a zoomable, searchable .html.

Each fused instance is one box naming its variant and the ONNX ops it absorbed; every other
ONNX node is a box of its own (``model``). In .png/.svg, a run of identical blocks
(transformer layers, repeated conv stages) is drawn once, framed, with its count
(``repeats``); the .html draws every box, so search finds every node (``html``).
Layout (``layout``) and drawing (``draw``) are our own, so that this works on a fresh
machine without Graphviz.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from ..files import write_file
from .draw import pattern_colors, png_figure, svg
from .html import html_page
from .layout import layout
from .model import fused_graph
from .repeats import fold_repeats
from .plotting import check_drawing_path, save_figure

FORMATS = (".svg", ".png", ".html")


def check_graph_path(path: str | Path) -> Path:
    """The drawing's path if its format is one we write; raises ArtifactError otherwise."""
    return check_drawing_path(path, FORMATS, "the graph", "--graph")


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
    colors = pattern_colors(groups)
    if suffix == ".png":
        return save_figure(png_figure(scene, heading, colors), path, "the graph", "--graph")
    text = svg(scene, heading, colors, interactive=suffix == ".html")
    if suffix == ".html":
        text = html_page(heading, text)
    else:
        text = '<?xml version="1.0" encoding="utf-8"?>\n' + text
    return write_file(path, lambda staging: staging.write_text(text, encoding="utf-8"), "the graph", "--graph")
