"""HardSigmoid in exporter spellings -> the importer's form, fused into the conv."""

import numpy as np
import pytest
from onnx import helper

from cnn_helpers import compile_and_compare, make_model, random_weights

RTOL = ATOL = 1e-5  # clip(x/6+0.5, 0, 1) vs clip(x+3, 0, 6)/6: float32 rounding only


def conv_then(activation_nodes, constants):
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w=(8, 4, 1, 1), b=(8,))
    weights.update(constants)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), *activation_nodes]
    return make_model(nodes, {"x": (1, 4, 6, 6)}, "y", weights)


CONSTANTS = {"three": np.array(3.0), "zero": np.array(0.0), "six": np.array(6.0), "sixth": np.array(1 / 6)}


@pytest.mark.parametrize("scale_op, scale", [("Div", "six"), ("Mul", "sixth")])
def test_relu6_over_6_is_recognized_and_fused(scale_op, scale):
    nodes = [helper.make_node("Add", ["c", "three"], ["a"]),
             helper.make_node("Clip", ["a", "zero", "six"], ["r"]),
             helper.make_node(scale_op, ["r", scale], ["y"])]
    report, _ = compile_and_compare(conv_then(nodes, CONSTANTS), rtol=RTOL, atol=ATOL)
    assert report.fired["hardsigmoid"] == 1
    assert report.variants["conv_epilogue.conv_bias_hardsigmoid"] == 1


def test_onnx_hardsigmoid_op_fuses_with_its_own_alpha_beta():
    nodes = [helper.make_node("HardSigmoid", ["c"], ["y"], alpha=0.2, beta=0.4)]
    report, _ = compile_and_compare(conv_then(nodes, {}), rtol=RTOL, atol=ATOL)
    assert not report.fired["hardsigmoid"]  # already canonical
    assert report.variants["conv_epilogue.conv_bias_hardsigmoid"] == 1


def test_must_not_rewrite_a_wrong_shift():
    nodes = [helper.make_node("Add", ["c", "three"], ["a"]),
             helper.make_node("Clip", ["a", "zero", "six"], ["r"]),
             helper.make_node("Div", ["r", "six"], ["y"])]
    report, _ = compile_and_compare(conv_then(nodes, {**CONSTANTS, "three": np.array(2.0)}),
                                    phases=("canonicalize",), rtol=RTOL, atol=ATOL)
    assert not report.fired["hardsigmoid"]
    assert any(m.pattern == "hardsigmoid" and "not 3" in m.reason for m in report.near_misses)
