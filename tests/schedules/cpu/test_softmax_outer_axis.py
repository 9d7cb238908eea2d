"""SoftmaxOverOuterAxis: a softmax over an axis other than the innermost, on vectors along the
innermost axis, the same numbers as the unscheduled kernel."""

import math

import helpers
import numpy as np
import onnx
import pytest
from loop_structure import loop_kinds
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.op import nn

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.schedules import hand_schedule, schedule_rules
from tvm_fusion.schedules.cpu import Softmax, SoftmaxOverOuterAxis


def vector_width(columns, lanes):
    width = 1
    while width * 2 <= lanes and columns % (width * 2) == 0:
        width *= 2
    return width


@pytest.mark.parametrize("shape, axis", [
    ((1, 16, 4, 2100), 1),   # YOLOv8's distribution head: 16 bins x 4 sides x anchors (4 divides 2100)
    ((2, 5, 3, 64), 1),      # a batch, 5 classes
    ((7, 3, 40), 0),         # the outermost axis
    ((3, 6, 8, 32), 2),      # an axis between two others
])
def test_schedule_matches_unscheduled(assert_schedule_matches, lanes, shape, axis):
    funcs = assert_schedule_matches(SoftmaxOverOuterAxis(), lambda x: nn.softmax(x, axis=axis), x=shape)
    (func,) = funcs.values()
    width = vector_width(shape[-1], lanes)
    loops = loop_kinds(func)
    positions = math.prod(shape) // shape[axis] // width
    assert loops.parallel == ([positions] if math.prod(shape) >= 4096 else [])
    # max and sum (each with its vector init), exp and the normalized store: all on vectors
    assert loops.vectorized == [width] * 6


def test_declines_a_softmax_over_the_innermost_axis(lowered, prim_funcs, target):
    (func,) = prim_funcs(lowered(lambda x: nn.softmax(x, axis=-1), x=(4, 16, 64))).values()
    assert SoftmaxOverOuterAxis().apply(func, target, False) is None
    assert Softmax().apply(func, target, False) is not None


@pytest.mark.parametrize("shape", [(1, 16, 4, 2101), (2, 8, 6)])
def test_declines_an_innermost_axis_no_vector_of_four_divides(lowered, prim_funcs, target, shape):
    (func,) = prim_funcs(lowered(lambda x: nn.softmax(x, axis=1), x=shape)).values()
    assert SoftmaxOverOuterAxis().apply(func, target, False) is None


def test_yolov8_distribution_head_matches_onnxruntime(tmp_path):
    """YOLOv8's DFL as its exporters write it: box logits as 4 sides x 16 bins, a softmax over
    the bins on axis 1, and a 1x1 conv with weights 0..15 (the expected distance). The softmax
    kernel takes this rule; fused == unfused == ONNX Runtime."""
    anchors = 84
    nodes = [helper.make_node("Reshape", ["boxes", "sides_bins"], ["binned"]),
             helper.make_node("Transpose", ["binned"], ["bins_first"], perm=[0, 2, 1, 3]),
             helper.make_node("Softmax", ["bins_first"], ["probs"], axis=1),
             helper.make_node("Conv", ["probs", "bin_values"], ["distance"]),
             helper.make_node("Reshape", ["distance", "sides"], ["out"])]
    initializers = [numpy_helper.from_array(np.array([1, 4, 16, anchors], np.int64), "sides_bins"),
                    numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1), "bin_values"),
                    numpy_helper.from_array(np.array([1, 4, anchors], np.int64), "sides")]
    graph = helper.make_graph(nodes, "dfl", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 64, anchors])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, anchors])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "dfl.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert "SoftmaxOverOuterAxis" in optimized.schedule_rules.values()
    inputs = {"boxes": np.random.default_rng(0).standard_normal((1, 64, anchors)).astype(np.float32) * 4}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scores, values", [
    ((2, 50, 1), (2, 50, 64)),       # attention pooling: weights over time, one per step, times features
    ((1, 16, 4, 1), (1, 16, 4, 64)),
])
def test_declines_a_softmax_its_epilogue_broadcasts_along_the_innermost_axis(
        lowered, prim_funcs, target, assert_schedule_matches, scores, values):
    """The output's innermost axis is 64 wide but the softmax's is 1: no vector of positions to
    run the max and the sum on (this raised StopIteration, and aborted the compile)."""
    def pooling(x, h):
        return relax.op.multiply(nn.softmax(x, axis=1), h)

    (func,) = prim_funcs(lowered(pooling, x=scores, h=values)).values()
    assert SoftmaxOverOuterAxis().apply(func, target, False) is None
    failures: list = []
    rule, _ = hand_schedule(func, target, failures)
    assert failures == [] and rule not in (None, "SoftmaxOverOuterAxis")
    taken = next(r for r in schedule_rules(target) if type(r).__name__ == rule)
    assert_schedule_matches(taken, pooling, x=scores, h=values)
