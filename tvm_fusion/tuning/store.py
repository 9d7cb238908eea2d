"""Tuning-log store: ``<log dir>/<target key>/`` with MetaSchedule's workload and record files.

The two files keep MetaSchedule's JSONDatabase line format (an undamaged store loads in a stock
``ms.database.JSONDatabase``), but we read them ourselves, because JSONDatabase refuses a whole
file for one truncated line and applies any record whatever target or TVM wrote it:

* a damaged line is reported as ``file:line: reason`` and skipped, the good records kept;
* a record is usable only when its target's key is the store's key and the TVM version that
  wrote its workload is the running one; the others are counted and reported, never applied;
* appends happen under an exclusive lock, after re-reading what other writers appended, so
  that two tuners sharing a store never disagree about workload line numbers (a record names
  its workload by line number).

``kernels.json`` beside them names each workload (kernel name, models, hand-schedule latency):
the databases themselves only hold the PrimFunc.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..errors import TuningLogError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
KERNELS_FILE = "kernels.json"
LOCK_FILE = ".lock"
# MetaSchedule's stand-in run time for a candidate that failed to build or run.
FAILED_RUN_SECS = 1e10


def target_key(target: Target | dict) -> str:
    """``kind-mcpu-Nc`` (+ triple arch, + a digest of mattr): records never cross machine classes.

    The core count is part of it because schedules are tuned for a thread count.
    """
    target = target if isinstance(target, Target) else Target(target)
    attrs = target.attrs
    parts = [target.kind.name, str(attrs.get("mcpu", "") or "generic"),
             f"{int(attrs.get('num-cores', 1) or 1)}c"]
    triple = str(attrs.get("mtriple", "") or "")
    if triple:
        parts.append(triple.split("-")[0])
    if target.kind.name == "cuda":
        parts.append(str(attrs.get("arch", "")))
    mattr = sorted(str(a) for a in attrs.get("mattr", []) or [])
    if mattr:
        parts.append(hashlib.sha1(",".join(mattr).encode()).hexdigest()[:8])
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "-".join(parts))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One damaged line: where it is and what is wrong with it."""

    file: str
    line: int  # 1-based, as editors count
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}; skipped"


@dataclasses.dataclass
class WorkloadLine:
    """A readable workload line (its position is the index records refer to)."""

    index: int
    workload: ms.database.Workload
    tvm_version: str
    raw: str

    @property
    def mod(self) -> tvm.IRModule:
        return self.workload.mod


@dataclasses.dataclass
class RecordLine:
    """A readable record line, tied to its workload line.

    The trace is replayed (``record``) only when the record is used: compile needs the best
    record per kernel, not the hundreds a tuning run leaves.
    """

    line: int
    workload_index: int
    workload: WorkloadLine
    run_secs: list[float] | None
    target_key: str
    raw: list

    @functools.cached_property
    def record(self) -> ms.database.TuningRecord:
        """Raises ValueError when the trace does not replay on its workload (a damaged record)."""
        try:
            return ms.database.TuningRecord.from_json(self.raw, self.workload.workload)
        except Exception as err:  # MetaSchedule raises several kinds for a bad trace
            raise ValueError(f"record does not replay on its workload ({type(err).__name__})") from None

    @property
    def failed(self) -> bool:
        return not self.run_secs or all(s >= FAILED_RUN_SECS for s in self.run_secs)

    @property
    def mean_secs(self) -> float:
        return math.inf if self.failed else sum(self.run_secs) / len(self.run_secs)


@dataclasses.dataclass
class StoreContents:
    """Everything readable in one store directory, plus what was not."""

    directory: Path
    workloads: dict[int, WorkloadLine]
    records: list[RecordLine]
    problems: list[Problem]
    kernels: dict[str, dict]

    def usable(self, key: str, tvm_version: str = tvm.__version__) -> list[RecordLine]:
        """Records measured for target ``key`` on workloads written by ``tvm_version``."""
        return [r for r in self.records if r.target_key == key
                and self.workloads[r.workload_index].tvm_version == tvm_version]

    def foreign(self, key: str, tvm_version: str = tvm.__version__) -> list[str]:
        """One line per group of records that ``usable`` leaves out, saying why."""
        other_target: dict[str, int] = {}
        other_version: dict[str, int] = {}
        for record in self.records:
            version = self.workloads[record.workload_index].tvm_version
            if record.target_key != key:
                other_target[record.target_key] = other_target.get(record.target_key, 0) + 1
            elif version != tvm_version:
                other_version[version] = other_version.get(version, 0) + 1
        notes = [f"{self.directory}: {n} record(s) measured on target {k!r}, not {key!r}: not applied"
                 for k, n in sorted(other_target.items())]
        notes += [f"{self.directory}: {n} record(s) from TVM {v}, this is TVM {tvm_version}: not applied "
                  "(re-tune, or drop them with `tvm-fusion tuning-log prune`)"
                  for v, n in sorted(other_version.items())]
        return notes

    def kernel_name(self, workload: WorkloadLine) -> str:
        info = self.kernels.get(workload_id(workload.mod), {})
        return info.get("name") or f"workload #{workload.index}"


def workload_id(mod: tvm.IRModule) -> str:
    """Structural hash of a (normalized) kernel module, the key kernels.json uses."""
    return str(tvm_ffi.structural_hash(mod))


def workload_tvm_version(encoded_mod: str) -> str:
    """The TVM version MetaSchedule embeds in a workload line's serialized module."""
    raw = base64.b64decode(encoded_mod)
    # MetaSchedule prefixes the JSON graph with its length as 8 little-endian bytes.
    graph = json.loads(raw[8:].decode())
    return str(graph.get("metadata", {}).get("tvm_version", "unknown"))


def compact_workload(entry: list) -> list:
    """A workload entry with its module's JSON graph re-serialized without indentation.

    MetaSchedule writes the graph indented (about half of it whitespace); any JSON reads back
    the same, so logs written here stay loadable by MetaSchedule at half the size.
    """
    shash, encoded = entry
    raw = base64.b64decode(encoded)
    graph = json.dumps(json.loads(raw[8:].decode()), separators=(",", ":")).encode()
    return [shash, base64.b64encode(len(graph).to_bytes(8, "little") + graph).decode()]


def _lines(path: Path) -> list[str]:
    """The file's lines as MetaSchedule numbers them (every line, the last one unterminated too)."""
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise TuningLogError(f"cannot read tuning log {path}: {err.strerror or err}",
                             "check the file's permissions") from err
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def parse_workload_line(text: str, index: int) -> WorkloadLine:
    """Raises ValueError with a short reason when the line is damaged."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg}; truncated line?)") from None
    if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, str) for x in obj)):
        raise ValueError("not a workload entry [hash, module]")
    try:
        version = workload_tvm_version(obj[1])
        workload = ms.database.Workload.from_json(obj)
    except Exception as err:  # base64, JSON graph or IR errors: all mean a damaged line
        raise ValueError(f"workload module does not load ({type(err).__name__})") from None
    return WorkloadLine(index, workload, version, text)


def parse_record_line(text: str, line: int, workloads: dict[int, WorkloadLine]) -> RecordLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg}; truncated line?)") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int)
            and isinstance(obj[1], list) and len(obj[1]) == 4):
        raise ValueError("not a record entry [workload index, [trace, run_secs, target, args]]")
    index, body = obj
    if index not in workloads:
        raise ValueError(f"refers to workload line {index + 1}, which is missing or damaged")
    run_secs, target_json = body[1], body[2]
    if run_secs is not None and not (isinstance(run_secs, list)
                                     and all(isinstance(s, (int, float)) for s in run_secs)):
        raise ValueError("run_secs is not a list of numbers")
    if not isinstance(target_json, dict):
        raise ValueError("has no target")
    try:
        key = target_key(Target(target_json))
    except Exception as err:  # TVM rejects the target dict
        raise ValueError(f"target does not load ({type(err).__name__})") from None
    secs = None if run_secs is None else [float(s) for s in run_secs]
    return RecordLine(line, index, workloads[index], secs, key, body)


def read_store(directory: str | Path) -> StoreContents:
    """Read a store directory; a missing directory is an empty store."""
    directory = Path(directory)
    problems: list[Problem] = []
    workloads: dict[int, WorkloadLine] = {}
    workload_path = directory / WORKLOAD_FILE
    for index, text in enumerate(_lines(workload_path)):
        try:
            workloads[index] = parse_workload_line(text, index)
        except ValueError as err:
            problems.append(Problem(str(workload_path), index + 1, str(err)))
    records: list[RecordLine] = []
    record_path = directory / RECORD_FILE
    for number, text in enumerate(_lines(record_path), start=1):
        try:
            records.append(parse_record_line(text, number, workloads))
        except ValueError as err:
            problems.append(Problem(str(record_path), number, str(err)))
    return StoreContents(directory, workloads, records, problems, _read_kernels(directory, problems))


def _read_kernels(directory: Path, problems: list[Problem]) -> dict[str, dict]:
    path = directory / KERNELS_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if isinstance(v, dict)}
        problems.append(Problem(str(path), 1, "not a JSON object"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(Problem(str(path), getattr(err, "lineno", 1), "not JSON"))
    return {}


def _atomic_write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)


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
        """One line; a damaged (unterminated) tail left by a killed writer is closed off first."""
        with open(path, "ab+") as stream:
            stream.seek(0, os.SEEK_END)
            prefix = b""
            if stream.tell() > 0:
                stream.seek(-1, os.SEEK_END)
                if stream.read(1) != b"\n":
                    prefix = b"\n"
            stream.write(prefix + line.encode() + b"\n")
            stream.flush()

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
            kernels = _read_kernels(self.directory, problems)
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


@tvm.ir.utils.derived_object
class StoreDatabase(ms.database.PyDatabase):
    """A MetaSchedule database over a store: lookups in memory, every commit appended to disk.

    Holds only usable records (this target key, this TVM), so the search and the compile step
    never see a foreign one.
    """

    def __init__(self, store: TuningStore, contents: StoreContents, key: str):
        super().__init__()
        self.store = store
        self.memory = usable_database(contents, key)

    def has_workload(self, mod: tvm.IRModule) -> bool:
        return self.memory.has_workload(mod)

    def commit_workload(self, mod: tvm.IRModule) -> ms.database.Workload:
        workload = self.memory.commit_workload(mod)
        self.store.append_workload(workload)
        return workload

    def commit_tuning_record(self, record: ms.database.TuningRecord) -> None:
        self.memory.commit_tuning_record(record)
        self.store.append_record(record)

    def get_top_k(self, workload: ms.database.Workload, top_k: int) -> list[ms.database.TuningRecord]:
        return self.memory.get_top_k(workload, top_k)

    def get_all_tuning_records(self) -> list[ms.database.TuningRecord]:
        return self.memory.get_all_tuning_records()

    def __len__(self) -> int:
        return len(self.memory)


def usable_database(contents: StoreContents, key: str, best_only: bool = False) -> ms.database.MemoryDatabase:
    """An in-memory database of the store's usable records; ``best_only``: the fastest record
    of each kernel whose trace replays (what compile needs). A record whose trace does not
    replay is added to ``contents.problems`` and skipped."""
    memory = ms.database.MemoryDatabase()
    for workload in contents.workloads.values():
        if workload.tvm_version == tvm.__version__:
            memory.commit_workload(workload.mod)
    lines = contents.usable(key)
    if best_only:
        lines = sorted((r for r in lines if not r.failed), key=lambda r: r.mean_secs)
    done: set[int] = set()
    for line in lines:
        if best_only and line.workload_index in done:
            continue
        try:
            record = line.record
        except ValueError as err:
            contents.problems.append(Problem(str(contents.directory / RECORD_FILE), line.line, str(err)))
            continue
        workload = memory.commit_workload(line.workload.mod)
        memory.commit_tuning_record(ms.database.TuningRecord(
            record.trace, workload, record.run_secs, record.target, record.args_info))
        done.add(line.workload_index)
    return memory


def store_dirs(path: str | Path) -> list[Path]:
    """``path`` itself when it holds a store, else its subdirectories that do (a log root)."""
    path = Path(path)
    if (path / WORKLOAD_FILE).exists() or (path / RECORD_FILE).exists():
        return [path]
    if not path.is_dir():
        raise TuningLogError(f"tuning log {path} does not exist",
                             "pass a store directory (tuning_logs/<target-key>/) or a log root (tuning_logs/)")
    return sorted(p for p in path.iterdir() if (p / WORKLOAD_FILE).exists() or (p / RECORD_FILE).exists())


def best_per_workload(records: Iterable[RecordLine], keep: int) -> list[RecordLine]:
    """The ``keep`` fastest successful records of each workload, in file order."""
    by_workload: dict[int, list[RecordLine]] = {}
    for record in records:
        if not record.failed:
            by_workload.setdefault(record.workload_index, []).append(record)
    kept = {id(r) for group in by_workload.values() for r in sorted(group, key=lambda r: r.mean_secs)[:keep]}
    return [r for r in records if id(r) in kept]
