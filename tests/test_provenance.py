"""inspect imports through the same importer as compile (our converters included), names intact."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from tvm_fusion import api
from tvm_fusion.provenance import import_with_node_names, node_index


def eye_like_add_model() -> onnx.ModelProto:
    """EyeLike has our converter (TVM's folds a stored identity), so only it lets the fusion fire."""
    graph = helper.make_graph(
        [helper.make_node("EyeLike", ["x"], ["eye"], name="eye_like", k=1),
         helper.make_node("Add", ["eye", "b"], ["y"], name="add")],
        "eye_like_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 6]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_bindings_are_named_after_nodes_through_our_converters():
    model = eye_like_add_model()
    module = import_with_node_names(model, {"x": [6, 6], "b": [6, 6]}, {"x": "float32", "b": "float32"})
    names = {binding.var.name for block in module["main"].body.blocks for binding in block.bindings}
    assert {node_index(name, model) for name in names} >= {0, 1}
    assert any(binding.value.op.name == "relax.call_tir"
               for block in module["main"].body.blocks for binding in block.bindings
               if hasattr(binding.value, "op") and hasattr(binding.value.op, "name")), "EyeLike kernel of ours"


def test_inspect_fires_what_compile_fires_on_a_converter_we_own(tmp_path, config_path):
    path = tmp_path / "eye_like_add.onnx"
    onnx.save(eye_like_add_model(), path)
    inspected = api.inspect_model(path, config_path())
    compiled = api.compile_model(path, config_path(), [], output_dir=tmp_path / "build")
    assert inspected.report.fired.get("eye_like_add") == 1
    assert compiled.metadata["fusions"].get("eye_like_add") == 1
    (instance,) = [i for i in api.fused_nodes(inspected.report, onnx.load(path))
                   if i.pattern.startswith("eye_like_add")]
    assert sorted(instance.nodes) == ["add", "eye_like"]


def test_unnamed_and_repeated_node_names_still_lead_to_their_nodes():
    """Exporters and hand edits leave node names empty or repeated: each binding is named after
    its own node (by its output), not after the last node that shares the name."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["a"], ["b"]),
         helper.make_node("Tanh", ["b"], ["c"], name="same"), helper.make_node("Neg", ["c"], ["y"], name="same")],
        "unnamed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    module = import_with_node_names(model, {"x": [4]}, {"x": "float32"})
    ops = {node_index(binding.var.name, model): binding.value.op.name
           for block in module["main"].body.blocks for binding in block.bindings}
    assert ops == {0: "relax.nn.relu", 1: "relax.sigmoid", 2: "relax.tanh", 3: "relax.negative"}
