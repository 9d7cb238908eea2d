"""A top-level If on a scalar input (silero VAD picks its 16 kHz or 8 kHz network by ``sr``):
inlined as both branches + Where when they select values of one shape (else imported as a
Relax If), compiled, verified against ONNX Runtime on both branches; an op we cannot convert
inside a branch is named with its branch."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import helpers
from tvm_fusion import api
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.if_hoisting import hoist_ifs, same_shapes
from tvm_fusion.frontend.op_support import unsupported_ops
from tvm_fusion.runtime import load


def _branch(name: str, scale: float, op: str = "Relu") -> object:
    """``op(x @ W + b) * scale``: a linear layer the gemm epilogue fuses, inside the branch."""
    rng = np.random.default_rng(len(name))
    nodes = [helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_mm"]),
             helper.make_node("Add", [f"{name}_mm", f"{name}_b"], [f"{name}_biased"]),
             helper.make_node(op, [f"{name}_biased"], [f"{name}_act"], name=f"{name}_act"),
             helper.make_node("Mul", [f"{name}_act", f"{name}_scale"], [f"{name}_out"])]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), f"{name}_w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), f"{name}_b"),
             numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale")]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 4])],
                             inits)


def _one_row_branch() -> object:
    """``x[0:1] @ W``: [1, 4] where the other branch gives [2, 4]."""
    rng = np.random.default_rng(7)
    return helper.make_graph(
        [helper.make_node("Slice", ["x", "zero", "one", "zero"], ["row"]),
         helper.make_node("MatMul", ["row", "row_w"], ["row_out"])], "row", [],
        [helper.make_tensor_value_info("row_out", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "row_w"),
         numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array([1], np.int64), "one")])


def if_model(else_op: str = "Relu", else_shape_differs: bool = False):
    else_branch = _one_row_branch() if else_shape_differs else _branch("narrow", -1.0, else_op)
    cond = [helper.make_node("Equal", ["sr", "rate16k"], ["is16k"]),
            helper.make_node("If", ["is16k"], ["y"], name="by_rate", then_branch=_branch("wide", 2.0),
                             else_branch=else_branch)]
    graph = helper.make_graph(
        cond, "rate_switch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 4])],
        [numpy_helper.from_array(np.array(16000, np.int64), "rate16k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_branches_of_one_shape_are_inlined_and_selected():
    model = if_model()
    specs = onnx_frontend.bind_input_shapes(model)
    simplified = onnx_frontend.simplify(model, specs)
    assert "If" not in [node.op_type for node in simplified.graph.node]
    selects = [node for node in simplified.graph.node if node.op_type == "Where"]
    assert [node.name for node in selects] == ["by_rate/select_0"]
    assert selects[0].input[1].startswith("by_rate/then_branch/") and selects[0].input[2].startswith("by_rate/else_branch/")


def test_must_not_inline_branches_of_different_shapes():
    """Where would broadcast [1, 4] to [2, 4]: the If stays for TVM's importer."""
    model = if_model(else_shape_differs=True)
    specs = onnx_frontend.bind_input_shapes(model)
    assert not same_shapes(onnx_frontend._slim(hoist_ifs(model), specs))
    assert "If" in [node.op_type for node in onnx_frontend.simplify(model, specs).graph.node]


@pytest.mark.parametrize("else_shape_differs", [False, True])
def test_both_branches_compile_and_match_onnxruntime(tmp_path, config_path, else_shape_differs):
    path = helpers.save(if_model(else_shape_differs=else_shape_differs), tmp_path / "rate_switch.onnx")
    result = api.compile_model(path, config_path(schedule="default"), output_dir=tmp_path / "build")
    # One linear layer per branch, inlined; TVM's If import also computes both before picking.
    assert result.report.fired["gemm_epilogue"] == (1 if else_shape_differs else 2)
    model = load(result.artifact)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    for rate in (16000, 8000):
        inputs = {"x": x, "sr": np.array(rate, np.int64)}
        np.testing.assert_allclose(model.run(inputs)["y"], helpers.ort_outputs(path, inputs)["y"],
                                   rtol=1e-5, atol=1e-5)


def test_an_unsupported_op_inside_a_branch_is_named_with_its_branch(tmp_path):
    assert unsupported_ops(if_model(else_op="Celu")) == {"Celu": ["by_rate/else_branch/narrow_act"]}
    with pytest.raises(ModelError, match=r"Celu \(nodes: by_rate/else_branch/narrow_act\)"):
        api.prepare(helpers.save(if_model(else_op="Celu"), tmp_path / "celu.onnx"))
