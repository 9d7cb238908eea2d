"""Writing what the user names (artifacts, --save, --json, --graph) without leaving anything half done.

Every output is assembled under a staging name beside it (``.NAME.tmp-PID``) and renamed into
place. A run killed by SIGKILL cannot remove its own staging, so each write first removes the
staging that dead runs left in the same folder. A full disk or a read-only folder becomes an
ArtifactError naming the path, and where it can be known early, it is raised before the work.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from .errors import ArtifactError

# ``.NAME.tmp-PID``: staging; ``.NAME.old-PID``: the previous version, moved aside during a swap.
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def staging_path(final: Path, kind: str = "tmp") -> Path:
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}")


def describe(err: OSError) -> str:
    """'Read-only file system', 'No space left on device', ... (what the user can act on)."""
    return (err.strerror or os.strerror(err.errno)) if err.errno else str(err)


def hint_for(err: OSError, flag: str) -> str:
    if err.errno == errno.ENOSPC:
        return f"free disk space, or pass {flag} a path on another disk"
    return f"pass {flag} a path in a writable directory"


def _owner_alive(pid: int, entry: Path) -> bool:
    """True while the process that made ``entry`` may still be using it.

    A PID can be reused: a process that started after the entry was last modified is not its owner.
    """
    if pid == os.getpid():
        return True
    try:
        started = psutil.Process(pid).create_time()
        return started <= entry.lstat().st_mtime + 1.0
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # cannot tell: leave it


def remove_stale_staging(folder: Path) -> list[Path]:
    """Remove the staging entries in ``folder`` left by killed runs; returns what was removed.

    A killed swap can leave the previous version moved aside with nothing in its place: it is
    put back rather than removed.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _STAGING.match(entry.name)
        if not match or _owner_alive(int(match["pid"]), entry):
            continue
        final = entry.with_name(match["name"])
        with contextlib.suppress(OSError):
            if match["kind"] == "old" and not final.exists():
                entry.rename(final)
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def check_writable(folder: str | os.PathLike, what: str, flag: str) -> None:
    """Raise ArtifactError now if ``what`` could not be written into ``folder`` (existing or to be
    created): a file in the way, a read-only file system. Better than after the work it would hold."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ArtifactError(f"cannot write {what} into {folder}: {existing} is a file, not a directory",
                            f"pass {flag} a path in a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "Read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "Permission denied"
        raise ArtifactError(f"cannot write {what} into {folder}: {existing} is not writable ({why})",
                            f"pass {flag} a path in a writable directory")


def missing_folders(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first (to remove on failure)."""
    return [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]


def remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def write_file(path: str | os.PathLike, write: Callable[[Path], None], what: str, flag: str) -> Path:
    """``write(staging)`` then rename it to ``path``; on any failure nothing is left behind, and
    an OSError (read-only, disk full, a directory in the way) becomes an ArtifactError."""
    final = Path(path)
    created = missing_folders(final)
    staging = staging_path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(final.parent)
        write(staging)
        os.replace(staging, final)
    except BaseException as err:
        with contextlib.suppress(OSError):
            staging.unlink()
        remove_empty(created)
        if isinstance(err, OSError):
            raise ArtifactError(f"cannot write {what} {final}: {describe(err)}", hint_for(err, flag)) from err
        raise
    return final


@contextlib.contextmanager
def temp_files_in(folder: Path) -> Iterator[None]:
    """Point Python's and subprocesses' temp dir (TVM's export workspace, gcc, nvcc) at ``folder``,
    so that what a killed run leaves there goes with the staging it belongs to."""
    folder.mkdir(parents=True, exist_ok=True)
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


def sha256_of(path: Path) -> str:
    """The file's sha256, as ``sha256sum`` prints it, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
