"""``tvm-fusion tuning-log show|merge|prune|diff``: look after stored tuning logs.

Each function takes a store directory (``tuning_logs/<target-key>/``) or a log root holding
several, never loses a good record it was not asked to drop, and rewrites a store only
through temp files renamed into place (``TuningStore.rewrite``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import tvm
import tvm_ffi

from ..errors import TuningLogError
from .store import TuningStore
from .store_contents import (RecordLine, StoreContents, WorkloadLine, best_per_workload, read_store, store_dirs,
                             workload_id)


@dataclasses.dataclass
class KernelRow:
    """One kernel of one store: what ``show`` prints."""

    store: str
    kernel: str
    models: list[str]
    trials: int
    failed: int
    best_us: float | None
    hand_us: float | None
    status: str  # "ok", or why compile would not apply its records


def _rows(contents: StoreContents) -> list[KernelRow]:
    key = contents.directory.name
    by_workload: dict[int, list[RecordLine]] = {}
    for record in contents.records:
        by_workload.setdefault(record.workload_index, []).append(record)
    rows = []
    for index, workload in sorted(contents.workloads.items()):
        records = by_workload.get(index, [])
        info = contents.kernels.get(workload_id(workload.mod), {})
        best = min((r.mean_secs for r in records), default=math.inf)
        targets = {r.target_key for r in records}
        if workload.tvm_version != tvm.__version__:
            status = f"TVM {workload.tvm_version}: not applied"
        elif targets and targets != {key}:
            status = "target " + ", ".join(sorted(targets - {key})) + ": not applied"
        else:
            status = "ok"
        rows.append(KernelRow(str(contents.directory), contents.kernel_name(workload), info.get("models", []),
                              len(records), sum(r.failed for r in records),
                              best * 1e6 if math.isfinite(best) else None, info.get("hand_us"), status))
    return rows


def show(*paths: str | Path) -> tuple[list[KernelRow], list[str]]:
    """Per kernel: trials, failures, best and hand-schedule latency; plus damaged-line notes.
    Paths that do not exist are passed over; no record under any of them is a TuningLogError."""
    rows, notes = [], []
    existing = [path for path in paths if Path(path).exists()] or list(paths[:1])
    for directory in (store for path in existing for store in store_dirs(path)):
        contents = read_store(directory)
        rows += _rows(contents)
        notes += [str(p) for p in contents.problems]
    if not rows:  # an empty table would read as "nothing tuned yet" for a mistyped path
        damaged = f" ({len(notes)} damaged line(s), first: {notes[0]})" if notes else ""
        raise TuningLogError(f"no tuning records found in {' or '.join(map(str, paths))}{damaged}",
                             "pass a store (tuning_logs/<target-key>/) or a log root that `tvm-fusion tune` "
                             "wrote into")
    return rows, notes


@dataclasses.dataclass
class _Group:
    """Records of one workload (structurally), target key and TVM version, over all sources."""

    workload: WorkloadLine
    records: list[RecordLine]


def _group(contents_list: list[StoreContents]) -> dict[str, list[_Group]]:
    """target key -> groups; workloads matched by structure across the sources."""
    groups: dict[tuple[str, str, str], list[_Group]] = {}
    for contents in contents_list:
        for record in contents.records:
            workload = contents.workloads[record.workload_index]
            candidates = groups.setdefault((record.target_key, workload.tvm_version, workload_id(workload.mod)), [])
            group = next((g for g in candidates if tvm_ffi.structural_equal(g.workload.mod, workload.mod)), None)
            if group is None:
                candidates.append(group := _Group(workload, []))
            group.records.append(record)
    by_key: dict[str, list[_Group]] = {}
    for (key, _, _), candidates in groups.items():
        by_key.setdefault(key, []).extend(candidates)
    return by_key


def _kernels(contents_list: list[StoreContents]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for contents in contents_list:
        for shash, info in contents.kernels.items():
            current = merged.setdefault(shash, {})
            models = sorted(set(current.get("models", [])) | set(info.get("models", [])))
            current.update(info)
            current["models"] = models
    return merged


@dataclasses.dataclass
class MergeReport:
    written: dict[str, int]  # store directory -> records kept
    read: int                # good records read from all sources
    problems: list[str]


def merge(sources: list[str | Path], output: str | Path, keep: int = 1) -> MergeReport:
    """Combine logs from several models/machines: the ``keep`` best records per workload.

    Each record goes to ``<output>/<its target key>/`` (a store already there is merged too),
    so records of different machine classes never end up in one store.
    """
    if keep < 1:
        raise TuningLogError(f"--keep {keep} would drop every record", "keep at least 1 record per workload")
    output = Path(output)
    directories = [d for source in sources for d in store_dirs(source)]
    seen = {d.resolve() for d in directories}
    if output.is_dir():  # stores already in the destination take part too
        directories += [d for d in store_dirs(output) if d.resolve() not in seen and d.parent == output]
    contents_list = [read_store(d) for d in directories]
    kernels = _kernels(contents_list)
    written = {}
    for key, groups in sorted(_group(contents_list).items()):
        entries = [(g.workload, best_per_workload(g.records, keep)) for g in groups]
        entries = [(w, records) for w, records in entries if records]
        _rewrite(output / key, entries, kernels)
        written[str(output / key)] = sum(len(records) for _, records in entries)
    return MergeReport(written, sum(len(c.records) for c in contents_list),
                       [str(p) for c in contents_list for p in c.problems])


def _rewrite(directory: Path, entries: list[tuple[WorkloadLine, list[RecordLine]]], kernels: dict) -> None:
    used = {workload_id(w.mod) for w, _ in entries}
    TuningStore(directory).rewrite(entries, {k: v for k, v in kernels.items() if k in used})


@dataclasses.dataclass
class PruneReport:
    directory: str
    kept: int
    dropped: dict[str, int]  # reason -> records


def prune(path: str | Path, keep: int = 1) -> list[PruneReport]:
    """Drop what compile would never apply: damaged lines, failed measurements, records of other
    targets or TVM versions, and all but the ``keep`` best records of each workload.

    The trial counts of a pruned log shrink: a later ``tune`` counts its budget from what is left.
    """
    if keep < 1:
        raise TuningLogError(f"--keep {keep} would drop every record", "keep at least 1 record per workload")
    reports = []
    for directory in store_dirs(path):
        contents = read_store(directory)
        key = directory.name
        usable = contents.usable(key)
        usable_ids = {id(r) for r in usable}
        dropped = {"damaged line": len(contents.problems),
                   "other target": sum(r.target_key != key for r in contents.records),
                   "other TVM version": sum(r.target_key == key and id(r) not in usable_ids for r in contents.records),
                   "failed measurement": sum(r.failed for r in usable)}
        kept = best_per_workload(usable, keep)
        dropped[f"beyond the best {keep}"] = len(usable) - dropped["failed measurement"] - len(kept)
        entries = [(w, [r for r in kept if r.workload_index == index]) for index, w in sorted(contents.workloads.items())]
        entries = [(w, records) for w, records in entries if records]
        used = {workload_id(w.mod) for w, _ in entries}
        TuningStore(directory).rewrite(entries, {k: v for k, v in contents.kernels.items() if k in used})
        reports.append(PruneReport(str(directory), len(kept), {k: v for k, v in dropped.items() if v}))
    return reports


@dataclasses.dataclass
class DiffRow:
    kernel: str
    best_a_us: float | None
    best_b_us: float | None
    trials_a: int
    trials_b: int

    @property
    def speedup(self) -> float | None:
        """How much faster B's best is than A's (>1: B is faster)."""
        if self.best_a_us is None or self.best_b_us is None:
            return None
        return self.best_a_us / self.best_b_us


def diff(a: str | Path, b: str | Path) -> list[DiffRow]:
    """Kernel by kernel (matched by structure): best latency and trials in store A and store B."""
    stores = []
    for path in (a, b):
        directories = store_dirs(path)
        if len(directories) != 1:
            raise TuningLogError(f"{path} holds {len(directories)} stores", "pass one tuning_logs/<target-key>/ each")
        stores.append(read_store(directories[0]))
    table: list[tuple[tvm.IRModule, DiffRow]] = []
    for side, contents in enumerate(stores):
        per_workload: dict[int, list[RecordLine]] = {}
        for record in contents.records:
            per_workload.setdefault(record.workload_index, []).append(record)
        for index, workload in sorted(contents.workloads.items()):
            records = per_workload.get(index, [])
            best = min((r.mean_secs for r in records), default=math.inf)
            best_us = best * 1e6 if math.isfinite(best) else None
            match = next((r for mod, r in table if tvm_ffi.structural_equal(mod, workload.mod)), None)
            if match is None:
                match = DiffRow(contents.kernel_name(workload), None, None, 0, 0)
                table.append((workload.mod, match))
            if side == 0:
                match.best_a_us, match.trials_a = best_us, len(records)
            else:
                match.best_b_us, match.trials_b = best_us, len(records)
    return [row for _, row in table]
