"""Reading a tuning-log store: every line of its two files parsed on its own, then judged.

We read MetaSchedule's JSONDatabase files ourselves, because JSONDatabase refuses a whole file
for one truncated line and applies any record whatever target or TVM wrote it:

* a damaged line is reported as ``file:line: reason`` and skipped, the good records kept;
* a record is usable only when its target's key is the store's key and the TVM version that
  wrote its workload is the running one; the others are counted and reported, never applied.

Writing (under the writers' lock) is ``store.py``'s job; this module only reads.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..errors import TuningLogError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
KERNELS_FILE = "kernels.json"
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
    return StoreContents(directory, workloads, records, problems, read_kernels(directory, problems))


def read_kernels(directory: Path, problems: list[Problem]) -> dict[str, dict]:
    """kernels.json as a dict (empty when missing); a damaged file is a problem, not an error."""
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
