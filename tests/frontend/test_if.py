"""A top-level If on a scalar input (silero VAD picks its 16 kHz or 8 kHz network by ``sr``):
inlined as both branches + Where when they select values of one shape (else imported as a
Relax If), compiled, verified against ONNX Runtime on both branches; an If nested in a branch
that the bound shapes decide (torch's squeeze-if-size-1) keeps its taken branch alone; an op we
cannot convert inside a branch is named with its branch."""

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


def _squeeze_if_one_row_branch(name: str, rows: int) -> object:
    """``x[:rows] @ W``, squeezed when ``rows`` is 1 by a nested If on its shape, scaled and
    expanded to [2, 4]: the nested If's branches give [4] and [rows, 4]; outputs untyped, as
    spox writes them."""
    rng = np.random.default_rng(rows)
    squeeze = helper.make_graph([helper.make_node("Squeeze", [f"{name}_mm", "zero"], [f"{name}_squeezed"])],
                                "squeeze", [], [helper.make_empty_tensor_value_info(f"{name}_squeezed")])
    keep = helper.make_graph([helper.make_node("Identity", [f"{name}_mm"], [f"{name}_kept"])],
                             "keep", [], [helper.make_empty_tensor_value_info(f"{name}_kept")])
    nodes = [helper.make_node("Slice", ["x", "zero", f"{name}_rows", "zero"], [f"{name}_x"]),
             helper.make_node("MatMul", [f"{name}_x", f"{name}_w"], [f"{name}_mm"]),
             helper.make_node("Shape", [f"{name}_mm"], [f"{name}_shape"]),
             helper.make_node("Gather", [f"{name}_shape", "zero_scalar"], [f"{name}_first"]),
             helper.make_node("Equal", [f"{name}_first", "one_scalar"], [f"{name}_is_one"]),
             helper.make_node("If", [f"{name}_is_one"], [f"{name}_y"], name=f"{name}_squeeze_if",
                              then_branch=squeeze, else_branch=keep),
             helper.make_node("Mul", [f"{name}_y", f"{name}_scale"], [f"{name}_scaled"]),
             helper.make_node("Expand", [f"{name}_scaled", "out_shape"], [f"{name}_out"])]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), f"{name}_w"),
             numpy_helper.from_array(np.array([rows], np.int64), f"{name}_rows"),
             numpy_helper.from_array(np.array(float(rows), np.float32), f"{name}_scale")]
    return helper.make_graph(nodes, name, [], [helper.make_empty_tensor_value_info(f"{name}_out")], inits)


def nested_if_model():
    """An If on ``sr`` whose branches each hold a squeeze-if-size-1 (silero VAD's spox export):
    both branches end as [2, 4], through nested Ifs of different shapes."""
    cond = [helper.make_node("Equal", ["sr", "rate16k"], ["is16k"]),
            helper.make_node("If", ["is16k"], ["y"], name="by_rate",
                             then_branch=_squeeze_if_one_row_branch("wide", 2),
                             else_branch=_squeeze_if_one_row_branch("narrow", 1))]
    graph = helper.make_graph(  # a dynamic batch: ORT's load-time inference would refuse the squeeze of 2 rows
        cond, "nested_switch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.array(16000, np.int64), "rate16k"),
         numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array(0, np.int64), "zero_scalar"),
         numpy_helper.from_array(np.array(1, np.int64), "one_scalar"),
         numpy_helper.from_array(np.array([2, 4], np.int64), "out_shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


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


def test_ifs_the_bound_shapes_decide_keep_their_taken_branch():
    """Before: the nested Ifs' branches ([4] against [1, 4]) made the whole If stay an If. After:
    each nested If is decided by its row count, and only the If on ``sr`` is a select."""
    model = nested_if_model()
    simplified = onnx_frontend.simplify(model, onnx_frontend.bind_input_shapes(model, {"x": (2, 8)}))
    ops = [node.op_type for node in simplified.graph.node]
    assert "If" not in ops and "Squeeze" in ops  # the one-row branch's squeeze, decided
    assert [node.name for node in simplified.graph.node if node.op_type == "Where"] == ["by_rate/select_0"]


def test_must_not_decide_an_if_on_an_input_value():
    """``sr`` is a value at run time: its If stays a select of both branches, however the
    shapes are bound."""
    model = nested_if_model()
    simplified = onnx_frontend.simplify(model, onnx_frontend.bind_input_shapes(model, {"x": (2, 8)}))
    select = next(node for node in simplified.graph.node if node.op_type == "Where")
    assert select.input[1].startswith("by_rate/then_branch/") and select.input[2].startswith("by_rate/else_branch/")


def test_nested_ifs_compile_and_match_onnxruntime(tmp_path, config_path):
    path = helpers.save(nested_if_model(), tmp_path / "nested_switch.onnx")
    model = load(api.compile_model(path, config_path(schedule="default"), ["x:2x8"], output_dir=tmp_path / "build").artifact)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    for rate in (16000, 8000):
        inputs = {"x": x, "sr": np.array(rate, np.int64)}
        np.testing.assert_allclose(model.run(inputs)["y"], helpers.ort_outputs(path, inputs)["y"],
                                   rtol=1e-5, atol=1e-5)


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
