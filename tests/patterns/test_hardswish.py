"""HardSwish in every exporter spelling -> one canonical form that fuses into the conv."""

import numpy as np
import pytest
from onnx import helper

from cnn_helpers import compile_and_compare, make_model, random_weights, relax_ops

# Tolerance: x*clip(x/6+0.5, 0, 1) vs x*clip(x+3, 0, 6)/6 differ by float32 rounding only.
RTOL = ATOL = 1e-5


def conv_then(activation_nodes, constants):
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w=(8, 4, 3, 3), b=(8,))
    weights.update(constants)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), *activation_nodes]
    return make_model(nodes, {"x": (1, 4, 10, 10)}, "y", weights)


SPELLINGS = {
    "onnx_op": ([helper.make_node("HardSwish", ["c"], ["y"])], {}),
    "mul_then_div": ([helper.make_node("Add", ["c", "three"], ["a"]),
                      helper.make_node("Clip", ["a", "zero", "six"], ["r"]),
                      helper.make_node("Mul", ["c", "r"], ["m"]),
                      helper.make_node("Div", ["m", "six"], ["y"])],
                     {"three": np.array(3.0), "zero": np.array(0.0), "six": np.array(6.0)}),
    "times_one_sixth": ([helper.make_node("Add", ["three", "c"], ["a"]),
                         helper.make_node("Clip", ["a", "zero", "six"], ["r"]),
                         helper.make_node("Mul", ["r", "c"], ["m"]),
                         helper.make_node("Mul", ["m", "sixth"], ["y"])],
                        {"three": np.array(3.0), "zero": np.array(0.0), "six": np.array(6.0),
                         "sixth": np.array(1.0 / 6.0)}),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_becomes_one_fused_conv_kernel(spelling):
    report, module = compile_and_compare(conv_then(*SPELLINGS[spelling]), rtol=RTOL, atol=ATOL)
    assert report.fired["hardswish"] == 1
    assert report.variants["conv_epilogue.conv_bias_hardswish"] == 1
    assert [op for op in relax_ops(module) if op != "relax.call_tir"] == []


def test_must_not_rewrite_a_different_clip_bound():
    nodes, constants = SPELLINGS["mul_then_div"]
    model = conv_then(nodes, {**constants, "six": np.array(5.0)})
    report, _ = compile_and_compare(model, phases=("canonicalize",), rtol=RTOL, atol=ATOL)
    assert not report.fired["hardswish"]
    assert any(m.pattern == "hardswish" and "clip bounds" in m.reason for m in report.near_misses)
