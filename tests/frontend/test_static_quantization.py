"""frontend/static_quantization.py: calibration samples from a folder (or seeded random ones),
checked against the model's inputs with one clear message per mistake, and ONNX Runtime's
quantize_static applied to MatMul/Gemm/Conv by constant weights only, written whole or not at all."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion.errors import ModelError
from tvm_fusion.frontend.input_binding import TensorSpec
from tvm_fusion.frontend.static_quantization import calibration_samples, quantize_to_qdq

INPUTS = [TensorSpec("x", (2, 8), "float32")]


def mlp() -> onnx.ModelProto:
    """MatMul by a weight, LayerNormalization, a MatMul of two activations, Softmax."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W", (8, 8)), ("scale", (8,)), ("bias", (8,)))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["n"]),
             helper.make_node("Transpose", ["n"], ["t"]),
             helper.make_node("MatMul", ["n", "t"], ["s"]),
             helper.make_node("Softmax", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_random_samples_are_seeded():
    first, again = (calibration_samples(mlp(), INPUTS, None, seed=3, count=2) for _ in range(2))
    assert len(first) == 2 and first[0]["x"].shape == (2, 8)
    np.testing.assert_array_equal(first[1]["x"], again[1]["x"])
    assert not np.array_equal(first[0]["x"], first[1]["x"])


def test_samples_are_read_from_npz_and_npy(tmp_path):
    values = np.arange(16, dtype=np.float64).reshape(2, 8)
    np.savez(tmp_path / "a.npz", x=values)
    np.save(tmp_path / "b.npy", values + 1)
    (tmp_path / "notes.txt").write_text("ignored")
    samples = calibration_samples(mlp(), INPUTS, tmp_path, seed=0)
    assert len(samples) == 2 and samples[0]["x"].dtype == np.float32
    np.testing.assert_array_equal(samples[1]["x"], values + 1)


@pytest.mark.parametrize("files, message", [
    ({}, "holds no .npz or .npy file"),
    ({"a.npz": {"x": np.zeros((2, 7))}}, "has shape [2, 7], the model is compiled at [2, 8]"),
    ({"a.npz": {"x": np.zeros((2, 8)), "z": np.zeros(1)}}, "arrays ['z'] that are no inputs"),
    ({"a.npz": {"q": np.zeros((2, 8))}}, "arrays ['q'] that are no inputs"),
], ids=["empty", "wrong-shape", "unknown-array", "missing-input"])
def test_a_bad_sample_is_named(tmp_path, files, message):
    for name, arrays in files.items():
        np.savez(tmp_path / name, **arrays)
    with pytest.raises(ModelError) as raised:
        calibration_samples(mlp(), INPUTS, tmp_path, seed=0)
    assert message in raised.value.message
    assert raised.value.hint


def test_a_missing_folder_and_an_npy_for_two_inputs_are_refused(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        calibration_samples(mlp(), INPUTS, tmp_path / "nowhere", seed=0)
    np.save(tmp_path / "a.npy", np.zeros((2, 8)))
    two = INPUTS + [TensorSpec("w", (2, 8), "float32")]
    with pytest.raises(ModelError, match="one array, but the model has 2 float inputs"):
        calibration_samples(mlp(), two, tmp_path, seed=0)


def test_only_products_by_constant_weights_are_quantized(tmp_path, monkeypatch):
    working = tmp_path / "working"
    working.mkdir()
    monkeypatch.chdir(working)
    output = quantize_to_qdq(mlp(), tmp_path / "q.onnx", calibration_samples(mlp(), INPUTS, None, 0, count=4))
    assert list(working.iterdir()) == []  # nothing written where the user runs it
    model = onnx.load(str(output))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("DequantizeLinear") >= 2 and "QuantizeLinear" in ops  # the weighted MatMul's inputs
    quantized_inputs = {i for node in model.graph.node if node.op_type == "DequantizeLinear" for i in node.output}
    matmuls = [node for node in model.graph.node if node.op_type == "MatMul"]
    weighted = [m for m in matmuls if set(m.input) <= quantized_inputs]
    assert len(matmuls) == 2 and len(weighted) == 1  # the product of two activations stays float
    quantized = {node.input[0] for node in model.graph.node if node.op_type == "QuantizeLinear"}
    for node in model.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax"):  # float ops, their outputs not quantized
            assert not set(node.output) & quantized, node.op_type
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.onnx", "working"]  # no staging left behind


def test_a_failed_quantization_writes_nothing(tmp_path):
    bad = [{"x": np.zeros((3, 8), np.float32)}]  # a sample the model cannot run
    with pytest.raises(ModelError, match="quantize_static failed"):
        quantize_to_qdq(mlp(), tmp_path / "q.onnx", bad)
    assert list(Path(tmp_path).iterdir()) == []


def test_an_old_opset_model_is_lifted_for_per_channel_weights(tmp_path):
    """DequantizeLinear takes a per-channel ``axis`` from opset 13: a model at opset 11 (as
    paddle2onnx writes them) is lifted first, so the QDQ model passes onnx's checker."""
    weight = numpy_helper.from_array(np.random.default_rng(2).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    inputs = [TensorSpec("x", (1, 3, 8, 8), "float32")]
    output = quantize_to_qdq(model, tmp_path / "q.onnx", calibration_samples(model, inputs, None, 0, count=2))
    quantized = onnx.load(str(output))
    onnx.checker.check_model(quantized)
    assert max(o.version for o in quantized.opset_import if o.domain in ("", "ai.onnx")) >= 13
    axes = [a for n in quantized.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "axis"]
    assert axes  # the weight's scales are per output channel
