"""Default schedules: one rule list per target family, and the pass that applies them."""

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from ..kernels.blocks import unscheduled_kernels
from .registry import rule_name, rules_for_kind


def schedule_rules(target: Target) -> list:
    """The rules for ``target``'s kind in the order they are asked (``registry``); the last answers always."""
    rules = list(rules_for_kind(target.kind.name))
    if not rules:
        raise ValueError(f"no default schedules for target kind {target.kind.name!r}")
    return rules


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplySchedules")
class ApplySchedules:
    """Schedule every PrimFunc not yet marked `tirx.is_scheduled` with the first rule that answers.

    After a run, `applied` (the `log` dict, when given) maps each function it scheduled to the
    name of the rule that did it.
    """

    def __init__(self, target: Target, log: dict[str, str] | None = None):
        self.target = target
        schedule_rules(target)  # a plugin that fails to load fails here, not inside the pass
        self.applied: dict[str, str] = log if log is not None else {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, target in unscheduled_kernels(mod, self.target):
            rule, sch = hand_schedule(func, target)
            if sch is not None:
                updates[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                self.applied[gvar.name_hint] = rule
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def hand_schedule(func: tirx.PrimFunc, target: Target) -> tuple[str | None, s_tir.Schedule | None]:
    """What ApplySchedules does with ``func``: (first answering rule, its schedule), or (None, None)."""
    for rule in schedule_rules(target):
        sch = _first_schedule(rule.apply(func, target, False))
        if sch is not None:
            return rule_name(rule), sch
    return None, None


def _first_schedule(space) -> s_tir.Schedule | None:
    """A rule answers None, one Schedule, or (when tunable) a list of them."""
    if isinstance(space, list):
        return space[0] if space else None
    return space
