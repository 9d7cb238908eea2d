"""Conv epilogue fusion: conv2d + bias + activation + residual (+ activation) as one kernel."""

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import compile_and_compare, make_model, prim_func_names, random_weights
from helpers import EXAMPLES
from tvm_fusion.frontend.onnx import TensorSpec, import_model
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("conv_epilogue")], report)(mod), report


def test_conv_bias_relu_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((8, 4, 3, 3), "float32"),
                 b: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_nn_conv2d_relax_add_relax_nn_relu(
            x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((8, 4, 3, 3), "float32"),
            b: R.Tensor((1, 8, 1, 1), "float32")
        ) -> R.Tensor((1, 8, 8, 8), "float32"):
            R.func_attr({"Composite": "conv_epilogue.conv_bias_relu", "Primitive": True})
            with R.dataflow():
                lv = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((8, 4, 3, 3), "float32"),
                 b: R.Tensor((1, 8, 1, 1), "float32")) -> R.Tensor((1, 8, 8, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_nn_conv2d_relax_add_relax_nn_relu(x, w, b)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["conv_epilogue.conv_bias_relu"] == 1


def block_model(groups, strides, dilations, activation_nodes, residual):
    """x -> Conv(bias) -> activation [-> Add(x) -> Relu]: a ResNet/MobileNet block tail."""
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w=(8, 8 // groups, 3, 3), b=(8,))
    weights.update(lo=np.array(0.0), hi=np.array(6.0))  # Clip's bounds (unused ones are harmless)
    pad = dilations
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=groups, strides=[strides] * 2,
                              dilations=[dilations] * 2, pads=[pad] * 4), *activation_nodes]
    out = "a"
    if residual:
        nodes += [helper.make_node("Add", ["a", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
        out = "y"
    return make_model(nodes, {"x": (1, 8, 12, 12)}, out, weights)


ACTIVATIONS = {
    "relu": [helper.make_node("Relu", ["c"], ["a"])],
    "clip": [helper.make_node("Clip", ["c", "lo", "hi"], ["a"])],
    "leakyrelu": [helper.make_node("LeakyRelu", ["c"], ["a"], alpha=0.1)],
    "sigmoid": [helper.make_node("Sigmoid", ["c"], ["a"])],
    "silu": [helper.make_node("Sigmoid", ["c"], ["g"]), helper.make_node("Mul", ["c", "g"], ["a"])],
    "hardswish": [helper.make_node("HardSwish", ["c"], ["a"])],
    "hardsigmoid": [helper.make_node("HardSigmoid", ["c"], ["a"])],
}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_each_activation_fuses_into_one_kernel(activation):
    model = block_model(1, 1, 1, ACTIVATIONS[activation], residual=False)
    # Tolerance: fast-math sigmoid (~1e-6 rel) and reassociated hardswish; 1e-4 covers both.
    report, module = compile_and_compare(model)
    assert report.variants[f"conv_epilogue.conv_bias_{activation}"] == 1
    assert len(prim_func_names(module)) == 1


@pytest.mark.parametrize("groups, strides, dilations", [(8, 1, 1), (8, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_depthwise_grouped_strided_dilated_with_residual(groups, strides, dilations):
    model = block_model(groups, strides, dilations, ACTIVATIONS["hardswish"], residual=strides == 1)
    report, module = compile_and_compare(model)
    variant = "conv_bias_hardswish_residual_relu" if strides == 1 else "conv_bias_hardswish"
    assert report.variants[f"conv_epilogue.{variant}"] == 1
    assert len(prim_func_names(module)) == 1


def test_must_not_fuse_when_the_conv_output_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
                 b: R.Tensor((1, 4, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.nn.relu(lv1)
                gv = R.multiply(lv2, lv)  # the raw conv output has a second consumer
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
        def main(x: R.Tensor((1, 4, 8, 8), "float32"), w: R.Tensor((4, 4, 1, 1), "float32"),
                 b: R.Tensor((1, 1, 8, 8), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w)
                lv1 = R.add(lv, b)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any("bias shape (1, 1, 8, 8)" in m.reason for m in report.near_misses)


@pytest.mark.parametrize("model, batch_norms", [("resnet_tiny", 20), ("mobilenetv3_tiny", 25)])
def test_bundled_cnns_fold_every_batch_norm_and_fuse_every_conv_activation(model, batch_norms):
    from tvm_fusion.api import inspect_model

    report = inspect_model(EXAMPLES / f"{model}.onnx", input_shapes=["input:1x3x64x64"])
    assert report.report.fired["conv_bn_fold"] == batch_norms
    assert report.onnx_ops["Conv"] == report.report.fired["conv_epilogue"] + 2 * report.report.fired.get(
        "squeeze_excitation", 0)
    leftover = {op for op in report.fused_ops if op in ("nn.conv2d", "nn.batch_norm", "nn.relu")}
    assert not leftover


# Nearest as PyTorch exports it, and bilinear in two coordinate modes.
UPSAMPLE_MODES = {
    "nearest": {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    "bilinear_half_pixel": {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    "bilinear_align_corners": {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
}


def fpn_merge_model(resize_mode: dict, upsampled_also_output: bool = False):
    """Conv1x1(c4) + Resize(p5, 2x): an FPN top-down merge whose lateral is a conv."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["c4", "w"], ["lateral"]),
             helper.make_node("Resize", ["p5", "", "scales"], ["up"], **resize_mode),
             helper.make_node("Add", ["lateral", "up"], ["y"])]
    weights = {**random_weights(rng, w=(8, 16, 1, 1)), "scales": np.array([1, 1, 2, 2])}
    model = make_model(nodes, {"c4": (1, 16, 10, 14), "p5": (1, 8, 5, 7)}, "y", weights)
    if upsampled_also_output:
        model.graph.output.append(helper.make_tensor_value_info("up", 1, ["n", "c", "h", "w"]))
    return model


@pytest.mark.parametrize("mode", sorted(UPSAMPLE_MODES))
def test_fpn_merge_with_a_conv_lateral_is_one_kernel(mode):
    """Neither the lateral map nor the upsampled one is stored: the conv's epilogue reads the
    small top map (rtol/atol 1e-4 against ONNX Runtime and the unfused module)."""
    report, module = compile_and_compare(fpn_merge_model(UPSAMPLE_MODES[mode]),
                                         patterns=["conv_epilogue", "resize_merge"])
    assert report.variants["conv_epilogue.conv_upsampled_residual"] == 1
    assert len(prim_func_names(module)) == 1


def test_must_not_absorb_an_upsampled_map_that_is_also_an_output():
    model = fpn_merge_model(UPSAMPLE_MODES["nearest"], upsampled_also_output=True)
    mod = import_model(model, [TensorSpec("c4", (1, 16, 10, 14), "float32"),
                               TensorSpec("p5", (1, 8, 5, 7), "float32")])
    after, report = fuse(mod)
    assert report.variants["conv_epilogue.conv_upsampled_residual"] == 0
    assert report.variants["conv_epilogue.conv_residual"] == 1  # the stored map is a plain residual


# Symbolic image sizes ---------------------------------------------------------------------

def test_symbolic_height_and_width_fuse_and_match_at_every_size():
    from symbolic_helpers import HEIGHT, WIDTH, pipeline_and_compare, symbolic_module
    from tvm.relax.op import add as r_add, nn as r_nn
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 4, 3, 3)).astype("float32"),
               "b": rng.standard_normal((1, 8, 1, 1)).astype("float32")}
    mod = symbolic_module(lambda x, r, w, b: r_nn.relu(r_add(r_add(r_nn.conv2d(x, w, padding=1), b), r)),
                          {"x": (1, 4, HEIGHT, WIDTH), "r": (1, 8, HEIGHT, WIDTH)}, weights)
    report, log = pipeline_and_compare(mod, [(1, 1), (3, 17), (40, 9)])
    assert report.variants["conv_epilogue.conv_bias_residual_relu"] == 1
    assert list(log.values()) == ["Conv2dNCHW"]


def test_must_not_fuse_symbolic_channels():
    from tvm import relax, tirx
    channels = tirx.Var("channels", "int64")
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.Var("w", relax.TensorType((channels, 4, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
        bb.emit_func_output(out)
    after, report = fuse(relax.transform.ConvertToDataflow()(bb.get()))
    assert not report.fired
    assert any("channels" in miss.reason and "symbolic" in miss.reason for miss in report.near_misses)


def test_must_not_fuse_a_residual_of_another_symbolic_size():
    from symbolic_helpers import HEIGHT, WIDTH
    from tvm import relax, tirx
    other = tirx.Var("other", "int64")
    x = relax.Var("x", relax.TensorType((1, 4, HEIGHT, WIDTH), "float32"))
    r = relax.Var("r", relax.TensorType((1, 8, HEIGHT, other), "float32"))
    w = relax.Var("w", relax.TensorType((8, 4, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(relax.op.nn.conv2d(x, w, padding=1), r))
        bb.emit_func_output(out)
    after, report = fuse(bb.get())
    assert not report.fired
    assert report.near_misses  # declined (as a residual or as a bias), not fused
