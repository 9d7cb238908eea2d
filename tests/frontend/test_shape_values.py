"""Shape computations frozen to constants from one ONNX Runtime run (frontend/shape_values.py)."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api
from tvm_fusion.frontend.onnx import bind_input_shapes, simplify
from tvm_fusion.frontend.shape_values import ancestors, evaluate, freeze_shape_tensors, shape_tensors


def padded_by_shape_model() -> onnx.ModelProto:
    """y = Pad(x, pads computed from Shape(x)): pad the last axis by (W - 4) on its end, edge mode."""
    node = helper.make_node
    graph = helper.make_graph(
        [node("Shape", ["x"], ["shape"], name="shape"),
         node("Gather", ["shape", "last"], ["width"], name="width", axis=0),
         node("Sub", ["width", "four"], ["extra"], name="extra"),
         node("Concat", ["zeros3", "extra_1d"], ["end"], name="end", axis=0),
         node("Unsqueeze", ["extra", "axis0"], ["extra_1d"], name="unsqueeze"),
         node("Concat", ["zeros4", "end"], ["pads"], name="pads", axis=0),
         node("Pad", ["x", "pads"], ["y"], name="pad", mode="edge")],
        "padded", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 3, "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(3, np.int64), "last"), numpy_helper.from_array(np.array(4, np.int64), "four"),
         numpy_helper.from_array(np.zeros(3, np.int64), "zeros3"), numpy_helper.from_array(np.zeros(4, np.int64), "zeros4"),
         numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    # Nodes out of topological order on purpose? No: ONNX requires order, so fix it.
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend([nodes[0], nodes[1], nodes[2], nodes[4], nodes[3], nodes[5], nodes[6]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_the_frontier_of_the_shape_computation_is_found():
    assert shape_tensors(padded_by_shape_model()) == ["pads"]


def test_frozen_pads_are_what_onnxruntime_computes_and_outputs_do_not_change():
    model = padded_by_shape_model()
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 7)).astype(np.float32)
    frozen = freeze_shape_tensors(model, [{"x": x}])
    initializers = {t.name: numpy_helper.to_array(t) for t in frozen.graph.initializer}
    assert initializers["pads"].tolist() == [0, 0, 0, 0, 0, 0, 0, 3]
    assert [n.op_type for n in frozen.graph.node if n.output[0] == "pads"] == []
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_array_equal(run(frozen), run(model))


def test_simplify_keeps_the_original_semantics():
    model = padded_by_shape_model()
    specs = bind_input_shapes(model, {"x": (1, 2, 3, 7)})
    simplified = simplify(model, specs)
    x = np.random.default_rng(1).standard_normal((1, 2, 3, 7)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_array_equal(run(simplified), run(model))
    assert [n.op_type for n in simplified.graph.node] == ["Pad"]


def test_a_model_without_shape_computations_is_returned_as_is():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert freeze_shape_tensors(model, [{"x": np.zeros(2, np.float32)}]) is model


def test_the_nodes_a_value_needs_include_what_an_if_branch_reads():
    """``evaluate`` runs only the ancestors of what it computes: an If whose branch reads an
    outer value (not an input of the If node) needs that value's producer too, or ORT fails."""
    node = helper.make_node
    branch = helper.make_graph([node("Identity", ["doubled"], ["taken"])], "branch", [],
                               [helper.make_tensor_value_info("taken", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [node("Add", ["x", "x"], ["doubled"], name="double"),
         node("Neg", ["x"], ["unused"], name="unused"),
         node("If", ["flag"], ["picked"], name="pick", then_branch=branch, else_branch=branch),
         node("Shape", ["picked"], ["shape"], name="shape")],
        "if_reads_outer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert [n.name for n in ancestors(model, ["shape"])] == ["double", "pick", "shape"]
    (run,) = evaluate(model, ["shape"], [{"x": np.ones((2, 3), np.float32), "flag": np.array(True)}])
    assert run[0].tolist() == [2, 3]


def dequantized_weight_model(prefolded: bool) -> onnx.ModelProto:
    """y = Reshape(x @ (Cast(W_int8) * scale), [Shape(x)[0], -1]): a weight stored as int8 and
    rewritten to float32 at load, as weight-compressed exports write it; with ``prefolded``
    the same float32 weight as one initializer."""
    rng = np.random.default_rng(0)
    quantized = rng.integers(-127, 128, size=(256, 512), dtype=np.int8)
    scale = rng.uniform(0.001, 0.01, size=512).astype(np.float32)
    node = helper.make_node
    if prefolded:
        weight_nodes = []
        initializers = [numpy_helper.from_array(quantized.astype(np.float32) * scale, "weight")]
    else:
        weight_nodes = [node("Cast", ["weight_q"], ["weight_f"], name="cast", to=TensorProto.FLOAT),
                        node("Mul", ["weight_f", "scale"], ["weight"], name="scale_weight")]
        initializers = [numpy_helper.from_array(quantized, "weight_q"), numpy_helper.from_array(scale, "scale")]
    initializers.append(numpy_helper.from_array(np.array([0], np.int64), "first"))
    initializers.append(numpy_helper.from_array(np.array([-1], np.int64), "rest"))
    graph = helper.make_graph(
        [*weight_nodes,
         node("MatMul", ["x", "weight"], ["product"], name="matmul"),
         node("Shape", ["x"], ["shape"], name="shape"),
         node("Gather", ["shape", "first"], ["rows"], name="rows", axis=0),
         node("Concat", ["rows", "rest"], ["target"], name="target", axis=0),
         node("Reshape", ["product", "target"], ["y"], name="reshape")],
        "dequantized_weight", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 512])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_rewritten_at_load_is_left_to_relax_and_the_shape_computation_still_folds():
    """onnxslim folds what a shape computation yields, not a weight's float32 rewrite: that
    copy, carried through onnxslim's loop, set the compile's memory peak."""
    model = dequantized_weight_model(prefolded=False)
    simplified = simplify(model, bind_input_shapes(model, None))
    ops = [n.op_type for n in simplified.graph.node]
    assert "Cast" in ops and "Mul" in ops
    assert "Shape" not in ops and "Gather" not in ops


def test_a_weight_rewritten_at_load_compiles_like_its_float_twin(tmp_path, config_path):
    """The canonicalize phase folds the Cast and Mul in Relax: the same kernels as a model
    that stores the float32 weight, and the same outputs as ONNX Runtime (compile verifies)."""
    kernels = []
    for prefolded in (False, True):
        path = tmp_path / f"weight_{prefolded}.onnx"
        onnx.save(dequantized_weight_model(prefolded), path)
        compiled = api.compile_model(path, config_path(), output_dir=tmp_path / f"out_{prefolded}")
        kernels.append(compiled.metadata["kernels"])
    assert kernels[0] == kernels[1]
