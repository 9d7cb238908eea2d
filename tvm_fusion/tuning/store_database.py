"""The MetaSchedule side of a store: databases holding only its usable records.

The tuner commits to ``StoreDatabase`` (each commit appended to disk at once); compile reads
``usable_database(..., best_only=True)``. Neither ever sees a record of another target or TVM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tvm
from tvm.s_tir import meta_schedule as ms

from ..errors import ArtifactError
from .store import TuningStore
from .store_contents import RECORD_FILE, Problem, StoreContents


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
        self.failure: ArtifactError | None = None  # a store write that failed (a full disk)

    @contextlib.contextmanager
    def store_errors(self) -> Iterator[None]:
        """A failed store write inside MetaSchedule comes back through its C++ as a RuntimeError:
        raise the ArtifactError it was (the path, "No space left on device", the fix) instead."""
        try:
            yield
        except Exception:
            if self.failure is not None:
                raise self.failure from None
            raise

    def has_workload(self, mod: tvm.IRModule) -> bool:
        return self.memory.has_workload(mod)

    def commit_workload(self, mod: tvm.IRModule) -> ms.database.Workload:
        workload = self.memory.commit_workload(mod)
        self._write(self.store.append_workload, workload)
        return workload

    def commit_tuning_record(self, record: ms.database.TuningRecord) -> None:
        self.memory.commit_tuning_record(record)
        self._write(self.store.append_record, record)

    def _write(self, append, item) -> None:
        try:
            append(item)
        except ArtifactError as err:
            self.failure = err
            raise

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
