"""Inference Dropout is removed: R.nn.dropout(x)[0] -> x, equal to ONNX Runtime (identity)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

from rewrite_helpers import apply_rule
from tvm_fusion import api
from tvm_fusion.config import parse_config
from tvm_fusion.runtime import CompiledModel


def test_inference_dropout_is_removed():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                lv = R.nn.dropout(x, rate=0.1)
                lv1 = lv[0]
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            with R.dataflow():
                gv = R.nn.relu(x)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "dropout")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["dropout"] == 1


def test_must_not_remove_a_dropout_onnxruntime_rejects():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                lv = R.nn.dropout(x, rate=1.5)
                gv = lv[0]
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "dropout")
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == [
        "dropout ratio 1.5 is outside [0, 1) (ONNX Runtime rejects the model)"]


def dropout_model(training_mode: bool | None, with_mask: bool) -> onnx.ModelProto:
    """x -> Relu -> Dropout(ratio 0.3[, training_mode]) -> y [, mask], opset 17."""
    initializers = [numpy_helper.from_array(np.array(0.3, np.float32), "ratio")]
    dropout_inputs = ["r", "ratio"]
    if training_mode is not None:
        initializers.append(numpy_helper.from_array(np.array(training_mode), "training"))
        dropout_inputs.append("training")
    outputs = ["y", "mask"] if with_mask else ["y"]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Dropout", dropout_inputs, outputs, name="drop", seed=3)],
        "inference_dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 10])]
        + ([helper.make_tensor_value_info("mask", TensorProto.BOOL, [6, 10])] if with_mask else []),
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("training_mode", [False, None])
@pytest.mark.parametrize("with_mask", [True, False])
def test_onnx_inference_dropout_equals_onnxruntime(tmp_path, training_mode, with_mask):
    model = dropout_model(training_mode, with_mask)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    cfg = parse_config({"target": {"kind": "llvm"}, "pipeline": {"patterns": ["dropout"]}}, name="test")
    prepared = api.prepare(path, cfg)
    optimized = api.optimize(prepared)
    assert optimized.report.fired["dropout"] == 1
    compiled = CompiledModel(api.build(optimized.module, cfg),
                             {"inputs": [s.to_json() for s in prepared.inputs],
                              "outputs": [{"name": n} for n in prepared.output_names], "threads": 1})
    x = np.random.default_rng(0).standard_normal((6, 10)).astype("float32")
    got = compiled.run({"x": x})
    expected = dict(zip(prepared.output_names, ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})))
    np.testing.assert_array_equal(got["y"], expected["y"])  # identity: exact
    np.testing.assert_array_equal(got["y"], np.maximum(x, 0))
    if with_mask:
        assert got["mask"].dtype == np.bool_ and got["mask"].all()
        np.testing.assert_array_equal(got["mask"], expected["mask"])
