"""Decomposed tanh GELU (GPT-2's gelu_new) -> nn.gelu_tanh."""

import numpy as np
import tvm
from tvm.script import ir as I
from tvm import relax
from tvm.script import relax as R

from rewrite_helpers import apply_rule
from test_gelu_erf import run


@I.ir_module
class GPT2Export:
    """As torch.onnx writes 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
        with R.dataflow():
            lv = R.multiply(x, R.const(0.5, "float32"))
            lv1 = R.power(x, R.const(3.0, "float32"))
            lv2 = R.multiply(lv1, R.const(0.044714998453855515, "float32"))
            lv3 = R.add(x, lv2)
            lv4 = R.multiply(lv3, R.const(0.7978845834732056, "float32"))
            lv5 = R.tanh(lv4)
            lv6 = R.add(lv5, R.const(1.0, "float32"))
            gv = R.multiply(lv, lv6)
            R.output(gv)
        return gv


def test_gpt2_export_becomes_gelu_tanh():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                gv = R.nn.gelu_tanh(x)
                R.output(gv)
            return gv

    after, report = apply_rule(GPT2Export, "gelu_tanh")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["gelu_tanh"] == 1
    x = np.linspace(-5, 5, 32, dtype="float32").reshape(4, 8)
    np.testing.assert_allclose(run(after, x), run(GPT2Export, x), rtol=1e-5, atol=1e-6)


def test_cube_as_multiplications():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                sq = R.multiply(x, x)
                cube = R.multiply(sq, x)
                lv2 = R.multiply(cube, R.const(0.044715, "float32"))
                lv3 = R.add(x, lv2)
                lv4 = R.multiply(lv3, R.const(0.7978845834732056, "float32"))
                lv5 = R.tanh(lv4)
                lv6 = R.add(lv5, R.const(1.0, "float32"))
                lv7 = R.multiply(x, lv6)
                gv = R.multiply(lv7, R.const(0.5, "float32"))
                R.output(gv)
            return gv

    _, report = apply_rule(Before, "gelu_tanh")
    assert report.fired["gelu_tanh"] == 1


def test_must_not_rewrite_wrong_coefficient():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                lv = R.multiply(x, R.const(0.5, "float32"))
                lv1 = R.power(x, R.const(3.0, "float32"))
                lv2 = R.multiply(lv1, R.const(0.1, "float32"))
                lv3 = R.add(x, lv2)
                lv4 = R.multiply(lv3, R.const(0.7978845834732056, "float32"))
                lv5 = R.tanh(lv4)
                lv6 = R.add(lv5, R.const(1.0, "float32"))
                gv = R.multiply(lv, lv6)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "gelu_tanh")
    tvm.ir.assert_structural_equal(after, Before)
    assert "cubic coefficient" in report.near_misses[0].reason


def _jax2tf_gelu(cube_of_x: bool = True) -> tvm.IRModule:
    """jax.nn.gelu through jax2tf and tf2onnx: ``x * (0.5 * (1 + tanh(c * (x + x * (x * (0.044715
    * t))))))``, constants first; ``t`` is x, or another tensor y (not x cubed)."""
    x, y = (relax.Var(name, relax.TensorType((4, 8), "float32")) for name in "xy")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            third = bb.emit(R.multiply(R.const(0.044714998453855515, "float32"), x if cube_of_x else y))
            cubic = bb.emit(R.multiply(x, bb.emit(R.multiply(x, third))))
            inner = bb.emit(R.multiply(R.const(0.7978845834732056, "float32"), bb.emit(R.add(x, cubic))))
            one_plus = bb.emit(R.add(R.const(1.0, "float32"), bb.emit(R.tanh(inner))))
            out = bb.emit_output(R.multiply(x, bb.emit(R.multiply(R.const(0.5, "float32"), one_plus))))
        bb.emit_func_output(out)
    return bb.get()


def test_jax2tf_spelling_with_the_coefficient_inside_the_cube():
    before = _jax2tf_gelu()
    after, report = apply_rule(before, "gelu_tanh")
    x, y = (relax.Var(name, relax.TensorType((4, 8), "float32")) for name in "xy")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.gelu_tanh(x))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())
    assert report.fired["gelu_tanh"] == 1
    x = np.linspace(-5, 5, 32, dtype="float32").reshape(4, 8)
    np.testing.assert_allclose(run(after, x, x), run(before, x, x), rtol=1e-5, atol=1e-6)


def test_must_not_rewrite_a_cubic_term_of_another_tensor():
    """``x + 0.044715 * x * x * y``: not x cubed."""
    before = _jax2tf_gelu(cube_of_x=False)
    after, report = apply_rule(before, "gelu_tanh")
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
