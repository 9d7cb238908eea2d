"""ConvTranspose epilogue fusion: conv2d_transpose + bias + activation (+ residual) as one kernel,
and BatchNormalization after a ConvTranspose folded into its weights first."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import helper
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import (CONV_PATTERNS, batch_norm_params, compile_and_compare, make_model,
                         prim_func_names, random_weights, relax_ops)
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern

PATTERNS = [*CONV_PATTERNS, "conv_transpose_epilogue"]
DBNET_HEAD = Path(__file__).parents[1] / "data" / "dbnet_head_block.onnx"


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("conv_transpose_epilogue")], report)(mod), report


def test_conv_transpose_bias_relu_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 8, 2, 2), "float32"),
                 b: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d_transpose(x, w, strides=[2, 2])
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_nn_conv2d_transpose_relax_add_relax_nn_relu(
            x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 8, 2, 2), "float32"),
            b: R.Tensor((1, 8, 1, 1), "float32")
        ) -> R.Tensor((1, 8, 16, 16), "float32"):
            R.func_attr({"Composite": "conv_transpose_epilogue.conv_transpose_bias_relu", "Primitive": True})
            with R.dataflow():
                lv = R.nn.conv2d_transpose(x, w, strides=[2, 2])
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 8, 2, 2), "float32"),
                 b: R.Tensor((1, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 16, 16), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_nn_conv2d_transpose_relax_add_relax_nn_relu(x, w, b)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["conv_transpose_epilogue.conv_transpose_bias_relu"] == 1


def test_must_not_fuse_when_the_conv_transpose_output_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 2, 2), "float32"),
                 b: R.Tensor((1, 4, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d_transpose(x, w, strides=[2, 2])
                lv1 = R.add(lv, b)
                lv2 = R.nn.relu(lv1)
                gv = R.multiply(lv2, lv)  # the raw output has a second consumer
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired
    assert any("used outside" in m.reason for m in report.near_misses)


def test_must_not_fuse_a_bias_that_is_not_per_channel():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 2, 2), "float32"),
                 b: R.Tensor((1, 1, 16, 16), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d_transpose(x, w, strides=[2, 2])
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any("bias shape (1, 1, 16, 16)" in m.reason for m in report.near_misses)


ACTIVATIONS = {
    "relu": [helper.make_node("Relu", ["c"], ["a"])],
    "sigmoid": [helper.make_node("Sigmoid", ["c"], ["a"])],
    "leakyrelu": [helper.make_node("LeakyRelu", ["c"], ["a"], alpha=0.1)],
    "hardswish": [helper.make_node("HardSwish", ["c"], ["a"])],
}


def conv_transpose_model(kernel, strides, pads, output_padding, groups, activation, batch_norm=False):
    """x (1x4x6x7) -> ConvTranspose(bias) [-> BatchNormalization] -> activation."""
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w=(4, 6 // groups, kernel, kernel), b=(6,))
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["t" if batch_norm else "c"],
                              group=groups, strides=[strides] * 2, pads=[pads] * 4,
                              output_padding=[output_padding] * 2)]
    if batch_norm:
        weights.update(batch_norm_params(rng, "bn", 6))
        nodes.append(helper.make_node("BatchNormalization", ["t", "bn_gamma", "bn_beta", "bn_mean", "bn_var"],
                                      ["c"], epsilon=1e-3))
    return make_model([*nodes, *ACTIVATIONS[activation]], {"x": (1, 4, 6, 7)}, "a", weights)


@pytest.mark.parametrize("kernel, strides, pads, output_padding, groups, activation", [
    (2, 2, 0, 0, 1, "relu"),       # decoder upsampling: the polyphase kernel
    (3, 1, 1, 0, 1, "sigmoid"),    # stride 1, padded
    (3, 2, 1, 1, 1, "leakyrelu"),  # stride 2 with output_padding
    (2, 2, 0, 0, 2, "hardswish"),  # grouped
    (4, 2, 1, 0, 2, "relu"),       # 4x4 stride 2 (GAN upsampler), grouped
])
def test_conv_transpose_epilogue_matches_onnxruntime_and_stock(kernel, strides, pads, output_padding,
                                                               groups, activation):
    model = conv_transpose_model(kernel, strides, pads, output_padding, groups, activation)
    report, module = compile_and_compare(model, patterns=PATTERNS)
    assert report.variants[f"conv_transpose_epilogue.conv_transpose_bias_{activation}"] == 1
    assert len(prim_func_names(module)) == 1


@pytest.mark.parametrize("groups", [1, 2])
def test_batch_norm_after_conv_transpose_folds_and_fuses(groups):
    model = conv_transpose_model(2, 2, 0, 0, groups, "relu", batch_norm=True)
    # Tolerance: folding reorders one multiply per weight; float32 rounding only.
    report, module = compile_and_compare(model, patterns=PATTERNS, rtol=1e-5, atol=1e-5)
    assert report.fired["conv_bn_fold"] == 1
    assert report.variants["conv_transpose_epilogue.conv_transpose_bias_relu"] == 1
    assert len(prim_func_names(module)) == 1


def test_batch_norm_fold_leaves_no_batch_norm_in_relax():
    model = conv_transpose_model(3, 2, 1, 1, 2, "sigmoid", batch_norm=True)
    report, module = compile_and_compare(model, patterns=["conv_bn_fold"], phases=("canonicalize",),
                                         rtol=1e-5, atol=1e-5)
    assert report.fired["conv_bn_fold"] == 1
    assert "relax.nn.batch_norm" not in relax_ops(module)
    assert relax_ops(module).count("relax.nn.conv2d_transpose") == 1


def test_exported_dbnet_head_fuses_every_conv_transpose_with_its_bn_and_activation():
    """scripts/export_test_blocks.py: torch's ConvTranspose2d -> BN -> ReLU -> ConvTranspose2d -> Sigmoid."""
    model = onnx.load(DBNET_HEAD)
    ops = [node.op_type for node in model.graph.node]
    report, module = compile_and_compare(model, patterns=PATTERNS)
    # torch's exporter folds the Conv's BN itself (eval peephole) but not the ConvTranspose's.
    assert report.fired["conv_bn_fold"] == ops.count("BatchNormalization") == 1
    assert report.variants["conv_transpose_epilogue.conv_transpose_bias_relu"] == 1
    assert report.variants["conv_transpose_epilogue.conv_transpose_bias_sigmoid"] == 1
    assert report.fired["conv_transpose_epilogue"] == ops.count("ConvTranspose") == 2
    assert report.variants["conv_epilogue.conv_bias_relu"] == 1
    assert len(prim_func_names(module)) == 3


# Symbolic image sizes ---------------------------------------------------------------------

def test_symbolic_height_and_width_fuse_and_match_at_every_size():
    from symbolic_helpers import HEIGHT, WIDTH, pipeline_and_compare, symbolic_module
    from tvm.relax.op import add as r_add, nn as r_nn
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 4, 2, 2)).astype("float32"),
               "b": rng.standard_normal((1, 4, 1, 1)).astype("float32")}
    mod = symbolic_module(lambda x, w, b: r_nn.relu(r_add(r_nn.conv2d_transpose(x, w, strides=2), b)),
                          {"x": (1, 8, HEIGHT, WIDTH)}, weights)
    report, log = pipeline_and_compare(mod, [(1, 1), (3, 17), (40, 9)])
    assert report.variants["conv_transpose_epilogue.conv_transpose_bias_relu"] == 1
    assert list(log.values()) == ["Conv2dTranspose"]


def test_must_not_fuse_symbolic_output_channels():
    from symbolic_helpers import HEIGHT, WIDTH
    from tvm import relax, tirx
    channels = tirx.Var("channels", "int64")
    x = relax.Var("x", relax.TensorType((1, 8, HEIGHT, WIDTH), "float32"))
    w = relax.Var("w", relax.TensorType((8, channels, 2, 2), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d_transpose(x, w, strides=2)))
        bb.emit_func_output(out)
    after, report = fuse(bb.get())
    assert not report.fired
    (miss,) = report.near_misses
    assert "symbolic dim channels at axis 1 (channels)" in miss.reason
