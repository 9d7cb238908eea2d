"""What every drawing we write shares (``inspect --graph``, ``profile --plot``): the path checked
before the work it would hold, and a matplotlib figure saved atomically, with no display and no
pyplot state (a figure of its own, whatever backend the caller's process set)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError
from ..files import check_writable, write_file

DPI = 110  # a .png's pixels per inch: at the graph's 7.5 pt a text line is 11 px


def check_drawing_path(path: str | Path, formats: tuple[str, ...], what: str, flag: str) -> Path:
    """``path`` if its format is one of ``formats`` and its folder can take it; otherwise an
    ArtifactError naming ``what`` is drawn and the ``flag`` to fix."""
    path = Path(path)
    if path.suffix.lower() not in formats:
        listed = " or ".join([", ".join(formats[:-1]), formats[-1]] if len(formats) > 1 else formats)
        raise ArtifactError(f"cannot draw {what} to {path}: unknown format {path.suffix or '(none)'}",
                            f"give {flag} a path ending in {listed}")
    if path.parent.exists() and not path.parent.is_dir():
        raise ArtifactError(f"cannot draw {what} to {path}: {path.parent} is not a directory",
                            f"give {flag} a path in an existing directory")
    check_writable(path.resolve().parent, f"{what} {path.name}", flag)
    return path


def save_figure(figure, path: Path, what: str, flag: str) -> Path:
    """``figure`` to ``path`` in the format its suffix names, written atomically (``files.write_file``)."""
    suffix = path.suffix.lower()[1:]
    return write_file(path, lambda staging: figure.savefig(staging, format=suffix, dpi=DPI), what, flag)
