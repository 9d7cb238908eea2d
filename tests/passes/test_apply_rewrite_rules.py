"""ApplyRewriteRules leaves the module it is given untouched (callers reuse it as a baseline)."""

from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes import ApplyRewriteRules
from tvm_fusion.patterns import PatternReport, get_pattern


@I.ir_module
class SigmoidGate:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            lv = R.sigmoid(x)
            gv = R.multiply(lv, x)
            R.output(gv)
        return gv


def test_input_module_is_not_mutated():
    before = SigmoidGate.script()
    report = PatternReport()
    after = ApplyRewriteRules([get_pattern("silu")], report)(SigmoidGate)
    assert report.fired["silu"] == 1
    assert "R.nn.silu" in after.script()
    assert SigmoidGate.script() == before
