"""MergeSiblingConvs: convs that read one input with the same attributes become one conv over
their concatenated filters, sliced back by channel; convs that differ (stride, padding, input,
groups), that have no constant weight or that feed a bias add stay apart, each refusal with its
reason (a near miss where a model could avoid it); a model of two sibling convs matches ONNX Runtime and the unfused module."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.merge_sibling_convs import MergeSiblingConvs, epilogue_reason, merge_reason, reader_ops
from tvm_fusion.patterns import PatternReport

# Stated tolerances: float32 convs, summation order differs between the engines.
RTOL, ATOL = 1e-4, 1e-4
REAL = np.arange(3 * 1 * 4, dtype=np.float32).reshape(3, 1, 4) / 10
IMAG = -REAL[::-1].copy()


def test_sibling_conv1ds_become_one_conv_sliced_by_channel():
    """Each result squared (``x * x``, no epilogue) and summed: a power spectrum."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 1, 20), "float32")):
            with R.dataflow():
                re = R.nn.conv1d(x, R.const(REAL), strides=[2])
                im = R.nn.conv1d(x, R.const(IMAG), strides=[2])
                gv = R.add(R.multiply(re, re), R.multiply(im, im))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 1, 20), "float32")):
            with R.dataflow():
                both = R.nn.conv1d(x, R.const(np.concatenate([REAL, IMAG])), strides=[2])
                re = R.strided_slice(both, axes=[1], begin=[0], end=[3], assume_inbound=True)
                im = R.strided_slice(both, axes=[1], begin=[3], end=[6], assume_inbound=True)
                gv = R.add(R.multiply(re, re), R.multiply(im, im))
                R.output(gv)
            return gv

    report = PatternReport()
    tvm.ir.assert_structural_equal(MergeSiblingConvs(report)(Before), Expected)
    assert report.variants["merge_sibling_convs.conv1d"] == 1


def test_convs_of_two_equal_views_of_one_signal_are_siblings():
    """Conv1dAsConv2d gives each conv its own ``expand_dims`` of the signal: equal views of one
    variable are one input; the merged conv reads the first."""
    real, imag = REAL.reshape(3, 1, 1, 4), IMAG.reshape(3, 1, 1, 4)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 1, 20), "float32")):
            with R.dataflow():
                row_re = R.expand_dims(x, [2])
                re = R.nn.conv2d(row_re, R.const(real), strides=[1, 2])
                row_im = R.expand_dims(x, [2])
                im = R.nn.conv2d(row_im, R.const(imag), strides=[1, 2])
                gv = R.add(R.power(re, R.const(2.0)), R.power(im, R.const(2.0)))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 1, 20), "float32")):
            with R.dataflow():
                row_re = R.expand_dims(x, [2])
                both = R.nn.conv2d(row_re, R.const(np.concatenate([real, imag])), strides=[1, 2])
                re = R.strided_slice(both, axes=[1], begin=[0], end=[3], assume_inbound=True)
                im = R.strided_slice(both, axes=[1], begin=[3], end=[6], assume_inbound=True)
                row_im = R.expand_dims(x, [2])
                gv = R.add(R.power(re, R.const(2.0)), R.power(im, R.const(2.0)))
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(MergeSiblingConvs()(Before), Expected)


def _two_convs(second_stride=2, second_padding=(0, 0), second_input=False, second_weight_param=False,
               groups=1, bias=False):
    """``conv1d(x, W1) + conv1d(x or y, W2)`` with the second conv's attributes varied."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 20), "float32"))
    y = relax.Var("y", relax.TensorType((1, 2, 20), "float32"))
    w2 = relax.Var("w2", relax.TensorType((2, 2 // groups, 4), "float32"))
    params = [x, y] + ([w2] if second_weight_param else [])
    weight = np.ones((2, 2 // groups, 4), np.float32)
    with bb.function("main", params):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.conv1d(x, relax.const(weight), strides=[2], groups=groups))
            if bias:
                a = bb.emit(relax.op.add(a, relax.const(np.ones((1, 2, 1), np.float32))))
            b = bb.emit(relax.op.nn.conv1d(y if second_input else x, w2 if second_weight_param else relax.const(weight * 2),
                                           strides=[second_stride], padding=list(second_padding), groups=groups))
            out = bb.emit_output(relax.op.concat([a, b], axis=2))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("variant, reason, reported", [
    (dict(second_stride=1), "strides differs ([2] vs [1])", False),
    (dict(second_padding=(1, 1)), "padding differs ([0, 0] vs [1, 1])", False),
    (dict(second_input=True), "reads another input", False),
    (dict(second_weight_param=True), "a weight is not a constant", True),
    (dict(groups=2), "grouped conv (2 groups)", True),
])
def test_must_not_merge_convs_that_differ(variant, reason, reported):
    """Another stride, padding or input, a weight computed at run time, grouped convs: the
    module is unchanged and the check says why; the refusals a model could avoid are near
    misses, a CNN's usual siblings (other strides, paddings) are not."""
    before = _two_convs(**variant)
    report = PatternReport()
    tvm.ir.assert_structural_equal(MergeSiblingConvs(report)(before), before)
    first, second = _conv_calls(before)
    assert reason in merge_reason(first, second)
    assert [reason in miss.reason for miss in report.near_misses] == ([True] if reported else [])


def test_must_not_merge_a_conv_whose_bias_add_it_would_fuse():
    before = _two_convs(bias=True)
    report = PatternReport()
    tvm.ir.assert_structural_equal(MergeSiblingConvs(report)(before), before)
    bindings = before["main"].body.blocks[0].bindings
    assert "feeds add (a bias or an activation)" in epilogue_reason(bindings[0].var, reader_ops(bindings))
    assert not report.near_misses  # how CNNs are built, not a miss


def _conv_calls(mod) -> list:
    return [b.value for b in mod["main"].body.blocks[0].bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.conv1d"]


def test_merge_reason_names_a_sibling_that_is_not_a_conv():
    x = relax.Var("x", relax.TensorType((1, 2, 20), "float32"))
    conv = relax.op.nn.conv1d(x, relax.const(np.ones((2, 2, 4), np.float32)))
    assert merge_reason(conv, relax.op.nn.relu(x)) == "relax.nn.relu is not a relax.nn.conv1d"
    assert merge_reason(conv, relax.op.nn.conv1d(x, relax.const(np.ones((3, 2, 4), np.float32)))) is None


def _sibling_conv_model(width: int) -> onnx.ModelProto:
    """Two bias-free 3x3 convs of one map (8 and 5 filters), each squared, then summed over
    channels into one map each and added, so the slices feed element-wise ops."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((5, 4, 3, 3)).astype(np.float32) * 0.3, "w2"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c1", "c1"], ["s1"]),
             helper.make_node("Mul", ["c2", "c2"], ["s2"]),
             helper.make_node("ReduceSum", ["s1", "axes"], ["r1"], keepdims=1),
             helper.make_node("ReduceSum", ["s2", "axes"], ["r2"], keepdims=1),
             helper.make_node("Add", ["r1", "r2"], ["y"])]
    graph = helper.make_graph(nodes, "sibling_convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 6, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_sibling_convs_run_as_one_conv_and_match_onnxruntime(tmp_path):
    model = _sibling_conv_model(width=10)
    path = tmp_path / "sibling_convs.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.variants["merge_sibling_convs.conv2d"] == 1
    convs = [name for name in optimized.schedule_rules if "conv2d" in name]
    assert len(convs) == 1, optimized.schedule_rules
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 4, 6, 10)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)
