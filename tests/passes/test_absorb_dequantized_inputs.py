"""A conv composite takes the dequantization of the quantized map it reads
(passes/absorb_dequantized_inputs.py): the kernel loads the bytes, not a float32 copy of them."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern


def fuse(mod, patterns=("conv_epilogue",)):
    report = PatternReport()
    return FusePatterns([get_pattern(p) for p in patterns], report)(mod), report


def run(mod, *args) -> np.ndarray:
    """The module lowered as the pipeline lowers it (unscheduled: any CPU runs it)."""
    lowered = tvm.transform.Sequential(lowering_passes())(mod)
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


@I.ir_module
class Dequantized:
    @R.function
    def main(x: R.Tensor((1, 16, 8, 8), "uint8"), w: R.Tensor((32, 16, 3, 3), "float32"),
             b: R.Tensor((1, 32, 1, 1), "float32")):
        with R.dataflow():
            lv = R.astype(x, "float32")
            lv1 = R.subtract(lv, R.const(7.0, "float32"))
            lv2 = R.nn.conv2d(lv1, w, padding=1)
            lv3 = R.add(lv2, b)
            gv = R.nn.relu(lv3)
            R.output(gv)
        return gv


def test_the_conv_reads_the_bytes_and_dequantizes_them_itself():
    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_nn_conv2d_relax_add_relax_nn_relu_dequantized(
            bytes: R.Tensor((1, 16, 8, 8), "uint8"), w: R.Tensor((32, 16, 3, 3), "float32"),
            b: R.Tensor((1, 32, 1, 1), "float32"), head_param_0: R.Tensor((), "float32"),
        ) -> R.Tensor((1, 32, 8, 8), "float32"):
            R.func_attr({"Composite": "conv_epilogue.conv_bias_relu_dequantized", "Primitive": True})
            with R.dataflow():
                lv = R.astype(bytes, "float32")
                lv1 = R.subtract(lv, head_param_0)
                lv2 = R.nn.conv2d(lv1, w, padding=1)
                lv3 = R.add(lv2, b)
                gv = R.nn.relu(lv3)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "uint8"), w: R.Tensor((32, 16, 3, 3), "float32"),
                 b: R.Tensor((1, 32, 1, 1), "float32")) -> R.Tensor((1, 32, 8, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_nn_conv2d_relax_add_relax_nn_relu_dequantized(x, w, b, R.const(7.0, "float32"))
                R.output(gv)
            return gv

    after, report = fuse(Dequantized)
    tvm.ir.assert_structural_equal(after, Expected)
    (instance,) = report.instances
    assert instance.variant.endswith("_dequantized") and instance.absorbed[:2] == ["lv", "lv1"]
    rng = np.random.default_rng(0)
    args = (rng.integers(0, 256, (1, 16, 8, 8)).astype("uint8"),
            rng.integers(-128, 128, (32, 16, 3, 3)).astype("float32"), rng.normal(size=(1, 32, 1, 1)).astype("float32"))
    np.testing.assert_array_equal(run(after, *args), run(Dequantized, *args))


def _variant(reader: str = "", zero_point: str = "scalar", dtype: str = "uint8"):
    """``Dequantized`` with the float map read again (``reader``), a zero point per channel, or
    another input dtype."""
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), dtype))
    w = relax.Var("w", relax.TensorType((32, 16, 1, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            value = bb.emit(relax.op.astype(x, "float32"))
            zero = (relax.const(7.0, "float32") if zero_point == "scalar"
                    else relax.const(np.arange(16, dtype="float32").reshape(1, 16, 1, 1)))
            centered = bb.emit(relax.op.subtract(value, zero))
            out = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(centered, w)))
            if reader:
                out = bb.emit(relax.op.add(out, relax.op.sum(centered)))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("case", [
    pytest.param(dict(reader="sum"), id="the float map is read elsewhere too"),
    pytest.param(dict(zero_point="per channel"), id="a zero point per channel (a tensor, not a scalar)"),
    pytest.param(dict(dtype="float16"), id="a cast of float16, not of bytes"),
])
def test_must_not_absorb(case):
    after, report = fuse(_variant(**case))
    assert report.instances and not any(i.variant.endswith("_dequantized") for i in report.instances)
    assert all(not gvar.name_hint.endswith("_dequantized") for gvar in after.get_global_vars())


def test_a_rule_that_does_not_ask_keeps_the_dequantization_out():
    @I.ir_module
    class Matmul:
        @R.function
        def main(x: R.Tensor((4, 16), "uint8"), w: R.Tensor((16, 32), "float32")):
            with R.dataflow():
                lv = R.astype(x, "float32")
                lv1 = R.subtract(lv, R.const(7.0, "float32"))
                lv2 = R.matmul(lv1, w)
                gv = R.nn.relu(lv2)
                R.output(gv)
            return gv

    after, report = fuse(Matmul, ("gemm_epilogue",))
    (instance,) = report.instances
    assert instance.variant == "gemm_epilogue.matmul_relu" and "lv" not in instance.absorbed
