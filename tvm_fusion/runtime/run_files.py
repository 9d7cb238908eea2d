"""The ``run`` command's files: inputs read from .npy/.npz, outputs saved all or none."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..files import check_writable, describe, hint_for, missing_folders, remove_empty, remove_stale_staging, staging_path


def read_input(name: str, path: str | os.PathLike) -> np.ndarray:
    """``run --input NAME=FILE``: a .npy, or a .npz archive's array named NAME (or its only array)."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except EOFError:
        raise ArtifactError(f"cannot read --input {name}={path}: the file is empty",
                            "pass a .npy file written by np.save (or a .npz by np.savez)") from None
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot read --input {name}={path}: {err}",
                            "pass a .npy file written by np.save (or a .npz by np.savez)") from err
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        return loaded
    with loaded:
        arrays = loaded.files
        if name in arrays or len(arrays) == 1:
            try:
                return loaded[name if name in arrays else arrays[0]]
            except (OSError, ValueError, EOFError) as err:
                raise ArtifactError(f"cannot read --input {name}={path}: {err or 'truncated archive'}",
                                    "pass an archive written by np.savez") from err
    raise ArtifactError(f"--input {name}={path} is a .npz archive of {len(arrays)} arrays "
                        f"({', '.join(arrays) or 'none'}), none named {name!r}",
                        f"store the array as {name} (np.savez(file, {name}=array)) or pass a .npy")


def check_save_dir(directory: str | os.PathLike) -> None:
    """``run --save DIR``: fail before the run if DIR is a file or on a read-only file system."""
    check_writable(directory, "the outputs", "--save")


SAVED_ARCHIVE = "outputs.npz"
SAVED_NAMES = "names.json"


def save_outputs(outputs: Mapping[str, np.ndarray], directory: str | os.PathLike) -> list[Path]:
    """``run --save DIR``: ``DIR/outputs.npz`` keyed by the model's output names, one ``.npy`` per
    output under a file-safe name (paddle2onnx names hold '/': ``save_infer_model/scale_0.tmp_1``),
    and ``DIR/names.json`` mapping each file to its output. All of them or, on failure, none."""
    directory = Path(directory)
    files = safe_file_names(list(outputs))
    created = missing_folders(directory / "x")
    staged: list[tuple[Path, Path]] = []

    def stage(name: str, write) -> None:
        final = directory / name
        staged.append((staging_path(final), final))
        with open(staged[-1][0], "wb") as stream:  # a file object: numpy adds no suffix
            write(stream)

    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(directory)
        for name, value in outputs.items():
            stage(files[name], lambda stream, value=value: np.save(stream, value))
        stage(SAVED_ARCHIVE, lambda stream: np.savez(stream, **outputs))
        mapping = json.dumps({files[name]: name for name in outputs}, indent=2) + "\n"
        stage(SAVED_NAMES, lambda stream: stream.write(mapping.encode()))
        for staging, final in staged:
            os.replace(staging, final)
    except BaseException as err:
        for staging, _ in staged:
            staging.unlink(missing_ok=True)
        remove_empty(created)
        if isinstance(err, OSError):
            raise ArtifactError(f"cannot write the outputs into {directory}: {describe(err)}",
                                hint_for(err, "--save")) from err
        raise
    return [final for _, final in staged]


def safe_file_names(names: list[str]) -> dict[str, str]:
    """Output name -> a ``.npy`` file name of letters, digits, '.', '_' and '-' only, distinct
    from the others and from the archive and the name map."""
    taken = {SAVED_ARCHIVE, SAVED_NAMES}
    files = {}
    for name in names:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "output"
        candidate, suffix = f"{stem}.npy", 1
        while candidate in taken:
            suffix += 1
            candidate = f"{stem}_{suffix}.npy"
        taken.add(candidate)
        files[name] = candidate
    return files
