"""Tuning tasks: the kernels that compile builds, taken after our fuse and lower phases
(``session.ModelSession.tuning_module``).

Tuning the module before our fusion (or TVM's stock FuseOps output) would record workloads
that compile never builds, and the database would match nothing.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import tvm
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..schedules import hand_schedule


@dataclasses.dataclass
class KernelTask:
    """One fused kernel: its normalized module (what records are keyed on) and hand schedule."""

    name: str
    mod: tvm.IRModule
    weight: int
    hand_rule: str | None
    hand_schedule: Schedule | None
    excluded_by: str | None = None


def kernel_tasks(module: tvm.IRModule, target: Target, exclude: tuple[str, ...] = ()) -> list[KernelTask]:
    """One task per distinct kernel (weight = how many calls share it), excluded ones marked."""
    tasks = []
    for extracted in ms.relax_integration.extract_tasks(module, target):
        mod = extracted.dispatched[0]
        rule, sch = hand_schedule(mod["main"], target)
        excluded_by = next((p for p in exclude if fnmatch.fnmatchcase(extracted.task_name, p)), None)
        tasks.append(KernelTask(extracted.task_name, mod, int(extracted.weight), rule, sch, excluded_by))
    return tasks
