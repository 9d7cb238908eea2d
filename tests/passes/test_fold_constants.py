"""FoldConstantsSafely folds constants, except where TVM's FoldConstant would break the module."""

import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes.fold_constants import FoldConstantsSafely


def test_constant_arithmetic_is_folded():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                lv = R.add(R.const(1.0, "float32"), R.const(2.0, "float32"))
                gv = R.multiply(x, lv)
                R.output(gv)
            return gv

    folded = FoldConstantsSafely()(Before)
    assert "R.add" not in folded["main"].script()


def test_runtime_slice_module_stays_well_formed():
    """ONNX Slice with run-time starts: plain FoldConstant leaves an undefined shape_func."""
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends"], ["y"])], "slice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4]),
         helper.make_tensor_value_info("starts", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("ends", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    mod = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not relax.analysis.check_well_formed(relax.transform.FoldConstant()(mod)), (
        "TVM's FoldConstant no longer breaks this module: FoldConstantsSafely can go")
    assert relax.analysis.check_well_formed(FoldConstantsSafely()(mod))
    tvm.compile(relax.get_pipeline("zero")(FoldConstantsSafely()(mod)), target=tvm.target.Target("llvm"))
