"""QOperator ops (frontend/qoperator.py) against ONNX Runtime, bit for bit on the quantized outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import run_imported
from tvm_fusion.verify import reference_outputs

MS = "com.microsoft"


def finish(nodes, inputs, outputs, initializers, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "q", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def tensor(name: str, dtype: np.dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def assert_equal_to_onnxruntime(model: onnx.ModelProto, feeds: dict) -> None:
    expected = reference_outputs(model, feeds)
    got = run_imported(model, feeds)
    for ours, (name, theirs) in zip(got, expected.items()):
        assert ours.dtype == theirs.dtype, name
        # Quantized outputs must be equal; a spread of values makes the check mean something.
        assert len(np.unique(theirs)) > 10, name
        np.testing.assert_array_equal(ours, theirs, err_msg=name)


def integers(rng, dtype, shape) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, shape, dtype=dtype)


@pytest.mark.parametrize("activation, weight, per_channel", [
    (np.uint8, np.int8, True), (np.uint8, np.uint8, False), (np.uint8, np.int8, False)])
def test_qlinear_matmul_equals_onnxruntime(activation, weight, per_channel):
    rng = np.random.default_rng(0)
    k, n = 96, 24
    b = integers(rng, weight, (k, n))
    b_scale = rng.uniform(0.002, 0.01, n if per_channel else ()).astype(np.float32)
    b_zp = np.zeros(n if per_channel else (), weight) if weight == np.int8 else np.array(121, weight)
    y_zp = np.array(7 if activation == np.int8 else 128, activation)
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="qmm")
    model = finish([node], [tensor("a", activation, [2, 5, k])], [tensor("y", activation, None)],
                   [const("sa", np.float32(0.0173)), const("za", np.array(3, activation)), const("b", b),
                    const("sb", b_scale), const("zb", b_zp), const("sy", np.float32(0.19)), const("zy", y_zp)])
    assert_equal_to_onnxruntime(model, {"a": integers(rng, activation, (2, 5, k))})


@pytest.mark.parametrize("per_channel, group", [(True, 1), (False, 2)])
def test_qlinear_conv_with_bias_equals_onnxruntime(per_channel, group):
    rng = np.random.default_rng(1)
    w = integers(rng, np.int8, (8, 6 // group, 3, 3))
    w_scale = rng.uniform(0.002, 0.02, 8 if per_channel else ()).astype(np.float32)
    node = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "bias"], ["y"],
                            name="qconv", pads=[1, 1, 1, 1], strides=[1, 2], group=group)
    model = finish([node], [tensor("x", np.uint8, [1, 6, 9, 7])], [tensor("y", np.uint8, None)],
                   [const("sx", np.float32(0.021)), const("zx", np.uint8(117)), const("w", w), const("sw", w_scale),
                    const("zw", np.zeros(w_scale.shape, np.int8)), const("sy", np.float32(0.23)),
                    const("zy", np.uint8(101)), const("bias", rng.integers(-3000, 3000, 8).astype(np.int32))])
    assert_equal_to_onnxruntime(model, {"x": integers(rng, np.uint8, (1, 6, 9, 7))})


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_binary_equals_onnxruntime(op, dtype):
    """Every pair of input values, with scales whose ratios make many near-ties."""
    values = np.arange(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1).astype(dtype)
    a, b = (v.reshape(1, -1) for v in np.meshgrid(values, values))
    zero = (lambda v: np.array(v, dtype))
    node = helper.make_node(op, ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"], name="q", domain=MS)
    model = finish([node], [tensor("a", dtype, list(a.shape)), tensor("b", dtype, list(b.shape))],
                   [tensor("c", dtype, None)],
                   [const("sa", np.float32(0.031)), const("za", zero(5)), const("sb", np.float32(0.047)),
                    const("zb", zero(-3 if dtype == np.int8 else 140)), const("sc", np.float32(0.06 if op == "QLinearAdd" else 2.1)),
                    const("zc", zero(2 if dtype == np.int8 else 128))])
    assert_equal_to_onnxruntime(model, {"a": a, "b": b})


@pytest.mark.parametrize("trans_b, with_output_scale", [(True, True), (False, True), (True, False)])
def test_qgemm_equals_onnxruntime(trans_b, with_output_scale):
    rng = np.random.default_rng(2)
    k, n = 40, 16
    b = integers(rng, np.int8, (n, k) if trans_b else (k, n))
    names = ["a", "sa", "za", "b", "sb", "zb", "bias"] + (["sy", "zy"] if with_output_scale else [])
    node = helper.make_node("QGemm", names, ["y"], name="qgemm", domain=MS, transB=int(trans_b), alpha=0.75)
    inits = [const("sa", np.float32(0.013)), const("za", np.uint8(120)), const("b", b),
             const("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), const("zb", np.zeros(n, np.int8))]
    inits += [const("bias", rng.integers(-2000, 2000, n).astype(np.int32))]
    if with_output_scale:
        inits += [const("sy", np.float32(0.07)), const("zy", np.uint8(130))]
    out = tensor("y", np.uint8 if with_output_scale else np.float32, None)
    model = finish([node], [tensor("a", np.uint8, [3, k])], [out], inits)
    feeds = {"a": integers(rng, np.uint8, (3, k))}
    if with_output_scale:
        assert_equal_to_onnxruntime(model, feeds)
    else:
        np.testing.assert_array_equal(run_imported(model, feeds)[0], reference_outputs(model, feeds)["y"])
