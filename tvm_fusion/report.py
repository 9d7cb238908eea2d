"""Plain-text tables for the CLI, fitted to the terminal, and JSON written atomically."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from .files import write_file

MIN_CUT_WIDTH = 12  # a text column is not cut narrower than this
_wide = False


def set_wide(wide: bool) -> None:
    """``--wide``: tables keep every character however wide the terminal."""
    global _wide
    _wide = wide


def terminal_width() -> int | None:
    """The terminal's columns when stdout is one (``COLUMNS`` wins), else None: output piped to
    a file or another program keeps every character."""
    if _wide or not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def table(headers: list[str], rows: list[list], align: str | None = None, width: int | None = -1) -> str:
    """A fixed-width table; ``align`` is one of 'l'/'r' per column (numbers right by default).

    Wider than ``width`` (default: the terminal's, ``terminal_width``; None: no limit), its
    widest text columns are cut in the middle (``cut_middle``) until it fits."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align = align or "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l"
                             for i in range(len(headers)))
    limit = terminal_width() if width == -1 else width
    if limit is not None:
        widths = _fitted(widths, align, limit)
        cells = [[cut_middle(c, w) for c, w in zip(row, widths)] for row in cells]
    lines = []
    for index, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                               for c, w, a in zip(row, widths, align)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fitted(widths: list[int], align: str, limit: int) -> list[int]:
    """Column widths whose table fits ``limit``: the widest text column shrunk first, none
    under ``MIN_CUT_WIDTH`` (a table of too many columns stays wider than the limit)."""
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > limit:
        text = [i for i, a in enumerate(align) if a == "l" and widths[i] > MIN_CUT_WIDTH]
        if not text:
            break
        widest = max(text, key=lambda i: widths[i])
        over = sum(widths) + 2 * (len(widths) - 1) - limit
        widths[widest] = max(MIN_CUT_WIDTH, widths[widest] - over)
    return widths


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
