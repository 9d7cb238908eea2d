"""Decomposed erf GELU -> nn.gelu, in the operand orders exporters emit."""

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from rewrite_helpers import apply_rule


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            gv = R.nn.gelu(x)
            R.output(gv)
        return gv


@I.ir_module
class TorchExport:
    """torch.onnx: Mul(Mul(x, Add(Erf(Div(x, 1.4142)), 1)), 0.5)."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            lv = R.divide(x, R.const(1.4142135381698608, "float32"))
            lv1 = R.erf(lv)
            lv2 = R.add(lv1, R.const(1.0, "float32"))
            lv3 = R.multiply(x, lv2)
            gv = R.multiply(lv3, R.const(0.5, "float32"))
            R.output(gv)
        return gv


def test_pytorch_export_order():
    after, report = apply_rule(TorchExport, "gelu_erf")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["gelu_erf"] == 1


def test_half_first_and_reciprocal_scale():
    """0.5 * x first, and x * 0.70710678 instead of x / sqrt(2), constants on the left."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.multiply(R.const(0.5, "float32"), x)
                lv1 = R.multiply(x, R.const(0.7071067690849304, "float32"))
                lv2 = R.erf(lv1)
                lv3 = R.add(R.const(1.0, "float32"), lv2)
                gv = R.multiply(lv, lv3)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "gelu_erf")
    tvm.ir.assert_structural_equal(after, Expected)


def test_must_not_rewrite_wrong_scale():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.divide(x, R.const(1.5, "float32"))
                lv1 = R.erf(lv)
                lv2 = R.add(lv1, R.const(1.0, "float32"))
                lv3 = R.multiply(x, lv2)
                gv = R.multiply(lv3, R.const(0.5, "float32"))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "gelu_erf")
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired
    assert "divisor 1.5" in report.near_misses[0].reason


def test_must_not_rewrite_when_erf_input_is_another_tensor():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), y: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.divide(y, R.const(1.4142135381698608, "float32"))
                lv1 = R.erf(lv)
                lv2 = R.add(lv1, R.const(1.0, "float32"))
                lv3 = R.multiply(x, lv2)
                gv = R.multiply(lv3, R.const(0.5, "float32"))
                R.output(gv)
            return gv

    after, _ = apply_rule(Before, "gelu_erf")
    tvm.ir.assert_structural_equal(after, Before)


def test_rewrite_preserves_values():
    x = np.linspace(-4, 4, 32, dtype="float32").reshape(4, 8)
    after, _ = apply_rule(TorchExport, "gelu_erf")
    np.testing.assert_allclose(run(after, x), run(TorchExport, x), rtol=1e-6, atol=1e-6)


def run(mod, *arrays):
    ex = tvm.compile(mod, target=tvm.target.Target("llvm"))
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()
