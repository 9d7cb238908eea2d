"""Large weights kept out of the simplification's copies (frontend/initializers.py)."""

import numpy as np
import onnx
import onnxruntime as ort
import onnxslim
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api
from tvm_fusion.frontend import initializers, shape_values
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.initializers import (ELIDED, copy_with_initializers, elide_large_weights,
                                              large_initializers_as_inputs, restore_weights, tensor_bytes)
from tvm_fusion.frontend.shape_values import folding_operands

THRESHOLD = onnx_frontend._FOLDED_BYTES


def weights_model(ir_version: int = 8) -> onnx.ModelProto:
    """y = reshape(x @ W) to Shape(x)-derived dims + P[positions]: W (128 KiB) only meets run-time
    values; the position table P (128 KiB) is sliced by constant indices, a fold onnxslim makes."""
    rng = np.random.default_rng(0)
    node = helper.make_node
    weight = numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "W")
    table = numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "P")
    graph = helper.make_graph(
        [node("MatMul", ["x", "W"], ["xw"], name="matmul"),
         node("Gather", ["P", "positions"], ["rows"], name="positions"),
         node("Add", ["xw", "rows"], ["sum"], name="add"),
         node("Shape", ["x"], ["shape"], name="shape"),
         node("Gather", ["shape", "zero"], ["batch"], name="batch", axis=0),
         node("Unsqueeze", ["batch", "zero_axis"], ["batch_1d"], name="unsqueeze"),
         node("Concat", ["batch_1d", "width"], ["target"], name="target", axis=0),
         node("Reshape", ["sum", "target"], ["y"], name="reshape")],
        "weights", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
        [weight, table, numpy_helper.from_array(np.zeros(1, np.int64), "positions"),
         numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
         numpy_helper.from_array(np.array([128], np.int64), "width")])
    if ir_version < 4:  # old exporters list every initializer as a graph input too
        graph.input.extend(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                           for init in graph.initializer)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=ir_version)


def initializer_bytes(model: onnx.ModelProto) -> dict[str, bytes]:
    return {init.name: init.SerializeToString() for init in model.graph.initializer}


def simplified(model):
    specs = onnx_frontend.bind_input_shapes(model, {"x": (3, 256)}, {})
    return onnx_frontend.simplify(model, specs)


def test_only_the_weight_that_meets_run_time_values_is_left_out_of_folds():
    assert folding_operands(weights_model()) >= {"P", "positions"}
    assert "W" not in folding_operands(weights_model())


@pytest.mark.parametrize("ir_version", [3, 8])
def test_onnxslim_never_sees_the_large_weight_and_simplifies_the_same(monkeypatch, ir_version):
    model = weights_model(ir_version)
    seen = []
    slim = onnxslim.slim

    def spy(given, **kwargs):
        seen.append({init.name: tensor_bytes(init) for init in given.graph.initializer})
        return slim(given, **kwargs)

    monkeypatch.setattr(onnxslim, "slim", spy)
    stripped = simplified(model)
    assert seen and "W" not in seen[0] and "P" in seen[0]
    monkeypatch.setattr(onnx_frontend, "large_initializers_as_inputs", lambda given, *_: (given, set()))
    whole = simplified(model)
    assert [(n.op_type, list(n.input), list(n.output)) for n in stripped.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in whole.graph.node]
    assert initializer_bytes(stripped) == initializer_bytes(whole)
    assert [value.name for value in stripped.graph.input] == [value.name for value in whole.graph.input]
    assert "Gather" not in {n.op_type for n in stripped.graph.node if n.input[0] == "P"}  # P[positions] folded


def test_a_weight_as_input_keeps_its_type_and_shape():
    model = weights_model()
    stripped, names = large_initializers_as_inputs(model, THRESHOLD, frozenset({"P"}))
    assert names == {"W"}
    assert "W" not in initializer_bytes(stripped) and "P" in initializer_bytes(stripped)
    (declared,) = [value for value in stripped.graph.input if value.name == "W"]
    assert declared.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [dim.dim_value for dim in declared.type.tensor_type.shape.dim] == [256, 128]
    assert "W" in initializer_bytes(model)  # the model itself is untouched


def test_a_copy_without_some_initializers_keeps_everything_else():
    model = weights_model()
    copy = copy_with_initializers(model, lambda init: init.name != "W")
    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    kept = [init for init in expected.graph.initializer if init.name != "W"]
    del expected.graph.initializer[:]
    expected.graph.initializer.extend(kept)
    assert copy == expected


def test_elided_weights_keep_their_place_and_come_back_whole():
    model = weights_model()
    whole = simplified(model)
    light = elide_large_weights(whole, model, THRESHOLD)
    stubs = {init.name: init for init in light.graph.initializer if init.doc_string == ELIDED}
    assert set(stubs) == {"W"}
    assert not stubs["W"].raw_data and list(stubs["W"].dims) == [256, 128]
    assert light.ByteSize() < THRESHOLD < whole.ByteSize()
    assert initializer_bytes(restore_weights(light, model)) == initializer_bytes(whole)


def test_a_tensor_that_differs_from_the_models_own_is_not_elided():
    model = weights_model()
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    (weight,) = [init for init in changed.graph.initializer if init.name == "W"]
    weight.CopyFrom(numpy_helper.from_array(np.ones((256, 128), np.float32), "W"))
    light = elide_large_weights(changed, model, THRESHOLD)
    assert {init.name for init in light.graph.initializer if init.doc_string == ELIDED} == {"P"}
    assert initializer_bytes(restore_weights(light, model)) == initializer_bytes(changed)


def test_an_onnxruntime_probe_carries_only_the_initializers_it_reads(monkeypatch):
    model = weights_model()
    sizes = []
    session = ort.InferenceSession

    def spy(serialized, *args, **kwargs):
        sizes.append(len(serialized))
        return session(serialized, *args, **kwargs)

    monkeypatch.setattr(shape_values.ort, "InferenceSession", spy)
    feeds = [{"x": np.zeros((3, 256), np.float32)}]
    (run,) = shape_values.evaluate(model, ["target"], feeds)
    assert run[0].tolist() == [3, 128]
    assert sizes and max(sizes) < THRESHOLD < model.ByteSize()


def test_a_model_with_large_weights_compiles_and_exports_like_onnxruntime(tmp_path):
    path = tmp_path / "weights.onnx"
    onnx.save(weights_model(), path)
    prepared = api.prepare(path, None, {"x": (3, 256)})
    assert any(init.doc_string == ELIDED for init in prepared.simplified.graph.initializer)
    report = api.export_fused_onnx(path, None, {"x": (3, 256)}, tmp_path / "fused.onnx", check=True)
    assert report.comparisons and all(c.passed for c in report.comparisons)
    result = api.compile_model(path, None, {"x": (3, 256)}, output_dir=tmp_path / "build")
    assert result.verification == "matches ONNX Runtime"
    assert initializers.restore_weights(prepared.simplified, prepared.onnx_model).ByteSize() > 2 * THRESHOLD
