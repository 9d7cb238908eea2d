"""x * sigmoid(x) -> nn.silu."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from rewrite_helpers import apply_rule


def test_sigmoid_first_operand_order():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.sigmoid(x)
                gv = R.multiply(lv, x)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                gv = R.nn.silu(x)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "silu")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["silu"] == 1


def test_must_not_rewrite_gating_by_another_tensor():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.sigmoid(y)
                gv = R.multiply(x, lv)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "silu")
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired
