"""The bf16 kernels emulated in ONNX Runtime (tvm_fusion/accuracy/bf16_emulation.py): the
switches round exactly the operands of their products, as bf16 to nearest does; each ONNX
product's weight is read whatever made it; and a kernel's weight, laid out, padded or scaled
as the pipeline leaves it, is matched to the products it computes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.accuracy.bf16_emulation import (Bf16Emulation, column_keys, emulation_model, match_products,
                                                product_weights)

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((16, 8)).astype(np.float32)  # first: x @ W1
W2 = RNG.standard_normal((4, 8, 3, 3)).astype(np.float32)  # a conv of 8 -> 4 channels
W3 = RNG.standard_normal((6, 72)).astype(np.float32)  # a Gemm's B, [N, K] read transposed (transB=1)


def two_products(opset: int = 11) -> onnx.ModelProto:
    """x [1, 8, 5, 16] @ W1 -> [1, 8, 5, 8], a conv of it -> [1, 4, 3, 6], flattened and by a
    Gemm with transB -> [1, 6]: three products, W3 reached through a Transpose node."""
    inits = [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(W2, "w2"),
             numpy_helper.from_array(W3.T.copy(), "w3_t"), numpy_helper.from_array(np.array([1, -1], np.int64), "flat")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"], name="matmul"),
             helper.make_node("Conv", ["m", "w2"], ["c"], name="conv"),
             helper.make_node("Reshape", ["c", "flat"], ["f"]),
             helper.make_node("Transpose", ["w3_t"], ["w3"], perm=[1, 0]),
             helper.make_node("Gemm", ["f", "w3"], ["y"], name="gemm", transB=1)]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 5, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def bf16(value: np.ndarray) -> np.ndarray:
    return value.astype(ml_dtypes.bfloat16).astype(np.float32)


def numpy_forward(x: np.ndarray, rounded: set[str]) -> np.ndarray:
    """The model in float64 with the operands of the products in ``rounded`` rounded to bf16."""
    def r(name, value):
        return bf16(value) if name in rounded else value
    m = r("matmul", x).astype(np.float64) @ r("matmul", W1)
    m = m.astype(np.float32)
    windows = np.lib.stride_tricks.sliding_window_view(r("conv", m), (3, 3), axis=(2, 3))  # [1, 8, 3, 6, 3, 3]
    c = np.einsum("nchwij,ocij->nohw", windows.astype(np.float64), r("conv", W2)).astype(np.float32)
    return (r("gemm", c.reshape(1, -1)).astype(np.float64) @ r("gemm", W3).T).astype(np.float32)


@pytest.mark.parametrize("opset", [11, 17])  # 11: no Cast to bf16; the rounding needs none
def test_each_switch_rounds_its_products_operands_and_nothing_else(opset):
    x = RNG.standard_normal((1, 8, 5, 16)).astype(np.float32)
    emulation = Bf16Emulation(two_products(opset), [[0], [1], [4]], {"x": x})
    for on, rounded in [((), set()), ((1,), {"conv"}), ((0, 2), {"matmul", "gemm"}), ((0, 1, 2), {"matmul", "conv", "gemm"})]:
        np.testing.assert_allclose(emulation.run(set(on))["y"], numpy_forward(x, rounded), rtol=2e-5, atol=2e-5)
    # the rounding is what bf16 keeps: off by far more than float32's sums when on
    assert np.abs(emulation.run({0})["y"] - emulation.run(set())["y"]).max() > 1e-3


def test_a_node_in_two_groups_is_rounded_when_either_is_on():
    x = RNG.standard_normal((1, 8, 5, 16)).astype(np.float32)
    emulation = Bf16Emulation(two_products(), [[0, 1], [1]], {"x": x})
    conv_only = numpy_forward(x, {"conv"})
    np.testing.assert_allclose(emulation.run({1})["y"], conv_only, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(emulation.run({0})["y"], numpy_forward(x, {"matmul", "conv"}), rtol=2e-5, atol=2e-5)


def test_the_rounding_is_bf16s_nearest():
    """Veltkamp's split in float32 equals bf16's round-to-nearest-even on values that are not ties."""
    values = (RNG.standard_normal(100_000) * np.exp(RNG.standard_normal(100_000) * 8)).astype(np.float32)
    bits = values.view(np.uint32)
    not_tie = (bits & 0xFFFF) != 0x8000
    identity = np.eye(1, dtype=np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["v", "one"], ["out"])], "round",
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, [values.size, 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [values.size, 1])],
        [numpy_helper.from_array(identity, "one")]), opset_imports=[helper.make_opsetid("", 13)])
    rounded = Bf16Emulation(model, [[0]], {"v": values[:, None]}).run({0})["out"][:, 0]
    np.testing.assert_array_equal(rounded[not_tie], bf16(values)[not_tie])


def test_a_non_product_node_is_refused():
    with pytest.raises(ValueError, match="is a Reshape, not one of Conv, MatMul, Gemm"):
        emulation_model(two_products(), [[2]])


def test_product_weights_read_each_weight_as_its_k_by_n_matrix():
    weights = product_weights(two_products(), {"x": np.zeros((1, 8, 5, 16), np.float32)})
    assert sorted(weights) == [0, 1, 4]
    np.testing.assert_array_equal(weights[0], W1)
    np.testing.assert_array_equal(weights[1], W2.reshape(4, -1).T)  # [C x KH x KW, Co]
    np.testing.assert_array_equal(weights[4], W3.T)  # through the Transpose node, then transB


def test_column_keys_hold_through_layout_padding_and_scaling():
    matrix = RNG.standard_normal((72, 4))
    keys = column_keys(matrix)
    permuted = matrix[RNG.permutation(72)]
    padded = np.concatenate([permuted, np.zeros((8, 4))])
    scaled = padded * np.array([0.5, -3.0, 7.25, 1e-3])  # a folded BatchNorm, a negative scale too
    assert column_keys(scaled) == keys
    assert len(set(keys)) == 4  # the columns tell apart


def test_kernels_are_matched_to_the_products_they_compute():
    products = product_weights(two_products(), {"x": np.zeros((1, 8, 5, 16), np.float32)})
    blocked = W2.reshape(4, 8, 3, 3).transpose(2, 3, 1, 0).reshape(-1, 4) * np.float32(-2.0)  # (kh, kw, c) rows, scaled
    # the columns of two products side by side (a merged QKV), the shorter padded with zero rows
    merged = np.concatenate([np.pad(W1, ((0, 56), (0, 0))), W2.reshape(4, -1).T], axis=1)
    other = RNG.standard_normal((16, 8)).astype(np.float32)
    matched = match_products({"conv_kernel": [blocked], "matmul_kernel": [W1, W1 * 2], "wide": [merged],
                              "unrelated": [other]}, products)
    assert matched == {"conv_kernel": [1], "matmul_kernel": [0], "wide": [0, 1]}
