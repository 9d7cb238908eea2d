"""Dynamically quantized ops (frontend/quantized.py, DynamicQuantizeLSTM in recurrent.py) against
ONNX Runtime in its exact-integer mode (tvm_fusion.verify.reference_outputs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from helpers import run_imported
from tvm_fusion.config import load_config
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.kernels.cpu_features import has_vnni
from tvm_fusion.verify import reference_outputs

SEQ, INPUT, HIDDEN = 5, 4, 6


def finish(graph: onnx.GraphProto, opset: int = 13, microsoft: bool = False) -> onnx.ModelProto:
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if microsoft else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model


def quantized(model: onnx.ModelProto, tmp_path, **options) -> onnx.ModelProto:
    """``quantize_dynamic``'s rewrite of a float model, as users produce int8 models."""
    onnx.save(model, tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "int8.onnx", **options)
    return onnx.load(tmp_path / "int8.onnx")


def conv_model(group: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = rng.uniform(-0.5, 0.5, (8, 6 // group, 3, 3)).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, 8).astype(np.float32)
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], name="conv", pads=[1, 1, 1, 1], strides=[2, 1], group=group)
    return finish(helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 9, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "B")]))


def lstm_model(direction: str = "bidirectional", initial: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    dirs = 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.uniform(-0.6, 0.6, (dirs, 4 * HIDDEN, INPUT)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.uniform(-0.6, 0.6, (dirs, 4 * HIDDEN, HIDDEN)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 8 * HIDDEN)).astype(np.float32), "B")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SEQ, 1, INPUT])]
    names = ["x", "W", "R", "B"]
    if initial:
        names += ["", "h0", "c0"]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [dirs, 1, HIDDEN]) for n in ("h0", "c0")]
    node = helper.make_node("LSTM", names, ["Y", "Y_h", "Y_c"], name="lstm", hidden_size=HIDDEN, direction=direction)
    return finish(helper.make_graph([node], "lstm", inputs,
                                    [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "Y_h", "Y_c")],
                                    inits), opset=14)


def random_feeds(model: onnx.ModelProto, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
            for v in model.graph.input}


def assert_matches_exact_onnxruntime(model: onnx.ModelProto, feeds: dict, atol: float = 1e-5) -> None:
    expected = reference_outputs(model, feeds)
    got = run_imported(model, feeds)
    assert len(got) == len(expected)
    for ours, (name, theirs) in zip(got, expected.items()):
        assert ours.shape == theirs.shape, name
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("group, weight_type", [(1, QuantType.QUInt8), (2, QuantType.QInt8)])
def test_quantized_conv_matches_onnxruntime(group, weight_type, tmp_path):
    """DynamicQuantizeLinear + ConvInteger (uint8 or int8 weights, grouped, strided) + rescale."""
    model = quantized(conv_model(group), tmp_path, weight_type=weight_type)
    assert "ConvInteger" in {n.op_type for n in model.graph.node}
    assert_matches_exact_onnxruntime(model, random_feeds(model))


def test_conv_integer_is_exact_with_both_zero_points_and_per_channel_weights():
    """ConvInteger's int32 output is the integer convolution, exactly: a uint8 input with a zero
    point, int8 weights minus one zero point per output channel (ONNX Runtime refuses those:
    the reference is numpy's int64 arithmetic)."""
    rng = np.random.default_rng(3)
    weights = rng.integers(-128, 128, (4, 3, 3, 3), dtype=np.int8)
    weight_zero_points = np.array([0, 3, -5, 7], np.int8)
    node = helper.make_node("ConvInteger", ["x", "W", "x_zp", "W_zp"], ["y"], name="conv_integer", pads=[0, 1, 0, 1])
    model = finish(helper.make_graph(
        [node], "conv_integer", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(np.array(131, np.uint8), "x_zp"),
         numpy_helper.from_array(weight_zero_points, "W_zp")]), opset=10)
    x = rng.integers(0, 256, (1, 3, 6, 5), dtype=np.uint8)
    (got,) = run_imported(model, {"x": x})
    padded = np.pad(x.astype(np.int64) - 131, ((0, 0), (0, 0), (0, 0), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # [1, 3, 4, 5, 3, 3]
    centered = weights.astype(np.int64) - weight_zero_points.astype(np.int64)[:, None, None, None]
    expected = np.einsum("nchwij,ocij->nohw", windows, centered)
    assert got.dtype == np.int32 and np.array_equal(got, expected)


def test_matmul_integer_is_exact_with_zero_points_per_tensor_and_per_column():
    """A uint8 A with a one-element zero point, an int8 B with one zero point per column."""
    rng = np.random.default_rng(4)
    weights = rng.integers(-128, 128, (6, 5), dtype=np.int8)
    column_zero_points = rng.integers(-8, 8, 5, dtype=np.int8)
    node = helper.make_node("MatMulInteger", ["a", "B", "a_zp", "B_zp"], ["y"], name="matmul_integer")
    model = finish(helper.make_graph(
        [node], "matmul_integer", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 3, 6])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(np.array([200], np.uint8), "a_zp"),
         numpy_helper.from_array(column_zero_points, "B_zp")]), opset=10)
    a = rng.integers(0, 256, (2, 3, 6), dtype=np.uint8)
    (got,) = run_imported(model, {"a": a})
    expected = (a.astype(np.int64) - 200) @ (weights.astype(np.int64) - column_zero_points.astype(np.int64))
    assert got.dtype == np.int32 and np.array_equal(got, expected)


def test_dynamic_quantize_linear_of_zeros_is_zero_with_scale_one():
    """ONNX Runtime takes scale 1 for an all-zero tensor (TVM's converter divides by zero)."""
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero_point"], name="quantize")
    model = finish(helper.make_graph(
        [node], "quantize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, None),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("zero_point", TensorProto.UINT8, None)]), opset=11)
    for feeds in ({"x": np.zeros((2, 3), np.float32)}, random_feeds(model)):
        expected = reference_outputs(model, feeds)
        got = run_imported(model, feeds)
        for ours, theirs in zip(got, expected.values()):
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


@pytest.mark.parametrize("direction, initial, per_channel", [
    ("bidirectional", False, False), ("forward", True, True), ("reverse", False, True)])
def test_dynamic_quantize_lstm_matches_onnxruntime(direction, initial, per_channel, tmp_path):
    model = quantized(lstm_model(direction, initial), tmp_path, per_channel=per_channel)
    assert [n.op_type for n in model.graph.node] == ["DynamicQuantizeLSTM"]
    assert_matches_exact_onnxruntime(model, random_feeds(model))


def test_dynamic_quantize_lstm_with_computed_weights_is_refused_naming_the_node(tmp_path):
    model = quantized(lstm_model("forward"), tmp_path)
    weights = next(i for i in model.graph.initializer if i.name == model.graph.node[0].input[1])
    model.graph.initializer.remove(weights)  # now a graph input: known only at run time
    model.graph.input.append(helper.make_tensor_value_info(weights.name, weights.data_type, list(weights.dims)))
    specs = [onnx_frontend.TensorSpec("x", (SEQ, 1, INPUT), "float32"),
             onnx_frontend.TensorSpec(weights.name, tuple(weights.dims), "int8")]
    with pytest.raises(ModelError, match=r"DynamicQuantizeLSTM node 'lstm_quant'.*input weights is computed at run time"):
        onnx_frontend.import_model(model, specs)


def test_reference_products_are_exact_on_every_cpu():
    """uint8 x int8 terms that saturate int16 in pairs (ONNX Runtime's fast path on x86 without
    VNNI): the reference is the exact int32 product on any CPU."""
    a = np.full((1, 4), 255, np.uint8)
    b = np.full((4, 2), 127, np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="matmul_integer")
    model = finish(helper.make_graph(
        [node], "matmul_integer", [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [numpy_helper.from_array(b, "b")]), opset=10)
    expected = a.astype(np.int32) @ b.astype(np.int32)
    assert np.array_equal(reference_outputs(model, {"a": a})["y"], expected)


def test_quantized_model_compiles_through_the_pipeline_and_verifies(tmp_path, config_path):
    """Conv + LSTM, quantize_dynamic'd, through the whole fused and scheduled pipeline."""
    from tvm_fusion.api import compile_model

    conv = conv_model()
    lstm = lstm_model("bidirectional")
    # The [1, 8, 5, 7] conv map as 5 steps of 56 features, projected to the LSTM's input size.
    rng = np.random.default_rng(1)
    nodes = list(conv.graph.node) + [
        helper.make_node("Transpose", ["y"], ["t"], perm=[2, 0, 1, 3]),
        helper.make_node("Reshape", ["t", "shape"], ["r"]),
        helper.make_node("MatMul", ["r", "P"], ["steps"], name="project"), *lstm.graph.node]
    nodes[-1].input[:4] = ["steps", "lstm_W", "lstm_R", "lstm_B"]
    for tensor in lstm.graph.initializer:
        tensor.name = f"lstm_{tensor.name}"
    inits = list(conv.graph.initializer) + list(lstm.graph.initializer) + [
        numpy_helper.from_array(np.array([SEQ, 1, 56], np.int64), "shape"),
        numpy_helper.from_array(rng.uniform(-0.3, 0.3, (56, INPUT)).astype(np.float32), "P")]
    model = finish(helper.make_graph(nodes, "conv_lstm", list(conv.graph.input), list(lstm.graph.output), inits), opset=14)
    path = tmp_path / "conv_lstm.int8.onnx"
    onnx.save(quantized(model, tmp_path), path)
    assert {"ConvInteger", "MatMulInteger", "DynamicQuantizeLSTM"} <= {n.op_type for n in onnx.load(path).graph.node}
    result = compile_model(path, config_path(), [], output_dir=tmp_path / "build")
    outputs = result.metadata["verification"]["outputs"]
    assert len(outputs) == 3 and all(o["within_tolerance"] for o in outputs)
    rules = result.metadata["schedule_rules"]
    assert [rule for kernel, rule in rules.items() if "conv2d" in kernel] == ["Conv2dNCHW"], rules
    # The LSTM's products (input projection, recurrent step): int8 kernels where the target has
    # VNNI (frontend/integer_matmul.py), float32 products of whole numbers elsewhere.
    products = ("Int8MatmulVnni", "Int8MatmulAmx") if has_vnni(load_config(config_path()).tvm_target()) \
        else ("MatmulEpilogue",)
    assert sum(rule in products for kernel, rule in rules.items() if "matmul" in kernel) >= 2, rules
