"""The laid-out fused graph drawn: as a matplotlib figure for .png, as SVG text for .svg and .html
(where the boxes carry ids and search text). Fused boxes are colored by pattern, with a legend."""

from __future__ import annotations

import html
from collections.abc import Sequence

from .layout import CONNECTOR, FONT_SIZE, LINE, PAD_Y, Scene, text_width

_PALETTE = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5",
            "#bc80bd", "#ccebc5", "#ffed6f"]
_PLAIN = "#f2f2f2"
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


def png_figure(scene: Scene, heading: str, colors: dict[str, str]):
    """The scene as a matplotlib Figure, 1 unit = 1 inch (saved by ``plotting.save_figure``)."""
    # deferred: matplotlib takes ~0.3 s to import, which every `import tvm_fusion` (and so
    # `tvm-fusion --help`) would pay; only a .png drawing needs it.
    from matplotlib.figure import Figure
    from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Rectangle  # deferred: the same
    from matplotlib.path import Path as MplPath  # deferred: the same

    width = max(scene.width, text_width(heading, 9)) + 2 * _MARGIN
    legend = _legend(colors, width - 2 * _MARGIN)
    top = _HEADER + LINE * 1.4 * len(legend)
    height = scene.height + top + _MARGIN
    figure = Figure(figsize=(width, height))
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(-_MARGIN, width - _MARGIN)
    axes.set_ylim(height - top, -top)  # inches, y down
    axes.axis("off")
    axes.text(0, -top + 0.1, heading, fontsize=9, va="top", ha="left")
    for number, entries in enumerate(legend):
        x, y = 0.0, -top + 0.38 + number * LINE * 1.4
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
        axes.add_patch(Circle((x, y), CONNECTOR, fc="white", ec="#555555", lw=0.7, zorder=3))
        axes.text(x, y, tag, fontsize=FONT_SIZE - 1.5, ha="center", va="center", zorder=4)
    for box, placed in zip(scene.graph.boxes, scene.boxes):
        fill = colors.get(box.pattern, _PLAIN)
        axes.add_patch(FancyBboxPatch((placed.x - placed.width / 2, placed.y), placed.width, placed.height,
                                      boxstyle="round,pad=0,rounding_size=0.05", fc=fill,
                                      ec="#333333" if box.pattern else "#999999", lw=0.8 if box.pattern else 0.5,
                                      zorder=2))
        axes.text(placed.x, placed.y + placed.height / 2, "\n".join(box.lines), fontsize=FONT_SIZE,
                  ha="center", va="center", linespacing=1.1, zorder=3)
    return figure


def svg(scene: Scene, heading: str, colors: dict[str, str], interactive: bool) -> str:
    """The scene as SVG (1 unit = 1 pt); with ``interactive``, the boxes carry ids and search text."""
    unit = 72.0
    width = max(scene.width, text_width(heading, 9)) + 2 * _MARGIN
    legend = _legend(colors, width - 2 * _MARGIN)
    top = _HEADER + LINE * 1.4 * len(legend)
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
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{pt(_MARGIN)}" y="{pt(0.1 + 9 / 72)}" font-size="9">{html.escape(heading)}</text>']
    for number, entries in enumerate(legend):
        x, y = 0.0, -top + 0.38 + number * LINE * 1.4
        for pattern, color in entries:
            out.append(f'<rect x="{pt(x + _MARGIN)}" y="{pt(y - 0.05 + top)}" width="{pt(0.18)}" height="{pt(0.1)}" '
                       f'fill="{color}" stroke="#333" stroke-width="0.6"/>'
                       f'<text x="{pt(x + 0.24 + _MARGIN)}" y="{pt(y + top)}" dominant-baseline="central">'
                       f'{html.escape(pattern)}</text>')
            x += text_width(pattern) + 0.35
    for x, y, w, h, label in scene.frames:
        out.append(f'<rect x="{pt(x + _MARGIN)}" y="{pt(y + top)}" width="{pt(w)}" height="{pt(h)}" rx="4" '
                   f'fill="#fafafa" stroke="#555" stroke-dasharray="4 3"/>'
                   f'<rect x="{pt(x + 0.06 + _MARGIN)}" y="{pt(y + top - LINE / 2)}" '
                   f'width="{pt(text_width(label) + 0.04)}" height="{pt(LINE)}" fill="white"/>'
                   f'<text x="{pt(x + 0.08 + _MARGIN)}" y="{pt(y + top)}" font-weight="bold" '
                   f'dominant-baseline="central">{html.escape(label)}</text>')
    for points in scene.paths:
        out.append(f'<polyline points="{" ".join(xy(x, y) for x, y in points)}" fill="none" stroke="#777" '
                   f'stroke-width="0.7" marker-end="url(#arrow)"/>')
    for x, y, tag in scene.connectors:
        out.append(f'<circle cx="{pt(x + _MARGIN)}" cy="{pt(y + top)}" r="{pt(CONNECTOR)}" fill="white" '
                   f'stroke="#555" stroke-width="0.7"/><text x="{pt(x + _MARGIN)}" y="{pt(y + top)}" '
                   f'font-size="{FONT_SIZE - 1.5}" text-anchor="middle" dominant-baseline="central">{tag}</text>')
    for number, (box, placed) in enumerate(zip(scene.graph.boxes, scene.boxes)):
        fill = colors.get(box.pattern, _PLAIN)
        members = "\n".join(box.members)
        search = " ".join([*box.lines, *box.members]).lower()
        attributes = f' id="box{number}" class="box" data-search="{html.escape(search)}"' if interactive else ""
        left, first_line = placed.x - placed.width / 2, placed.y + PAD_Y + LINE * 0.78
        out.append(f'<g{attributes}><title>{html.escape(members)}</title>'
                   f'<rect x="{pt(left + _MARGIN)}" y="{pt(placed.y + top)}" width="{pt(placed.width)}" '
                   f'height="{pt(placed.height)}" rx="3.5" fill="{fill}" '
                   f'stroke="{"#333" if box.pattern else "#999"}" stroke-width="{0.8 if box.pattern else 0.5}"/>')
        for index, line in enumerate(box.lines):
            out.append(f'<text x="{pt(placed.x + _MARGIN)}" y="{pt(first_line + index * LINE + top)}" '
                       f'text-anchor="middle">{html.escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)



def pattern_colors(groups: Sequence) -> dict[str, str]:
    """A palette color for each pattern among ``groups`` (``api.FusedNodes``), in order of appearance."""
    return {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(dict.fromkeys(g.pattern for g in groups))}
