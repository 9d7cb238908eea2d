"""Our ONNX converters and the Dropout guard around onnxslim (see frontend/converters.py)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import helpers
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.dropout_guard import hide_dropouts, restore_dropouts


def training_dropout_model(training_is_input: bool = False) -> onnx.ModelProto:
    """x -> Relu -> Dropout(training_mode) -> Add(1): onnxslim sees a removable Dropout."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])]
    initializers = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                    numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    if training_is_input:
        inputs.append(helper.make_tensor_value_info("training", TensorProto.BOOL, [1]))
    else:
        initializers.append(numpy_helper.from_array(np.array(True), "training"))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Dropout", ["r", "ratio", "training"], ["d"], name="train_drop", seed=1),
         helper.make_node("Add", ["d", "one"], ["y"])],
        "training_dropout", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_onnxslim_keeps_a_training_dropout():
    model = training_dropout_model()
    simplified = onnx_frontend.simplify(model, onnx_frontend.bind_input_shapes(model, {}))
    assert [n.op_type for n in simplified.graph.node] == ["Relu", "Dropout", "Add"]
    assert [(o.domain, o.version) for o in simplified.opset_import] == [("", 17)]


def test_hide_and_restore_round_trip_and_leave_the_input_alone():
    model = training_dropout_model()
    hidden = hide_dropouts(model)
    assert "Dropout" not in [n.op_type for n in hidden.graph.node]
    assert [n.op_type for n in model.graph.node] == ["Relu", "Dropout", "Add"]  # a copy was changed
    assert restore_dropouts(hidden).SerializeToString() == model.SerializeToString()


def test_training_mode_computed_at_run_time_is_a_model_error():
    model = training_dropout_model(training_is_input=True)
    specs = onnx_frontend.bind_input_shapes(model, {})
    with pytest.raises(ModelError, match="Dropout node 'train_drop': training_mode is computed at run time"):
        onnx_frontend.import_model(onnx_frontend.simplify(model, specs), specs)


def upsample_model(opset: int, mode: str, scales=(1.0, 1.0, 2.0, 1.5)) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 6])]
    if opset >= 9:  # scales became an input
        node = helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)
        initializers = [numpy_helper.from_array(np.array(scales, np.float32), "scales")]
    else:
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=list(scales))
        initializers = []
    graph = helper.make_graph([node], "upsample", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


@pytest.mark.parametrize("opset, mode", [(7, "nearest"), (8, "nearest"), (9, "nearest"), (8, "linear"),
                                         (9, "linear")])
def test_upsample_matches_onnx_runtime(opset, mode):
    """TVM's own converter rounds the nearest pixel (ONNX floors) and cannot import opset 9."""
    import onnxruntime as ort
    import tvm
    from tvm import relax

    model = upsample_model(opset, mode)
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 6)).astype(np.float32)
    (expected,) = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(None, {"x": x})
    module = onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (1, 2, 4, 6), "float32")])
    vm = relax.VirtualMachine(tvm.compile(relax.get_pipeline("zero")(module), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert got.shape == expected.shape == (1, 2, 8, 9)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def scaler_model(dtype: int, offset: list[float], scale: list[float]) -> onnx.ModelProto:
    """skl2onnx's StandardScaler: an ``ai.onnx.ml`` Scaler on a (batch, 3) table."""
    node = helper.make_node("Scaler", ["x"], ["y"], domain="ai.onnx.ml", offset=offset, scale=scale)
    graph = helper.make_graph([node], "scaler", [helper.make_tensor_value_info("x", dtype, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype, offset, scale", [
    (TensorProto.FLOAT, [5.3, 0.0, -12.7], [0.35, 1.0, 0.147]),  # one per feature
    (TensorProto.FLOAT, [2.0], [0.5]),                             # one for all features
    (TensorProto.INT64, [1.0, 2.0, 3.0], [2.0, 0.5, -1.0]),        # integer input, float output
])
def test_scaler_matches_onnx_runtime(dtype, offset, scale):
    """TVM has no ``ai.onnx.ml`` converter: a scikit-learn pipeline failed at its first node."""
    import onnxruntime as ort
    import tvm
    from tvm import relax

    model = scaler_model(dtype, offset, scale)
    numpy_dtype = np.float32 if dtype == TensorProto.FLOAT else np.int64
    x = (np.random.default_rng(0).standard_normal((2, 3)) * 10).astype(numpy_dtype)
    (expected,) = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(None, {"x": x})
    module = onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (2, 3), str(np.dtype(numpy_dtype)))])
    vm = relax.VirtualMachine(tvm.compile(relax.get_pipeline("zero")(module), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_another_onnx_ml_op_is_still_named_as_unsupported():
    node = helper.make_node("Normalizer", ["x"], ["y"], domain="ai.onnx.ml", norm="L2", name="norm0")
    graph = helper.make_graph([node], "normalizer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(ModelError) as info:
        onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (2, 3), "float32")])
    assert "ai.onnx.ml.Normalizer (nodes: norm0)" in info.value.message


@pytest.mark.parametrize("depth", [np.array(5, np.int64), np.array([5], np.int64)])
def test_one_hot_is_typed_as_its_values_and_takes_a_depth_vector(depth):
    """paddle2onnx writes the depth as a one-element vector (TVM's converter refused it), and
    TVM's typed every OneHot float64 whatever its values' type; negative indices count from the end."""
    graph = helper.make_graph(
        [helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=-1)], "one_hot",
        [helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(depth, "depth"), numpy_helper.from_array(np.array([-1.0, 2.5], np.float32), "values")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    indices = np.array([[0, 4, -1], [2, -5, 3]], np.int64)
    (expected,) = _onnxruntime(model, {"i": indices})
    (got,) = helpers.run_imported(model, {"i": indices})
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_resize_with_empty_scales_beside_sizes_reads_the_sizes():
    """paddle2onnx passes an empty ``scales`` with ``sizes``; TVM's converter refused the pair."""
    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "roi", "scales", "sizes"], ["y"], mode="nearest",
                          coordinate_transformation_mode="asymmetric", nearest_mode="floor")], "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(0, np.float32), "roi"), numpy_helper.from_array(np.zeros(0, np.float32), "scales"),
         numpy_helper.from_array(np.array([1, 2, 6, 10], np.int64), "sizes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 5)).astype(np.float32)
    (expected,) = _onnxruntime(model, {"x": x})
    (got,) = helpers.run_imported(model, {"x": x})
    assert got.shape == expected.shape == (1, 2, 6, 10)
    np.testing.assert_array_equal(got, expected)


def _onnxruntime(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
