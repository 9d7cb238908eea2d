"""The schedule rule registry: the rules in ``cpu/`` (and ``gpu/`` for CUDA) plus the ``tvm_fusion.schedules`` entry points
of installed plugins, per target kind, in the order they declare.

A rule is found by its module alone (a ``ScheduleRule`` subclass defined in a module of
``cpu/``), so adding one touches no list. ``runs_before``/``runs_after`` (class names) set the
order in which rules are asked; the first to answer schedules the kernel, so a specific rule
runs before a general one, and the general ones (``Reduction``, ``Injective``, ``Fallback``)
declare ``runs_after = ("*", ...)``; ``WinogradConv2dNCHWc``, which must see its kernels before
any other rule inlines their blocks, declares ``runs_before = ("*",)``. A plugin rule says which
target kinds it serves in ``target_kinds`` (``("llvm",)`` for CPUs).
"""

from __future__ import annotations

import functools

from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule

from ..ordering import declared_order
from ..plugins import classes_defined_in, plugin_rules
from . import cpu, gpu

ENTRY_POINT_GROUP = "tvm_fusion.schedules"


def rule_name(rule: ScheduleRule) -> str:
    return type(rule).__name__


@functools.cache
def rules_for_kind(kind: str) -> tuple[ScheduleRule, ...]:
    """The ordered rules for targets of ``kind`` (``llvm``, ``cuda``), built-in and plugged in."""
    plugged = [rule for rule in plugin_rules(ENTRY_POINT_GROUP, (ScheduleRule,), rule_name)
               if kind in getattr(rule, "target_kinds", ())]
    if kind == "llvm":
        return tuple(declared_order([*builtin_cpu_rules(), *plugged], "schedule rule", rule_name))
    if kind == "cuda":  # ours in gpu/ and any plugin rule for CUDA, then dlight's GPU rules
        return (*declared_order([*builtin_gpu_rules(), *plugged], "schedule rule", rule_name),
                dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    return tuple(declared_order(plugged, "schedule rule", rule_name))


def builtin_cpu_rules() -> list[ScheduleRule]:
    """One instance of each ScheduleRule subclass defined in a module of ``cpu/``."""
    return [cls() for cls in classes_defined_in(cpu, (ScheduleRule,))]


def builtin_gpu_rules() -> list[ScheduleRule]:
    """One instance of each ScheduleRule subclass defined in a module of ``gpu/`` (CUDA)."""
    return [cls() for cls in classes_defined_in(gpu, (ScheduleRule,))]
