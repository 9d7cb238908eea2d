"""PRelu (``nn.prelu`` and the importer's ``where`` form) -> ``max(x, 0) + min(x, 0) * slope``, and
the conv and matmul epilogues that then take it, in NCHW, in the blocked layout and channels-last."""

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import CONV_PATTERNS, compile_and_compare, make_model, random_weights, relax_ops
from rewrite_helpers import apply_rule

# The canonical form equals PRelu bit for bit; the convs' and matmuls' summation order differs
# between the engines.
RTOL = ATOL = 1e-4
SLOPE = np.array([0.1, 0.2, 0.3], np.float32)
PATTERNS = ["prelu", *CONV_PATTERNS, "gemm_epilogue"]


def test_per_channel_prelu_becomes_max_min_with_the_slope_along_its_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4, 5), "float32")):
            with R.dataflow():
                gv = R.nn.prelu(x, R.const(SLOPE), axis=1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 4, 5), "float32")):
            with R.dataflow():
                positive = R.maximum(x, R.const(0, "float32"))
                negative = R.minimum(x, R.const(0, "float32"))
                gv = R.add(positive, R.multiply(negative, R.const(SLOPE.reshape(1, 3, 1, 1))))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "prelu")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["prelu"] == 1


def test_the_importers_where_form_becomes_the_same_canonical_form():
    """A slope per pixel and channel (Keras' default PReLU), which TVM imports as ``where``."""
    slope = np.arange(15, dtype=np.float32).reshape(3, 5) / 20

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 5), "float32")):
            with R.dataflow():
                negative = R.less(x, R.const(0, "float32"))
                gv = R.where(negative, R.multiply(x, R.const(slope)), x)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 5), "float32")):
            with R.dataflow():
                positive = R.maximum(x, R.const(0, "float32"))
                negative = R.minimum(x, R.const(0, "float32"))
                gv = R.add(positive, R.multiply(negative, R.const(slope)))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "prelu")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["prelu"] == 1


def test_must_not_rewrite_a_slope_computed_at_run_time():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32"), slope: R.Tensor((3,), "float32")):
            with R.dataflow():
                gv = R.nn.prelu(x, slope, axis=1)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "prelu")
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired


def test_must_not_rewrite_a_where_that_compares_with_another_threshold():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                below = R.less(x, R.const(1, "float32"))
                gv = R.where(below, R.multiply(x, R.const(SLOPE)), x)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "prelu")
    tvm.ir.assert_structural_equal(after, Before)
    assert any(m.pattern == "prelu" and "not 0" in m.reason for m in report.near_misses)


@pytest.mark.parametrize("phases", [("canonicalize", "fuse", "lower", "schedule"),
                                    ("canonicalize", "layout", "fuse", "lower", "schedule")],
                         ids=["nchw", "blocked"])
def test_conv_prelu_and_dense_prelu_fuse_and_match_onnxruntime(phases):
    """Conv -> PRelu (per-channel slope) twice, then a dense layer -> PRelu: three kernels, with
    no PRelu left outside them."""
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w1=(16, 4, 3, 3), b1=(16,), w2=(16, 16, 3, 3), b2=(16,), wd=(16 * 8 * 8, 10), bd=(10,))
    weights.update(s1=rng.uniform(0, 0.5, (16, 1, 1)), s2=rng.uniform(0, 0.5, (16, 1, 1)), sd=rng.uniform(0, 0.5, 10))
    node = helper.make_node
    nodes = [node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), node("PRelu", ["c1", "s1"], ["p1"]),
             node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), node("PRelu", ["c2", "s2"], ["p2"]),
             node("Flatten", ["p2"], ["f"]), node("MatMul", ["f", "wd"], ["d"]),
             node("Add", ["d", "bd"], ["db"]), node("PRelu", ["db", "sd"], ["y"])]
    model = make_model(nodes, {"x": (1, 4, 8, 8)}, "y", weights, output_shape=[1, 10])
    report, module = compile_and_compare(model, patterns=PATTERNS, phases=phases, rtol=RTOL, atol=ATOL)
    assert report.fired["prelu"] == 3
    assert report.variants["conv_epilogue.conv_bias_prelu"] == 2
    assert report.variants["gemm_epilogue.matmul_bias_prelu"] == 1
    assert not {"relax.maximum", "relax.minimum", "relax.nn.prelu", "relax.where"} & set(relax_ops(module))


def test_channels_last_convs_with_a_keras_slope_per_pixel_fuse_and_match_onnxruntime():
    """keras2onnx's NHWC layers: Transpose -> Conv -> Transpose -> PRelu with an [H, W, C] slope,
    twice. The transposes between the layers cancel across the canonical form, and the first
    conv takes the PRelu."""
    rng = np.random.default_rng(1)
    weights = random_weights(rng, w1=(8, 3, 3, 3), b1=(8,), w2=(4, 8, 3, 3), b2=(4,))
    weights["slope"] = rng.uniform(0, 0.5, (6, 6, 8))
    node = helper.make_node
    nodes = [node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]),
             node("Conv", ["x_nchw", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             node("Transpose", ["c1"], ["c1_nhwc"], perm=[0, 2, 3, 1]), node("PRelu", ["c1_nhwc", "slope"], ["p1"]),
             node("Transpose", ["p1"], ["p1_nchw"], perm=[0, 3, 1, 2]),
             node("Conv", ["p1_nchw", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             node("Transpose", ["c2"], ["y"], perm=[0, 2, 3, 1])]
    model = make_model(nodes, {"x": (1, 6, 6, 3)}, "y", weights, output_shape=[1, 6, 6, 4])
    report, module = compile_and_compare(model, patterns=PATTERNS, rtol=RTOL, atol=ATOL)
    assert report.fired["prelu"] == 1
    assert report.variants["conv_epilogue.conv_bias_prelu"] == 1
    assert len(relax_ops(module)) == 4  # the input's transpose, the two convs, the output's transpose
