"""Helpers for the tuning tests: configs with a [tuning] section, and records made without tuning.

Records are made from real schedules (the hand schedule, or a sampled tile split as a stand-in
for a tuned one) with chosen run times, so store, apply, merge and prune are tested in
seconds; only test_tune.py and test_rpc.py run MetaSchedule, with a handful of trials.
"""

from __future__ import annotations

from pathlib import Path

from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

import helpers
from tvm_fusion.tuning.store import TuningStore
from tvm_fusion.tuning.store_contents import read_store, target_key
from tvm_fusion.tuning.store_database import StoreDatabase

MLP_SHAPE = ["x:4x16"]
ADD = "fused_relax_matmul_relax_add"
GELU = "fused_relax_matmul_relax_add_relax_nn_gelu"


def tuning_config(path: Path, tuning: str = "") -> Path:
    """A host config with the real schedules and a [tuning] section (log_dir next to the file)."""
    return helpers.write_config(path, "default", extra="\n[tuning]\nlog_dir = \"logs\"\n" + tuning)


def other_schedule(task, seed: int = 1):
    """A schedule of the kernel as MetaSchedule's search makes them (a sampled tile split):
    not the hand schedule, and a trace with random decisions, like a tuned record's."""
    sch = s_tir.Schedule(task.mod, seed=seed)
    *_, columns, _ = sch.get_loops(sch.get_sblock("matmul"))
    sch.split(columns, sch.sample_perfect_tile(columns, n=2))
    return sch


def add_record(directory: Path, task, schedule, run_secs: float, target) -> None:
    """Append one record for ``task`` measured at ``run_secs`` on ``target`` to the store."""
    store = TuningStore(directory)
    database = StoreDatabase(store, read_store(directory), target_key(target))
    workload = database.commit_workload(task.mod)
    args = ms.arg_info.ArgInfo.from_entry_func(schedule.mod, remove_preproc=True)
    database.commit_tuning_record(ms.database.TuningRecord(schedule.trace, workload, [run_secs], target, args))
