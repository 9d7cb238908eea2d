"""Tuning-log store: ``<log dir>/<target key>/`` with MetaSchedule's workload and record files.

The two files keep MetaSchedule's JSONDatabase line format (an undamaged store loads in a stock
``ms.database.JSONDatabase``). This module writes them; reading, with damaged lines skipped and
foreign records set aside, is ``store_contents.py``'s job, and the MetaSchedule database the
tuner commits to is ``store_database.py``'s. Appends happen under an exclusive lock, after
re-reading what other writers appended, so that two tuners sharing a store never disagree about
workload line numbers (a record names its workload by line number).

``kernels.json`` beside them names each workload (kernel name, models, hand-schedule latency):
the databases themselves only hold the PrimFunc.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..errors import ArtifactError, TuningLogError
from ..files import describe, hint_for
from .store_contents import (KERNELS_FILE, RECORD_FILE, WORKLOAD_FILE, Problem, RecordLine, WorkloadLine,
                             parse_workload_line, read_kernels, workload_id)

LOCK_FILE = ".lock"


def compact_workload(entry: list) -> list:
    """A workload entry with its module's JSON graph re-serialized without indentation.

    MetaSchedule writes the graph indented (about half of it whitespace); any JSON reads back
    the same, so logs written here stay loadable by MetaSchedule at half the size.
    """
    shash, encoded = entry
    raw = base64.b64decode(encoded)
    graph = json.dumps(json.loads(raw[8:].decode()), separators=(",", ":")).encode()
    return [shash, base64.b64encode(len(graph).to_bytes(8, "little") + graph).decode()]


def _atomic_write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        staging.write_text(text)
        os.replace(staging, path)
    except OSError as err:
        staging.unlink(missing_ok=True)
        raise _write_error(path, err) from err


def _write_error(path: Path, err: OSError) -> ArtifactError:
    """A full or read-only disk under the store: the path, what the OS said, and the fix."""
    return ArtifactError(f"cannot write the tuning log {path}: {describe(err)}", hint_for(err, "--tuning-log"))


class TuningStore:
    """One store directory, written only by appending (or by an atomic rewrite), under a lock."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.workload_path = self.directory / WORKLOAD_FILE
        self.record_path = self.directory / RECORD_FILE
        # Workload line index by structural hash, as far as this process has read the file.
        self._index: dict[str, list[tuple[int, tvm.IRModule]]] = {}
        self._read_offset = 0
        self._line_count = 0

    def create(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            ignore = self.directory / ".gitignore"
            if not ignore.exists():
                _atomic_write(ignore, "# MetaSchedule's per-task logs and the writers' lock\nlogs/\n.lock\n")
        except OSError as err:
            raise TuningLogError(f"cannot create tuning log directory {self.directory}: "
                                 f"{err.strerror or err}", "pass a writable --tuning-log DIR") from err

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across processes: every writer of this store takes it."""
        self.create()
        with open(self.directory / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _sync(self) -> None:
        """Index the workload lines appended (by anyone) since we last looked. Lock held."""
        if not self.workload_path.exists():
            return
        with open(self.workload_path, "rb") as stream:
            stream.seek(self._read_offset)
            data = stream.read()
        end = data.rfind(b"\n") + 1  # an unterminated tail is a line still being written, or damaged
        for text in data[:end].decode("utf-8", errors="replace").split("\n")[:-1]:
            try:
                mod = parse_workload_line(text, self._line_count).mod
                self._index.setdefault(workload_id(mod), []).append((self._line_count, mod))
            except ValueError:
                pass  # damaged line: keeps its index, matches nothing
            self._line_count += 1
        self._read_offset += end

    def _find(self, mod: tvm.IRModule) -> int | None:
        for index, known in self._index.get(workload_id(mod), []):
            if tvm_ffi.structural_equal(known, mod):
                return index
        return None

    def _append(self, path: Path, line: str) -> None:
        """One line; a damaged (unterminated) tail left by a killed writer is closed off first.
        A write that fails (a full disk) is taken back whole: no half line stays."""
        with open(path, "ab+", buffering=0) as stream:  # unbuffered: nothing left to flush on close
            size = stream.seek(0, os.SEEK_END)
            prefix = b""
            if size > 0:
                stream.seek(-1, os.SEEK_END)
                if stream.read(1) != b"\n":
                    prefix = b"\n"
            data = memoryview(prefix + line.encode() + b"\n")
            try:
                while data:
                    data = data[stream.write(data):]
            except OSError as err:
                stream.truncate(size)
                raise _write_error(path, err) from err

    def workload_index(self, workload: ms.database.Workload) -> int:
        """The line number of ``workload``, appending it if no line holds it. Lock held."""
        self._sync()
        index = self._find(workload.mod)
        if index is None:
            self._append(self.workload_path, json.dumps(compact_workload(workload.as_json())))
            self._sync()
            index = self._find(workload.mod)
        return index

    def append_record(self, record: ms.database.TuningRecord) -> None:
        with self.locked():
            index = self.workload_index(record.workload)
            self._append(self.record_path, json.dumps([index, record.as_json()]))

    def append_workload(self, workload: ms.database.Workload) -> None:
        with self.locked():
            self.workload_index(workload)

    def update_kernels(self, entries: dict[str, dict]) -> None:
        """Merge per-kernel info (name, models, hand-schedule latency) into kernels.json."""
        with self.locked():
            problems: list[Problem] = []
            kernels = read_kernels(self.directory, problems)
            for shash, info in entries.items():
                current = kernels.setdefault(shash, {})
                models = sorted(set(current.get("models", [])) | set(info.get("models", [])))
                current.update({k: v for k, v in info.items() if k != "models" and v is not None})
                current["models"] = models
            _atomic_write(self.directory / KERNELS_FILE, json.dumps(kernels, indent=1, sort_keys=True) + "\n")

    def rewrite(self, entries: list[tuple[WorkloadLine, list[RecordLine]]], kernels: dict[str, dict]) -> None:
        """Replace the store's contents (merge/prune): each file written to a temp name, then renamed."""
        with self.locked():
            _atomic_write(self.workload_path, "".join(json.dumps(compact_workload(json.loads(w.raw))) + "\n"
                                                      for w, _ in entries))
            _atomic_write(self.record_path, "".join(
                json.dumps([position, r.raw]) + "\n"
                for position, (_, records) in enumerate(entries) for r in records))
            _atomic_write(self.directory / KERNELS_FILE, json.dumps(kernels, indent=1, sort_keys=True) + "\n")
            self._index, self._read_offset, self._line_count = {}, 0, 0

