"""Plain-text tables for the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import write_file


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A fixed-width table; ``align`` is one of 'l'/'r' per column (numbers right by default)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align = align or "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l"
                             for i in range(len(headers)))
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                               for c, w, a in zip(row, widths, align)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cut_middle(text: str, width: int) -> str:
    """``text`` at most ``width`` long, cut in the middle: kernel names that share a long prefix
    differ at the end (``..._relu5``, ``..._relu6``), so both ends stay."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "~" + text[len(text) - (width - 1 - head):]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 and value else f"{value:,.3f}".rstrip("0").rstrip(".")
    return str(value)


def write_json(path: str | os.PathLike, data, indent: int = 2, sort_keys: bool = False,
               flag: str = "--json") -> Path:
    """Write ``data`` as JSON atomically (temp file beside it, then rename): no half files; an
    unwritable path is an ArtifactError whose hint names ``flag``."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n"
    return write_file(path, lambda staging: staging.write_text(text), "JSON", flag)
