"""FoldConstantsSafely folds constants (layout changes of a constant in numpy), except where TVM's
FoldConstant would break the module."""

import numpy as np
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes.fold_constants import FoldConstantsSafely, fold_constant_layout_changes, transformed_constant


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


def _constants(mod: tvm.IRModule) -> list:
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e.value.numpy())
                                    if isinstance(e, tvm.ir.GenericConst) else None)
    return found


def _layout_changes_of_constants() -> tvm.IRModule:
    """A bias reshaped to 1xCx1x1, a weight transposed, a conv weight blocked 8i8o, and one
    blocked with its 45 input channels padded to 48 by 1.5."""
    rng = np.random.default_rng(0)
    bias, matrix = rng.standard_normal(16).astype("float32"), rng.standard_normal((24, 16)).astype("float32")
    weight, narrow = (rng.standard_normal(shape).astype("float32") for shape in ((16, 48, 3, 3), (16, 45, 3, 3)))
    x = relax.Var("x", relax.TensorType((1, 16, 4, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            values = [bb.emit(relax.op.add(x, relax.op.reshape(relax.const(bias), (1, 16, 1, 1)))),
                      bb.emit(relax.op.permute_dims(relax.const(matrix))),
                      bb.emit(relax.op.layout_transform(relax.const(weight), lambda o, i, h, w: (
                          o // 8, i // 8, h, w, i % 8, o % 8))),
                      bb.emit(relax.op.layout_transform(relax.const(narrow), lambda o, i, h, w: (
                          o, i // 8, h, w, i % 8), pad_value=1.5))]
            out = bb.emit_output(relax.Tuple(values))
        bb.emit_func_output(out)
    return bb.get()


def test_layout_changes_of_constants_are_folded_in_numpy_as_foldconstant_folds_them():
    """Without an LLVM build per constant (10 s of nudenet's pipeline): the same constants,
    bit for bit, as TVM's FoldConstant computes, and no reshape, transpose or transform left."""
    before = _layout_changes_of_constants()
    ours = fold_constant_layout_changes(before)
    script = ours["main"].script()
    assert not any(op in script for op in ("R.reshape", "R.permute_dims", "R.layout_transform"))
    expected = _constants(relax.transform.FoldConstant()(before))
    got = _constants(ours)
    assert [a.shape for a in got] == [a.shape for a in expected] == [(1, 16, 1, 1), (16, 24), (2, 6, 3, 3, 8, 8),
                                                                      (16, 6, 3, 3, 8)]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert (got[3][:, 5, :, :, 5:] == 1.5).all()


def test_a_padding_transform_without_a_pad_value_is_left_to_foldconstant():
    index_map = tvm.tirx.IndexMap.from_func(lambda o, i: (o, i // 8, i % 8))
    assert transformed_constant(np.ones((2, 45), "float32"), index_map, None) is None
    assert transformed_constant(np.ones((2, 48), "float32"), index_map, None).shape == (2, 6, 8)
