"""Conv + inference BatchNormalization folded into the conv's weights and bias."""

import numpy as np
import tvm
from onnx import helper
from tvm import relax

from cnn_helpers import batch_norm_params, compile_and_compare, make_model, random_weights, relax_ops
from rewrite_helpers import apply_rule


def conv_bn_model(with_bias: bool, groups: int = 1):
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w=(8, 8 // groups, 3, 3), b=(8,))
    weights.update(batch_norm_params(rng, "bn", 8))
    conv_inputs = ["x", "w"] + (["b"] if with_bias else [])
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1], strides=[2, 2], group=groups),
             helper.make_node("BatchNormalization", ["c", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], ["y"],
                              epsilon=1e-3)]
    if not with_bias:
        weights.pop("b")
    return make_model(nodes, {"x": (1, 8, 12, 12)}, "y", weights)


def test_conv_bn_folds_to_conv_plus_bias_exactly():
    # Tolerance: folding reorders one multiply (W*s instead of (x*W)*s): float32 rounding only.
    report, module = compile_and_compare(conv_bn_model(with_bias=False), patterns=["conv_bn_fold"],
                                         phases=("canonicalize",), rtol=1e-5, atol=1e-5)
    assert report.fired["conv_bn_fold"] == 1
    assert "relax.nn.batch_norm" not in relax_ops(module)
    assert relax_ops(module).count("relax.nn.conv2d") == 1


def test_conv_with_bias_and_groups_folds_and_fuses_into_one_kernel():
    report, module = compile_and_compare(conv_bn_model(with_bias=True, groups=2), rtol=1e-5, atol=1e-5)
    assert report.fired["conv_bn_fold"] == 1
    assert report.variants["conv_epilogue.conv_bias"] == 1


def _conv_bn_module(training: bool):
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    const = lambda *shape: relax.const(rng.standard_normal(shape).astype("float32"))  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, const(4, 4, 1, 1)))
            bn = bb.emit(relax.op.nn.batch_norm(conv, const(4), const(4), const(4), relax.const(np.ones(4, "float32")),
                                                axis=1, training=training))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    return bb.get()


def test_must_not_fold_training_mode_batch_norm():
    before = _conv_bn_module(training=True)
    after, report = apply_rule(before.clone(), "conv_bn_fold")
    tvm.ir.assert_structural_equal(after, relax.transform.DeadCodeElimination()(before))
    assert not report.fired
    assert any("training mode" in miss.reason for miss in report.near_misses)


def test_inference_batch_norm_folds_in_relax():
    after, report = apply_rule(_conv_bn_module(training=False), "conv_bn_fold")
    assert report.fired["conv_bn_fold"] == 1
    assert relax_ops(after) == ["relax.nn.conv2d", "relax.add"]


# Symbolic image sizes ---------------------------------------------------------------------

def _bn_params(rng, channels):
    return {"gamma": rng.uniform(0.5, 1.5, channels).astype("float32"),
            "beta": rng.standard_normal(channels).astype("float32"),
            "mean": rng.standard_normal(channels).astype("float32"),
            "var": rng.uniform(0.5, 1.5, channels).astype("float32")}


def test_symbolic_height_and_width_fold_fuse_and_match_at_every_size():
    from symbolic_helpers import HEIGHT, WIDTH, pipeline_and_compare, symbolic_module
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 4, 3, 3)).astype("float32"), **_bn_params(rng, 8)}

    def block(x, w, gamma, beta, mean, var):
        bn = relax.op.nn.batch_norm(relax.op.nn.conv2d(x, w, strides=2, padding=1), gamma, beta, mean, var,
                                    axis=1, epsilon=1e-3, training=False)
        return relax.op.nn.relu(relax.TupleGetItem(bn, 0))

    mod = symbolic_module(block, {"x": (1, 4, HEIGHT, WIDTH)}, weights)
    report, log = pipeline_and_compare(mod, [(1, 1), (3, 17), (40, 9)])
    assert report.fired["conv_bn_fold"] == 1
    assert report.variants["conv_epilogue.conv_bias_relu"] == 1
    assert list(log.values()) == ["Conv2dNCHW"]


def test_must_not_fold_training_mode_batch_norm_on_a_symbolic_map():
    from symbolic_helpers import HEIGHT, WIDTH, symbolic_module
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 4, 3, 3)).astype("float32"), **_bn_params(rng, 8)}

    def block(x, w, gamma, beta, mean, var):
        return relax.TupleGetItem(relax.op.nn.batch_norm(relax.op.nn.conv2d(x, w, padding=1), gamma, beta,
                                                         mean, var, axis=1, training=True), 0)

    after, report = apply_rule(symbolic_module(block, {"x": (1, 4, HEIGHT, WIDTH)}, weights), "conv_bn_fold")
    assert "relax.nn.batch_norm" in relax_ops(after)
    assert not report.fired
    assert any("training mode" in miss.reason for miss in report.near_misses)
