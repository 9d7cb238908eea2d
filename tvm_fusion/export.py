"""Artifacts out: ``build/<model>.<target>/`` with the library and its metadata, atomically.

The directory is assembled under a temporary name beside the final one and renamed into place,
so an interrupted or failed export never leaves a half-written artifact, and a previous
artifact of the same name stays intact until the new one is complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import pickle
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import ArtifactError
from .files import (describe, hint_for, missing_folders, remove_empty, remove_stale_staging, sha256_of,
                    staging_path, temp_files_in)
from .runtime import LIBRARY_NAME, METADATA_NAME


def artifact_dir(output_dir: str | os.PathLike, model_name: str, target_name: str) -> Path:
    return Path(output_dir) / f"{model_name}.{target_name}"


def write_artifact(executable, metadata: dict, final_dir: Path, export_options: dict | None = None,
                   check: Callable[[Path], dict] | None = None, export_state: dict | None = None) -> Path:
    """Export ``executable`` and ``metadata`` into ``final_dir``, replacing it only when complete.

    ``export_options`` go to ``export_library`` (``fcompile`` for a cross linker,
    ``fpack_imports`` for CUDA device code); ``export_state`` is the dict their callbacks fill,
    filled here too (the export runs in a child process, see ``_export_in_child``).
    ``check(library)`` runs on the exported library before anything is committed and returns metadata to add; if it raises, nothing is written.
    ``executable`` may come in a one-element list, emptied once the library is exported: if that
    was the caller's only reference, the executable and its weights are freed before the check.
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
            exported = executable.pop() if isinstance(executable, list) else executable
            _export_in_child(exported, library, export_options or {},
                             export_state if export_state is not None else {})
            del exported
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


def _export_in_child(executable, library: Path, options: dict, state: dict) -> None:
    """``export_library`` in a forked child process.

    LLVM reports a failed write of the object file (a full disk) by printing "LLVM ERROR: IO
    failure on output stream" and exiting the process, past every handler: the user got exit 1,
    no message and a staging folder left behind. In a child, that exit becomes an error here,
    where the staging is cleaned up. The child shares the parent's memory copy-on-write, so
    nothing is serialized on the way in. What comes back, pickled: a Python error in it (a
    missing toolchain, an interrupt), raised here as itself, or else ``state``, the dict the
    export options' callbacks filled (the CUDA device code embedded), copied into the caller's.
    """
    log_read, log_write = os.pipe()
    result_read, result_write = os.pipe()
    return_freed_heap()
    pid = os.fork()
    if pid == 0:
        os.close(log_read)
        os.close(result_read)
        _export_and_exit(executable, library, options, state, log_write, result_write)
    os.close(log_write)
    os.close(result_write)
    try:
        with os.fdopen(log_read, "rb") as log, os.fdopen(result_read, "rb") as results:
            output = log.read().decode(errors="replace")  # EOF: the child (and its linker) are done
            pickled = results.read()
        _, status = os.waitpid(pid, 0)
    except BaseException:  # interrupted here: the child must not go on writing into the staging
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    if pickled:
        error, filled = pickle.loads(pickled)
        if error is not None:
            raise error
        state.update(filled)
    if os.waitstatus_to_exitcode(status) == 0:
        return
    if "No space left" in output or "IO failure on output" in output or _disk_full(library.parent):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(library))
    lines = [line for line in output.splitlines() if line.strip()]
    raise RuntimeError(f"exporting {library.name} failed: "
                       f"{lines[-1] if lines else f'exit status {os.waitstatus_to_exitcode(status)}'}")


def _export_and_exit(executable, library: Path, options: dict, state: dict, log_fd: int, result_fd: int):
    """The child's side: export, send back ``(error, state)``, and end without exit handlers.

    The export runs on a thread of its own: ``exit()`` first runs the calling thread's
    thread-local destructors, and the main thread's include TVM's thread pool, which waits
    there for workers that a forked child does not have. A new thread has none of those.
    """
    failure: list[BaseException] = []

    def export() -> None:
        try:
            executable.export_library(str(library), **options)
        except BaseException as err:  # noqa: BLE001 - raised again in the parent
            failure.append(err)

    try:
        os.dup2(log_fd, 2)  # LLVM's, the linker's and Python's messages
        _exit_at_once_on_exit()
        worker = threading.Thread(target=export, name="tvm_fusion-export")
        worker.start()
        worker.join()
    except BaseException as err:  # noqa: BLE001 - raised again in the parent
        failure.append(err)
    finally:
        try:
            message = pickle.dumps((failure[0] if failure else None, state))
        except Exception:  # noqa: BLE001 - an error that does not pickle goes back as text
            message = pickle.dumps((RuntimeError(f"{type(failure[0]).__name__}: {failure[0]}"), {}))
        with contextlib.suppress(OSError), os.fdopen(result_fd, "wb") as stream:
            stream.write(message)
        os._exit(1 if failure else 0)


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the OS. Before forking: the child maps every page
    resident in the parent, so the pipeline's freed temporaries, still held by malloc, would
    count in its RSS (the export child's RSS set the compile's peak). Before loading a library:
    TVM's loader holds a few copies of its weights for a moment, on top of what the process holds."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


_PR_SET_PDEATHSIG = 1


def _exit_at_once_on_exit() -> None:
    """Make ``exit()`` in this (forked) process end it at once, with its status.

    LLVM's fatal errors call ``exit(1)``, which runs the C exit handlers, and ONNX Runtime's
    waits there for its worker threads, which a forked child does not have: the child hung.
    glibc calls ``on_exit`` handlers last-registered first, with the exit status as the first
    argument, so registering ``_exit`` itself ends the process before any other handler runs.
    """
    libc = ctypes.CDLL(None)
    if hasattr(libc, "on_exit"):
        libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
    # A SIGKILLed compile takes its child along (Linux: PR_SET_PDEATHSIG), so the next run that
    # removes the dead run's staging does not race a child still writing into it.
    if hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _disk_full(folder: Path) -> bool:
    """Less than 1 MiB left for the user: a linker that failed there failed for lack of room."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < (1 << 20)
