"""Compile-time use of the tuning logs: the best matching record schedules a kernel.

Records are looked up by the kernel's normalized structural form, only among records of the
configured target's key and the running TVM version (``load_records``); kernels without one
are left to ApplySchedules (the hand schedules). Kernels whose best record *is* the hand
schedule (it was measured first and nothing beat it) are left to ApplySchedules too, so
``applied`` lists exactly the kernels a tuned schedule replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..schedules import hand_schedule, unscheduled_kernels
from .store_contents import StoreContents, read_store, store_dirs, target_key, workload_id
from .store_database import usable_database

_normalize = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")


@dataclasses.dataclass
class TunedKernel:
    latency_us: float
    hand_us: float | None
    trials: int


@dataclasses.dataclass
class TuningRecords:
    """The usable records of one store, for one target; ``applied`` is filled by the pass."""

    directory: Path
    target_key: str
    database: ms.database.MemoryDatabase
    contents: StoreContents
    notes: list[str]
    applied: dict[str, TunedKernel] = dataclasses.field(default_factory=dict)
    hand_best: list[str] = dataclasses.field(default_factory=list)  # a record matched; the hand schedule won
    say: Callable[[str], None] = print

    def __len__(self) -> int:
        return len(self.database)

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.say(message)


def load_records(log_dir: str | Path, target: Target) -> TuningRecords | None:
    """The usable records for ``target`` under ``log_dir``; None when there is no log at all.

    ``notes`` lists what was not used and why (damaged lines, other targets' or TVM versions'
    records, logs only for other targets), so that nothing is skipped silently.
    """
    key = target_key(target)
    root = Path(log_dir)
    directory = root / key
    if not directory.is_dir():
        others = [d.name for d in store_dirs(root)] if root.is_dir() else []
        if not others:
            return None
        note = f"no records for this target ({key}) in {root}, only for {', '.join(others)}: hand schedules"
        return TuningRecords(directory, key, ms.database.MemoryDatabase(),
                             StoreContents(directory, {}, [], [], {}), [note])
    contents = read_store(directory)
    database = usable_database(contents, key, best_only=True)
    notes = [str(problem) for problem in contents.problems] + contents.foreign(key)
    return TuningRecords(directory, key, database, contents, notes)


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyTuningRecords")
class ApplyTuningRecords:
    """Schedule each not-yet-scheduled PrimFunc from its best record, when one beats the hand schedule."""

    def __init__(self, records: TuningRecords, target: Target, log: dict[str, str] | None = None):
        self.records = records
        self.target = target
        self.log = log if log is not None else {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        database = self.records.database
        updates = {}
        for gvar, func, _ in unscheduled_kernels(mod, self.target):
            workload_mod = _normalize(func)
            if not database.has_workload(workload_mod):
                continue
            workload = database.commit_workload(workload_mod)
            top = database.get_top_k(workload, 1)
            if not top:
                continue
            _, hand = hand_schedule(workload_mod["main"], self.target)
            if hand is not None and _same_trace(hand.trace, top[0].trace):
                self.records.hand_best.append(gvar.name_hint)
                continue
            if not _sampled(top[0].trace):  # a hand schedule, but not today's: the rules changed since
                self.records.note(f"{gvar.name_hint}: its best record is an older hand schedule; "
                                  "the current one is used (re-tune to compare them)")
                continue
            sch = tvm.s_tir.Schedule(workload.mod)
            top[0].trace.apply_to_schedule(sch, remove_postproc=False)
            updates[gvar] = _with_attrs_of(sch.mod["main"], func)
            self.records.applied[gvar.name_hint] = self._describe(workload_mod, top[0])
            self.log[gvar.name_hint] = "tuned"
        mod = mod.clone()  # the caller's module (a cached session stage) stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    def _describe(self, workload_mod: tvm.IRModule, record) -> TunedKernel:
        secs = [float(s) for s in record.run_secs]
        contents = self.records.contents
        trials = sum(1 for r in contents.usable(self.records.target_key)
                     if tvm_ffi.structural_equal(contents.workloads[r.workload_index].mod, workload_mod))
        hand_us = contents.kernels.get(workload_id(workload_mod), {}).get("hand_us")
        return TunedKernel(sum(secs) / len(secs) * 1e6, hand_us, trials)


def _sampled(trace) -> bool:
    """Whether MetaSchedule's search made the trace (hand schedules make no random decisions)."""
    return any(inst.kind.name.startswith("Sample") for inst in trace.insts)


def _same_trace(a, b) -> bool:
    return tvm_ffi.structural_equal(a.as_json(remove_postproc=False), b.as_json(remove_postproc=False))


def _with_attrs_of(tuned: tirx.PrimFunc, original: tirx.PrimFunc) -> tirx.PrimFunc:
    """The tuned body under the original function's attributes (the workload form adds some)."""
    for key in list(tuned.attrs.keys()) if tuned.attrs else []:
        if not (original.attrs and key in original.attrs):
            tuned = tuned.without_attr(key)
    if original.attrs:
        tuned = tuned.with_attrs(dict(original.attrs))
    return tuned.with_attr("tirx.is_scheduled", True)
