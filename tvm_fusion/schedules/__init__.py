"""Default schedules: one rule list per target family, and the pass that applies them."""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
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

    def __init__(self, target: Target, log: dict[str, str] | None = None, errors: list[RuleError] | None = None,
                 memo: ScheduleMemo | None = None):
        self.target = target
        schedule_rules(target)  # a plugin that fails to load fails here, not inside the pass
        self.applied: dict[str, str] = log if log is not None else {}
        self.rule_errors: list[RuleError] = errors if errors is not None else []
        self._schedule = memo.schedule if memo is not None else _schedule_kernel

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, target in unscheduled_kernels(mod, self.target):
            rule, scheduled, failures = self._schedule(func, target)
            self.rule_errors.extend(RuleError(gvar.name_hint, failed, error, rule) for failed, error in failures)
            if scheduled is not None:
                updates[gvar] = scheduled
                self.applied[gvar.name_hint] = rule
        mod = mod.clone()  # the caller's module (a cached session stage) stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _schedule_kernel(func: tirx.PrimFunc, target: Target) -> tuple[str | None, tirx.PrimFunc | None, list]:
    """(the rule, the scheduled kernel marked scheduled or None, the rules that raised on it)."""
    failures: list[tuple[str, str]] = []
    rule, sch = hand_schedule(func, target, failures)
    return rule, None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True), failures


class ScheduleMemo:
    """The hand schedules of the kernels one model's compile has seen, for its later builds of
    the same kernels: a bf16 compile schedules its float32 graph to judge the bf16 kernels, then
    the bf16 one, whose other kernels are the same; the fusion gate's builds repeat them too. A
    kernel is found by its structure (its name aside) and the target; the rules in force are part
    of the key, so a plugin loaded or a rule planted since is asked anew."""

    def __init__(self):
        self._known: dict[tuple, list] = {}

    def schedule(self, func: tirx.PrimFunc, target: Target) -> tuple[str | None, tirx.PrimFunc | None, list]:
        """What ``_schedule_kernel`` answers for ``func``, from memory where it has seen the kernel."""
        symbol = _symbol(func)
        anonymous = func if symbol is None else func.without_attr("global_symbol")
        key = (str(target), tuple(schedule_rules(target)), tvm_ffi.structural_hash(anonymous))
        for known, (rule, scheduled, failures) in self._known.get(key, ()):
            if tvm_ffi.structural_equal(known, anonymous):
                return rule, _named(scheduled, symbol), failures
        answer = _schedule_kernel(func, target)
        self._known.setdefault(key, []).append((anonymous, answer))
        return answer


def _symbol(func: tirx.PrimFunc):
    return func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else None


def _named(scheduled: tirx.PrimFunc | None, symbol) -> tirx.PrimFunc | None:
    """A remembered schedule under the name of the kernel that asked for it."""
    if scheduled is None or _symbol(scheduled) == symbol:
        return scheduled
    return scheduled.without_attr("global_symbol") if symbol is None else scheduled.with_attr("global_symbol", symbol)


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
