"""Artifacts out: ``build/<model>.<target>/`` with the library and its metadata, atomically.

The directory is assembled under a temporary name beside the final one and renamed into place,
so an interrupted or failed export never leaves a half-written artifact, and a previous
artifact of the same name stays intact until the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import ArtifactError
from .files import (describe, hint_for, missing_folders, remove_empty, remove_stale_staging, sha256_of,
                    staging_path, temp_files_in)
from .runtime import LIBRARY_NAME, METADATA_NAME


def artifact_dir(output_dir: str | os.PathLike, model_name: str, target_name: str) -> Path:
    return Path(output_dir) / f"{model_name}.{target_name}"


def write_artifact(executable, metadata: dict, final_dir: Path, export_options: dict | None = None,
                   check: Callable[[Path], dict] | None = None) -> Path:
    """Export ``executable`` and ``metadata`` into ``final_dir``, replacing it only when complete.

    ``export_options`` go to ``export_library`` (``fcompile`` for a cross linker,
    ``fpack_imports`` for CUDA device code). ``check(library)`` runs on the exported library
    before anything is committed and returns metadata to add; if it raises, nothing is written.
    TVM's and the linkers' temp files go inside the staging directory; staging left by killed
    runs is removed first (``files.remove_stale_staging``). An OSError (read-only, disk full)
    becomes an ArtifactError naming the artifact.
    """
    final_dir = Path(final_dir)
    # Folders this call creates, deepest first: removed again if the artifact is not committed.
    created = missing_folders(final_dir)
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ArtifactError(f"cannot create the output directory {final_dir.parent}: {describe(err)}",
                            hint_for(err, "-o/--output-dir")) from err
    remove_stale_staging(final_dir.parent)
    staging = staging_path(final_dir)
    retired = staging_path(final_dir, "old")
    try:
        shutil.rmtree(staging, ignore_errors=True)  # this process's own, from an earlier failed call
        staging.mkdir()
        library = staging / LIBRARY_NAME
        # TVM's export workspace (lib0.o ...), gcc's and nvcc's temp files: inside the staging.
        with temp_files_in(staging / ".tmp"):
            executable.export_library(str(library), **(export_options or {}))
            if check is not None:
                metadata = {**metadata, **check(library)}
        shutil.rmtree(staging / ".tmp")
        metadata = {**metadata, "library": LIBRARY_NAME, "library_sha256": sha256_of(library)}
        (staging / METADATA_NAME).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        if final_dir.exists():
            final_dir.rename(retired)
        staging.rename(final_dir)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if retired.exists() and not final_dir.exists():
            retired.rename(final_dir)
        remove_empty(created)
        if isinstance(err, OSError):
            raise ArtifactError(f"cannot write the artifact {final_dir}: {describe(err)}",
                                hint_for(err, "-o/--output-dir")) from err
        raise
    shutil.rmtree(retired, ignore_errors=True)
    return final_dir
