"""Conv1dAsConv2d: a Conv1d becomes a one-row Conv2d; with SinkViews a Conv1d stack runs as
Conv2d kernels with their epilogues fused and no squeeze between them, matching ONNX Runtime
and the unfused module."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.passes.conv1d_as_conv2d import Conv1dAsConv2d
from tvm_fusion.passes.sink_views import view_count
from tvm_fusion.patterns import PatternReport

# Stated tolerances: float32 convs, summation order differs between the engines.
RTOL, ATOL = 1e-4, 1e-4
WEIGHT = np.arange(2 * 3 * 3, dtype=np.float32).reshape(2, 3, 3)


def test_conv1d_becomes_a_one_row_conv2d():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3, 10), "float32")):
            with R.dataflow():
                gv = R.nn.conv1d(x, R.const(WEIGHT), strides=[2], padding=[1, 0], dilation=[1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 10), "float32")):
            with R.dataflow():
                row = R.expand_dims(x, [2])
                conv = R.nn.conv2d(row, R.const(WEIGHT.reshape(2, 3, 1, 3)), strides=[1, 2],
                                   padding=[0, 1, 0, 0], dilation=[1, 1])
                gv = R.squeeze(conv, [2])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Before), Expected)


def test_conv1d_transpose_becomes_a_one_row_conv2d_transpose():
    """A ConvTranspose1d head (IOW weight) with stride, padding and output padding."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 10), "float32")):
            with R.dataflow():
                gv = R.nn.conv1d_transpose(x, R.const(WEIGHT), strides=[2], padding=[1, 1], output_padding=[1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 10), "float32")):
            with R.dataflow():
                row = R.expand_dims(x, [2])
                conv = R.nn.conv2d_transpose(row, R.const(WEIGHT.reshape(2, 3, 1, 3)), strides=[1, 2],
                                             padding=[0, 1, 0, 1], output_padding=[0, 1], dilation=[1, 1])
                gv = R.squeeze(conv, [2])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Before), Expected)


def test_must_not_rewrite_a_channels_last_conv1d():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 10, 3), "float32")):
            with R.dataflow():
                gv = R.nn.conv1d(x, R.const(WEIGHT), data_layout="NWC")
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Before), Before)


def _conv1d_stack(width: int, channels: int = 16) -> onnx.ModelProto:
    """Conv1d(+bias) -> Relu -> Conv1d(stride 2, pad 1, +bias) -> Sigmoid, as audio encoders are."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((channels, 4, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((channels, channels, 3)).astype(np.float32) * 0.2, "w2"),
             numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1], strides=[2]),
             helper.make_node("Sigmoid", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "conv1d_stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, (width - 1) // 2 + 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("width", [1, 37, 400])
def test_conv1d_stack_fuses_its_epilogues_and_matches_onnxruntime(tmp_path, width):
    """A one-sample signal, an odd one and a long one."""
    model = _conv1d_stack(width)
    path = tmp_path / "conv1d_stack.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    canonical = fusion_pipeline(prepared.config, PatternReport(), phases=("canonicalize",))(prepared.relax_module)
    assert view_count(canonical["main"]) == 2  # the input's row and the output's squeeze; none between
    optimized = api.optimize(prepared)
    assert optimized.report.fired["conv_epilogue"] == 2
    conv_rules = {k: v for k, v in optimized.schedule_rules.items() if "conv" in k}
    assert conv_rules and "Fallback" not in conv_rules.values(), conv_rules
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 4, width)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def _dilated_circular_stack(width: int, channels: int = 8, layers: int = 4) -> onnx.ModelProto:
    """An EEG/TCN-style stack: per layer a circular pad written as Slice + Concat, a Conv1d
    at dilation 2, 4, 8, ... (+bias), Relu and a residual add; a ConvTranspose1d upsampling head."""
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        dilation = 2 ** (i + 1)
        pad = dilation  # kernel 3: one dilation each side
        inits += [numpy_helper.from_array(np.array(v, np.int64), f"{name}{i}") for name, v in
                  (("tail_start", [width - pad]), ("tail_end", [width]), ("head_start", [0]), ("head_end", [pad]),
                   ("axis", [2]))]
        inits += [numpy_helper.from_array(rng.standard_normal((channels, channels, 3)).astype(np.float32) * 0.2, f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32) * 0.1, f"b{i}")]
        nodes += [helper.make_node("Slice", [x, f"tail_start{i}", f"tail_end{i}", f"axis{i}"], [f"tail{i}"]),
                  helper.make_node("Slice", [x, f"head_start{i}", f"head_end{i}", f"axis{i}"], [f"head{i}"]),
                  helper.make_node("Concat", [f"tail{i}", x, f"head{i}"], [f"padded{i}"], axis=2),
                  helper.make_node("Conv", [f"padded{i}", f"w{i}", f"b{i}"], [f"conv{i}"], dilations=[dilation]),
                  helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
                  helper.make_node("Add", [f"relu{i}", x], [f"res{i}"])]
        x = f"res{i}"
    inits.append(numpy_helper.from_array(rng.standard_normal((channels, 2, 4)).astype(np.float32) * 0.2, "head_w"))
    nodes.append(helper.make_node("ConvTranspose", [x, "head_w"], ["y"], strides=[2], pads=[1, 1]))
    graph = helper.make_graph(nodes, "dilated_circular", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2 * width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("width", [17, 64])
def test_dilated_circular_stack_runs_in_rows_and_matches_onnxruntime(tmp_path, width):
    """The slices, concats and residuals follow the convs into the one-row layout: every conv
    gets its epilogue, the head is a transposed conv2d kernel, and no generic rule takes a conv."""
    model = _dilated_circular_stack(width)
    path = tmp_path / "dilated_circular.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    canonical = fusion_pipeline(prepared.config, PatternReport(), phases=("canonicalize",))(prepared.relax_module)
    # The input as a row twice (the first pad and the first residual read it) and the output's
    # squeeze: none between the layers.
    assert view_count(canonical["main"]) == 3
    optimized = api.optimize(prepared)
    assert optimized.report.fired["conv_epilogue"] == 4
    conv_rules = {k: v for k, v in optimized.schedule_rules.items() if "conv" in k}
    assert "Conv2dTranspose" in conv_rules.values(), conv_rules
    assert not {"Fallback", "Reduction"} & set(conv_rules.values()), conv_rules
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 8, width)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)
