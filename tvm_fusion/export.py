"""Artifacts out: ``build/<model>.<target>/`` with the library and its metadata, atomically.

The directory is assembled under a temporary name beside the final one and renamed into place,
so an interrupted or failed export never leaves a half-written artifact, and a previous
artifact of the same name stays intact until the new one is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import ArtifactError
from .runtime import LIBRARY_NAME, METADATA_NAME, sha256_of


def artifact_dir(output_dir: str | os.PathLike, model_name: str, target_name: str) -> Path:
    return Path(output_dir) / f"{model_name}.{target_name}"


def write_artifact(executable, metadata: dict, final_dir: Path, export_options: dict | None = None,
                   check: Callable[[Path], dict] | None = None) -> Path:
    """Export ``executable`` and ``metadata`` into ``final_dir``, replacing it only when complete.

    ``export_options`` go to ``export_library`` (``fcompile`` for a cross linker,
    ``fpack_imports`` for CUDA device code). ``check(library)`` runs on the exported library
    before anything is committed and returns metadata to add; if it raises, nothing is written.
    """
    final_dir = Path(final_dir)
    # Folders this call creates, deepest first: removed again if ``check`` rejects the artifact.
    created = [folder for folder in (final_dir.parent, *final_dir.parent.parents) if not folder.exists()]
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ArtifactError(f"cannot create the output directory {final_dir.parent}: {err.strerror or err}",
                            "pass a writable directory with -o/--output-dir") from err
    staging = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    retired = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        library = staging / LIBRARY_NAME
        executable.export_library(str(library), **(export_options or {}))
        if check is not None:
            try:
                metadata = {**metadata, **check(library)}
            except BaseException:
                _remove_empty(staging, *created)
                raise
        metadata = {**metadata, "library": LIBRARY_NAME, "library_sha256": sha256_of(library)}
        (staging / METADATA_NAME).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        if final_dir.exists():
            final_dir.rename(retired)
        staging.rename(final_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if retired.exists() and not final_dir.exists():
            retired.rename(final_dir)
        raise
    shutil.rmtree(retired, ignore_errors=True)
    return final_dir


def _remove_empty(staging: Path, *folders: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()
