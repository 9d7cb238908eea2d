"""ONNX Max/Min of two tensors as TVM imports them (stack, then reduce) -> maximum/minimum."""

import numpy as np
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import run
from rewrite_helpers import apply_rule
from tvm_fusion.config import load_config
from tvm_fusion.frontend.onnx import TensorSpec, import_model
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport

ZEROS = np.zeros((1, 6), np.float32)


def test_a_clamp_at_zero_becomes_maximum_with_a_scalar():
    """jax2tf's variance clamp ``Max(0, v)``: the no-op broadcast goes, the zeros become 0."""
    @I.ir_module
    class Before:
        @R.function
        def main(v: R.Tensor((1, 6), "float32")):
            with R.dataflow():
                same = R.broadcast_to(v, R.shape([1, 6]))
                stacked = R.stack((R.const(ZEROS), same), axis=0)
                gv = R.max(stacked, axis=[0], keepdims=False)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(v: R.Tensor((1, 6), "float32")):
            with R.dataflow():
                gv = R.maximum(R.const(0.0, "float32"), v)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "stacked_max_min")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["stacked_max_min"] == 1


def test_min_of_two_tensors_keeps_a_real_broadcast():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 6), "float32"), b: R.Tensor((1, 6), "float32")):
            with R.dataflow():
                wide = R.broadcast_to(b, R.shape([2, 6]))
                stacked = R.stack((a, wide), axis=0)
                gv = R.min(stacked, axis=[0], keepdims=False)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 6), "float32"), b: R.Tensor((1, 6), "float32")):
            with R.dataflow():
                wide = R.broadcast_to(b, R.shape([2, 6]))
                gv = R.minimum(a, wide)
                R.output(gv)
            return gv

    after, _ = apply_rule(Before, "stacked_max_min")
    tvm.ir.assert_structural_equal(after, Expected)


def test_must_not_rewrite_a_reduction_that_keeps_the_stacked_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((1, 6), "float32"), b: R.Tensor((1, 6), "float32")):
            with R.dataflow():
                stacked = R.stack((a, b), axis=0)
                gv = R.max(stacked, axis=[0], keepdims=True)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "stacked_max_min")
    tvm.ir.assert_structural_equal(after, Before)
    assert any(m.pattern == "stacked_max_min" and "stacked axis" in m.reason for m in report.near_misses)


def test_onnx_max_and_min_of_two_match_onnxruntime():
    """Max(x, 0) then Min(·, y) as a model: the rewritten module against ONNX Runtime, exactly."""
    graph = helper.make_graph(
        [helper.make_node("Max", ["x", "zeros"], ["clamped"]), helper.make_node("Min", ["clamped", "y"], ["out"])],
        "max_min", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6]),
                    helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 6])],
        [numpy_helper.from_array(np.zeros((3, 6), np.float32), "zeros")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((3, 6)).astype(np.float32), "y": rng.standard_normal((3, 6)).astype(np.float32)}
    cfg = load_config()
    report = PatternReport()
    module = fusion_pipeline(cfg, report)(import_model(model, [TensorSpec(n, (3, 6), "float32") for n in inputs]))
    assert report.fired["stacked_max_min"] == 2
    (expected,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    np.testing.assert_array_equal(run(module, cfg, inputs), expected)
