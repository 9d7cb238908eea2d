"""Default schedules: one rule list per target family, and the pass that applies them."""

from __future__ import annotations

import dataclasses

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from ..kernels.blocks import unscheduled_kernels
from .registry import rule_name, rules_for_kind


# TVM's vectorizer takes ``round`` but not ``nearbyint``, which ``relax.round`` (ONNX Round, a
# quantized conv's requantization) legalizes to: a loop of it, vectorized, came out as scalar
# code that LLVM half-vectorized again (a QDQ conv's requantize -> hardswish -> quantize
# epilogue, kernel alone: 451 us against 105 us for the float conv's). Both are one rounding
# instruction in ties-to-even mode.
if tvm.ir.Op.get("tirx.nearbyint").get_attr("TVectorizable") is None:
    tvm.ir.register_op_attr("tirx.nearbyint", "TVectorizable", True)


@dataclasses.dataclass(frozen=True)
class RuleError:
    """A schedule rule that raised on a kernel; the kernel went on to the next rule."""

    kernel: str
    rule: str
    error: str  # the exception's type and the first line of its message
    scheduled_by: str | None  # the rule that scheduled the kernel instead (None: no rule did)

    def line(self) -> str:
        instead = f"{self.scheduled_by} scheduled it instead" if self.scheduled_by else "no rule scheduled it"
        return f"schedule rule {self.rule} failed on kernel {self.kernel} ({self.error}); {instead} (report the model)"


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
    name of the rule that did it, and `rule_errors` (the `errors` list, when given) holds a
    RuleError for each rule that raised on a function instead of answering.
    """

    def __init__(self, target: Target, log: dict[str, str] | None = None, errors: list[RuleError] | None = None):
        self.target = target
        schedule_rules(target)  # a plugin that fails to load fails here, not inside the pass
        self.applied: dict[str, str] = log if log is not None else {}
        self.rule_errors: list[RuleError] = errors if errors is not None else []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, target in unscheduled_kernels(mod, self.target):
            failures: list[tuple[str, str]] = []
            rule, sch = hand_schedule(func, target, failures)
            self.rule_errors.extend(RuleError(gvar.name_hint, failed, error, rule) for failed, error in failures)
            if sch is not None:
                updates[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                self.applied[gvar.name_hint] = rule
        mod = mod.clone()  # the caller's module (a cached session stage) stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def hand_schedule(func: tirx.PrimFunc, target: Target,
                  failures: list[tuple[str, str]] | None = None) -> tuple[str | None, s_tir.Schedule | None]:
    """What ApplySchedules does with ``func``: (first answering rule, its schedule), or (None, None).

    A rule that raises is passed over as if it had declined, and (its name, the error in one
    line) goes to ``failures``. What it did before it raised goes with its Schedule: a Schedule
    of ``func`` rewrites copies of its nodes, never ``func``, so the next rule starts from the
    kernel as it came.
    """
    for rule in schedule_rules(target):
        try:
            sch = _first_schedule(rule.apply(func, target, False))
        except Exception as err:  # whatever a rule raises is its own bug, not the model's
            if failures is not None:
                failures.append((rule_name(rule), error_line(err)))
            continue
        if sch is not None:
            return rule_name(rule), sch
    return None, None


def error_line(err: BaseException) -> str:
    """``err`` in one line: its type, and the first line of its message where it has one (TVM's
    messages go on with a C++ backtrace)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def _first_schedule(space) -> s_tir.Schedule | None:
    """A rule answers None, one Schedule, or (when tunable) a list of them."""
    if isinstance(space, list):
        return space[0] if space else None
    return space
