"""MishKernel: registered for CPUs before the built-in general rules, answers for the Mish
kernel only, and the compiled kernel keeps the numbers on both tails."""

import numpy as np
import tvm
from conftest import mish_model, run_optimized

from tvm_fusion.schedules import schedule_rules


def test_the_entry_point_registers_the_rule_before_the_general_rules():
    names = [type(rule).__name__ for rule in schedule_rules(tvm.target.Target({"kind": "llvm"}))]
    assert names.index("MishKernel") < names.index("Injective") < names.index("Fallback")


def test_the_rule_schedules_the_mish_kernel_and_nothing_else(save, wide_input):
    _, rules = run_optimized(save(mish_model("op")), wide_input)
    assert list(rules.values()).count("MishKernel") == 1, rules
    # A softplus used outside stays unfused: its kernels are not Mish and go to the built-in rules.
    _, rules = run_optimized(save(mish_model("shared")), wide_input)
    assert "MishKernel" not in rules.values(), rules


def test_scheduled_kernel_matches_the_definition(save, wide_input):
    got, _ = run_optimized(save(mish_model("op")), wide_input)
    x = wide_input.astype(np.float64)
    np.testing.assert_allclose(got, x * np.tanh(np.logaddexp(0.0, x)), rtol=1e-5, atol=1e-5)
