"""Conv [+ bias] * per-channel scale [+ shift] folds into the conv (patterns/conv_affine_fold.py)."""

import numpy as np
import pytest
import tvm
from machine import host_target
from tvm import relax

from rewrite_helpers import apply_rule
from tvm_fusion.config import parse_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport

RNG = np.random.default_rng(0)


def conv_affine_module(scale_shape=(1, 4, 1, 1), bias=True, shift=True, groups=1, whole_weights=False):
    """x -> conv [+ b] -> * s [+ o] -> relu: a BatchNormalization written out (captcha CRNN);
    ``whole_weights``: the conv's weights are whole numbers, as a quantized conv's are."""
    x = relax.Var("x", relax.TensorType((1, 4, 6, 5), "float32"))
    const = lambda shape: relax.const(RNG.standard_normal(shape).astype("float32"))  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            weight = RNG.integers(-128, 128, (4, 4 // groups, 3, 3)).astype("float32") if whole_weights else None
            y = bb.emit(relax.op.nn.conv2d(x, const((4, 4 // groups, 3, 3)) if weight is None else relax.const(weight),
                                           padding=1, groups=groups))
            if bias:
                y = bb.emit(relax.op.add(y, const((1, 4, 1, 1))))
            y = bb.emit(relax.op.multiply(y, const(scale_shape)))
            if shift:
                y = bb.emit(relax.op.add(const((4, 1, 1)), y))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


def ops(mod):
    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings]


def run(mod, data):
    vm = relax.VirtualMachine(tvm.compile(relax.get_pipeline("zero")(mod), target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(data)).numpy()


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"shift": False},
                                    {"scale_shape": (4, 1, 1), "groups": 4}])
def test_scale_and_shift_fold_into_the_conv_and_the_numbers_stay(kwargs):
    before = conv_affine_module(**kwargs)
    after, report = apply_rule(before, "conv_affine_fold")
    assert report.fired["conv_affine_fold"] == 1
    assert ops(after) == ["relax.nn.conv2d", "relax.add", "relax.nn.relu"]
    data = RNG.standard_normal((1, 4, 6, 5)).astype("float32")
    np.testing.assert_allclose(run(after, data), run(before, data), rtol=1e-5, atol=1e-5)


def test_must_not_fold_a_scalar_scale_which_may_be_a_hard_gates_slope():
    before = conv_affine_module(scale_shape=(1,))
    after, report = apply_rule(before, "conv_affine_fold")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == ["the scale is one scalar, not one value per channel"]


def test_must_not_fold_into_whole_number_weights_whose_scaled_sum_a_requantization_rounds():
    """A QLinearConv (frontend/qoperator.py) is a float conv of whole numbers, exact, times its
    requantization scale, then rounded: folded, the products would round first."""
    before = conv_affine_module(shift=False, whole_weights=True)
    after, report = apply_rule(before, "conv_affine_fold")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the weights are whole numbers (a quantized conv's exact sum, then requantized)"]


def test_must_not_fold_a_scale_that_varies_over_the_map():
    before = conv_affine_module(scale_shape=(1, 4, 6, 5))
    after, report = apply_rule(before, "conv_affine_fold")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == ["the scale has shape (1, 4, 6, 5), not one value per channel"]


def test_the_folded_conv_is_one_epilogue_kernel_with_its_activation():
    config = parse_config({"target": host_target(), "pipeline": {"patterns": ["conv_affine_fold", "conv_epilogue"]}},
                          name="test")
    report = PatternReport()
    fusion_pipeline(config, report, phases=("canonicalize", "fuse"))(conv_affine_module())
    assert report.variants["conv_epilogue.conv_bias_relu"] == 1


# Symbolic image sizes ---------------------------------------------------------------------

def _symbolic_affine(scale_shape):
    from symbolic_helpers import HEIGHT, WIDTH, symbolic_module
    weights = {"w": RNG.standard_normal((8, 4, 3, 3)).astype("float32"),
               "b": RNG.standard_normal((1, 8, 1, 1)).astype("float32"),
               "s": RNG.standard_normal(scale_shape).astype("float32"),
               "o": RNG.standard_normal((8, 1, 1)).astype("float32")}

    def block(x, w, b, s, o):
        biased = relax.op.add(relax.op.nn.conv2d(x, w, padding=1), b)
        return relax.op.nn.relu(relax.op.add(relax.op.multiply(biased, s), o))

    return symbolic_module(block, {"x": (1, 4, HEIGHT, WIDTH)}, weights)


def test_symbolic_height_and_width_fold_fuse_and_match_at_every_size():
    from symbolic_helpers import pipeline_and_compare
    report, log = pipeline_and_compare(_symbolic_affine((1, 8, 1, 1)), [(1, 1), (3, 17), (40, 9)])
    assert report.fired["conv_affine_fold"] == 1
    assert report.variants["conv_epilogue.conv_bias_relu"] == 1
    assert list(log.values()) == ["Conv2dNCHW"]


def test_must_not_fold_a_scalar_scale_on_a_symbolic_map():
    after, report = apply_rule(_symbolic_affine((1,)), "conv_affine_fold")
    assert "relax.multiply" in ops(after)
    assert any("one scalar" in miss.reason for miss in report.near_misses)
