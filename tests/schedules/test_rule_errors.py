"""A schedule rule that raises is passed over: the kernel goes on to the next rule, from the
kernel as it came (what the raising rule did to its schedule is dropped), and the error is kept
as one line naming the rule and the kernel."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir
from tvm.relax.op import nn
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule

from tvm_fusion import schedules
from tvm_fusion.schedules import ApplySchedules, RuleError, error_line


class HalfDone(ScheduleRule):
    """Schedules part of every kernel (its first block's outer loop parallel, the inner one
    split), then raises as a rule with a bug does."""

    def __init__(self, error: Exception):
        self.error = error
        self.partial: list[tvm.tirx.PrimFunc] = []

    def apply(self, func, target, _):
        sch = s_tir.Schedule(func)
        block = sch.get_child_blocks(get_root_block(sch))[0]
        loops = sch.get_loops(block)
        sch.split(loops[-1], [None, 2])
        sch.parallel(loops[0])
        self.partial.append(sch.mod["main"])
        raise self.error


def _plant(monkeypatch, *first):
    """The rules for every target kind: ``first``, then the registry's."""
    original = schedules.rules_for_kind
    monkeypatch.setattr(schedules, "rules_for_kind", lambda kind: (*first, *original(kind)))


def _softmax_module(lowered):
    return lowered(lambda x: nn.softmax(x, axis=1), x=(2, 8, 32))


def test_a_raising_rule_is_passed_over_and_what_it_scheduled_is_dropped(monkeypatch, lowered, prim_funcs,
                                                                       target):
    module = _softmax_module(lowered)
    (kernel,) = prim_funcs(module)
    expected_log: dict[str, str] = {}
    expected = ApplySchedules(target, log=expected_log)(module.clone())

    rule = HalfDone(RuntimeError("a bug in the rule\n  C++ backtrace line 1\n  line 2"))
    _plant(monkeypatch, rule)
    log: dict[str, str] = {}
    errors: list[RuleError] = []
    scheduled = ApplySchedules(target, log=log, errors=errors)(module.clone())

    assert rule.partial, "the planted rule never ran"
    assert not tvm_ffi.structural_equal(rule.partial[0], module[kernel])  # it did change its schedule
    # The next rule started from the kernel as lowered: the same schedule as without the planted rule.
    assert log == expected_log and log[kernel] == "SoftmaxOverOuterAxis"
    tvm.ir.assert_structural_equal(scheduled[kernel], expected[kernel])
    assert errors == [RuleError(kernel, "HalfDone", "RuntimeError: a bug in the rule", "SoftmaxOverOuterAxis")]
    assert errors[0].line() == (f"schedule rule HalfDone failed on kernel {kernel} (RuntimeError: a bug in the "
                                "rule); SoftmaxOverOuterAxis scheduled it instead (report the model)")


def test_the_scheduled_kernel_computes_what_the_lowered_one_does(monkeypatch, lowered, prim_funcs, target):
    module = _softmax_module(lowered)
    _plant(monkeypatch, HalfDone(StopIteration()))
    scheduled = ApplySchedules(target)(module.clone())
    x = np.random.default_rng(0).standard_normal((2, 8, 32)).astype("float32")

    def run(mod):
        vm = tvm.relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
        return vm["main"](tvm.runtime.tensor(x)).numpy()

    expected = np.exp(x - x.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(run(scheduled), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run(module), expected, rtol=1e-5, atol=1e-6)


def test_when_every_rule_raises_the_kernel_is_left_unscheduled_and_each_error_kept(monkeypatch, lowered,
                                                                                    prim_funcs, target):
    module = _softmax_module(lowered)
    (kernel,) = prim_funcs(module)
    monkeypatch.setattr(schedules, "rules_for_kind", lambda kind: (HalfDone(StopIteration()), HalfDone(KeyError("k"))))
    log: dict[str, str] = {}
    errors: list[RuleError] = []
    scheduled = ApplySchedules(target, log=log, errors=errors)(module.clone())
    assert log == {}
    tvm.ir.assert_structural_equal(scheduled[kernel], module[kernel])
    assert [(e.rule, e.error, e.scheduled_by) for e in errors] == [("HalfDone", "StopIteration", None),
                                                                   ("HalfDone", "KeyError: 'k'", None)]
    assert "no rule scheduled it" in errors[0].line()


def test_a_rule_that_declines_is_no_error(lowered, prim_funcs, target):
    errors: list[RuleError] = []
    ApplySchedules(target, errors=errors)(_softmax_module(lowered))
    assert errors == []


@pytest.mark.parametrize("error, line", [
    (StopIteration(), "StopIteration"),
    (ValueError(""), "ValueError"),
    (IndexError("list index out of range"), "IndexError: list index out of range"),
    (RuntimeError("\n  first words\nTraceback (most recent call last):\n  File x"), "RuntimeError: first words"),
])
def test_an_error_is_one_line(error, line):
    assert error_line(error) == line


def test_a_schedule_error_from_tvm_is_one_line(lowered, prim_funcs):
    (func,) = prim_funcs(_softmax_module(lowered)).values()
    sch = s_tir.Schedule(func)
    with pytest.raises(s_tir.ScheduleError) as raised:
        sch.get_sblock("no_such_block")
    line = error_line(raised.value)
    assert "\n" not in line and line.startswith("ScheduleError: ") and len(line) <= len("ScheduleError: ") + 200
