"""ONNX Loops whose step count the bound shapes fix, unrolled (``frontend/loop_unrolling.py``):
a greedy decoder written as paddle2onnx writes SLANet's (counter and condition carried, each
step scattering its row into a preallocated buffer, state passed on through ``assign``'s
Unsqueeze/Add 0/Squeeze), a plain counted Loop with a scan output, and the Loops it must
refuse (an early stop on data, a step count that follows the input size)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import helpers
from tvm_fusion import api
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.loop_unrolling import unroll_loops
from tvm_fusion.frontend.sample_inputs import random_inputs
from tvm_fusion.runtime import load

HIDDEN, CLASSES, MEMORY = 8, 5, 6


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def decoder_model(steps: int = 7, early_stop: bool = False) -> onnx.ModelProto:
    """``memory`` [1, MEMORY, HIDDEN] -> per-step class scores [1, steps, CLASSES].

    Each step: attention of the state over the memory (projected by a weight: the same at
    every step), a tanh state update, class scores scattered into row ``step`` of the output
    buffer, and the argmax fed back one-hot. The condition is ``step + 1 < steps`` on the
    carried counter (paddle2onnx's ``while``), or, with ``early_stop``, also on the scores."""
    rng = np.random.default_rng(3)
    weights = {name: rng.standard_normal(shape).astype(np.float32) * 0.5 for name, shape in
               [("w_mem", (HIDDEN, HIDDEN)), ("w_state", (HIDDEN + CLASSES, HIDDEN)), ("w_out", (HIDDEN, CLASSES))]}
    body_nodes = [
        # assign: the memory passed on unchanged through Unsqueeze, + 0, Squeeze
        _const("zero_axis", np.array([0], np.int64)), _const("zero_f", np.array([0.0], np.float32)),
        helper.make_node("Unsqueeze", ["memory_in", "zero_axis"], ["memory_u"]),
        helper.make_node("Add", ["memory_u", "zero_f"], ["memory_a"]),
        helper.make_node("Squeeze", ["memory_a", "zero_axis"], ["memory_out"]),
        # attention over the memory
        helper.make_node("MatMul", ["memory_in", "w_mem"], ["keys"]),
        _const("one_axis", np.array([1], np.int64)),
        helper.make_node("Unsqueeze", ["state_in", "one_axis"], ["query"]),
        helper.make_node("Mul", ["keys", "query"], ["scored"]),
        _const("two_axis", np.array([2], np.int64)),
        helper.make_node("ReduceSum", ["scored", "two_axis"], ["logits"], keepdims=0),
        helper.make_node("Softmax", ["logits"], ["attn"], axis=1),
        helper.make_node("Unsqueeze", ["attn", "one_axis"], ["attn_row"]),
        helper.make_node("MatMul", ["attn_row", "memory_in"], ["context_row"]),
        helper.make_node("Squeeze", ["context_row", "one_axis"], ["context"]),
        # previous argmax, one-hot
        _const("depth", np.array([CLASSES], np.int64)), _const("off_on", np.array([0.0, 1.0], np.float32)),
        helper.make_node("OneHot", ["prev_in", "depth", "off_on"], ["prev_onehot"]),
        helper.make_node("Concat", ["context", "prev_onehot"], ["joined"], axis=1),
        helper.make_node("MatMul", ["joined", "w_state"], ["update"]),
        helper.make_node("Add", ["update", "state_in"], ["pre_state"]),
        helper.make_node("Tanh", ["pre_state"], ["state_out"]),
        helper.make_node("MatMul", ["state_out", "w_out"], ["scores"]),
        helper.make_node("ArgMax", ["scores"], ["prev_out"], axis=1, keepdims=0),
        # scores into row `step` of the buffer: index tensor from the counter
        _const("one_i", np.array([1], np.int64)),
        helper.make_node("Add", ["count_in", "one_i"], ["count_out"]),
        helper.make_node("Unsqueeze", ["count_in", "zero_axis"], ["count_2d"]),
        helper.make_node("Unsqueeze", ["count_2d", "zero_axis"], ["count_3d"]),
        _const("tile_shape", np.array([1, 1, CLASSES], np.int64)),
        helper.make_node("Expand", ["count_3d", "tile_shape"], ["rows"]),
        helper.make_node("Unsqueeze", ["scores", "one_axis"], ["scores_row"]),
        helper.make_node("ScatterElements", ["buffer_in", "rows", "scores_row"], ["buffer_out"], axis=1),
        _const("limit", np.array([steps], np.int64)),
        helper.make_node("Less", ["count_out", "limit"], ["more"]),
    ]
    if early_stop:
        body_nodes += [helper.make_node("ReduceMax", ["scores"], ["top"], keepdims=0),
                       _const("threshold", np.array(50.0, np.float32)),
                       helper.make_node("Less", ["top", "threshold"], ["unsure"]),
                       helper.make_node("Reshape", ["more", "scalar_shape"], ["more_scalar"]),
                       helper.make_node("And", ["more_scalar", "unsure"], ["cond_out"])]
        body_nodes.insert(0, _const("scalar_shape", np.zeros(0, np.int64)))
    else:
        body_nodes.append(helper.make_node("Identity", ["more"], ["cond_out"]))
    tensor = helper.make_tensor_value_info
    body = helper.make_graph(
        body_nodes, "decoder_step",
        [tensor("iteration", TensorProto.INT64, []), tensor("cond_in", TensorProto.BOOL, None),
         tensor("memory_in", TensorProto.FLOAT, None), tensor("state_in", TensorProto.FLOAT, None),
         tensor("prev_in", TensorProto.INT64, None), tensor("count_in", TensorProto.INT64, None),
         tensor("buffer_in", TensorProto.FLOAT, None)],
        [tensor(name, elem, None) for name, elem in [
            ("cond_out", TensorProto.BOOL), ("memory_out", TensorProto.FLOAT), ("state_out", TensorProto.FLOAT),
            ("prev_out", TensorProto.INT64), ("count_out", TensorProto.INT64), ("buffer_out", TensorProto.FLOAT)]],
        [numpy_helper.from_array(value, name) for name, value in weights.items()])
    nodes = [
        helper.make_node("ReduceMean", ["memory"], ["state0"], axes=[1], keepdims=0),
        helper.make_node("Less", ["count0", "limit0"], ["cond0"]),
        helper.make_node("Loop", ["max_trips", "cond0", "memory", "state0", "prev0", "count0", "buffer0"],
                         ["memory_final", "state_final", "prev_final", "count_final", "scores"],
                         name="greedy_decoder", body=body),
    ]
    inits = [numpy_helper.from_array(np.array(1024, np.int64), "max_trips"),
             numpy_helper.from_array(np.array([0], np.int64), "count0"),
             numpy_helper.from_array(np.array([steps], np.int64), "limit0"),
             numpy_helper.from_array(np.zeros(1, np.int64), "prev0"),
             numpy_helper.from_array(np.zeros((1, steps, CLASSES), np.float32), "buffer0")]
    graph = helper.make_graph(nodes, "decoder", [tensor("memory", TensorProto.FLOAT, [1, MEMORY, HIDDEN])],
                              [tensor("scores", TensorProto.FLOAT, [1, steps, CLASSES]),
                               tensor("state_final", TensorProto.FLOAT, [1, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def counted_model(trips: int = 4) -> onnx.ModelProto:
    """A Loop with a trip count and no condition: ``acc += x * step``, each ``acc`` a scan row."""
    tensor = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "i_f"], ["scaled"]),
         helper.make_node("Add", ["acc_in", "scaled"], ["acc_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Relu", ["acc_out"], ["row"])],
        "count_body", [tensor("i", TensorProto.INT64, []), tensor("cond", TensorProto.BOOL, []),
                       tensor("acc_in", TensorProto.FLOAT, None)],
        [tensor("cond_out", TensorProto.BOOL, []), tensor("acc_out", TensorProto.FLOAT, None),
         tensor("row", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "acc0"], ["acc", "rows"], name="counted", body=body)],
        "counted", [tensor("x", TensorProto.FLOAT, [2, 3])],
        [tensor("acc", TensorProto.FLOAT, [2, 3]), tensor("rows", TensorProto.FLOAT, [trips, 2, 3])],
        [numpy_helper.from_array(np.array(trips, np.int64), "trips"),
         numpy_helper.from_array(np.full((2, 3), -1.0, np.float32), "acc0")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _unrolled(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto:
    specs = onnx_frontend.bind_input_shapes(model, shapes)
    return unroll_loops(model, [random_inputs(model, specs, seed=0)])


def test_a_counted_decoder_unrolls_step_by_step_with_loop_invariant_work_once():
    unrolled = _unrolled(decoder_model(steps=7), {"memory": (1, MEMORY, HIDDEN)})
    ops = [node.op_type for node in unrolled.graph.node]
    assert "Loop" not in ops
    assert ops.count("ScatterElements") == 7 and ops.count("OneHot") == 7
    # The memory is passed on through assign's Unsqueeze/Add 0/Squeeze: it is loop-invariant,
    # so its projection is computed once and the assign chain is not copied.
    hoisted = [node for node in unrolled.graph.node if "/invariant/" in node.name]
    assert [node.op_type for node in hoisted] == ["MatMul"]
    assert ops.count("MatMul") == 1 + 7 * 3 and ops.count("Squeeze") == 7
    # The counter, the condition and the scatter rows are constants; no Less is copied.
    assert ops.count("Less") == 1  # the main graph's initial condition


def test_the_unrolled_decoder_computes_what_onnxruntime_computes():
    model = decoder_model(steps=7)
    unrolled = _unrolled(model, {"memory": (1, MEMORY, HIDDEN)})
    memory = np.random.default_rng(1).standard_normal((1, MEMORY, HIDDEN)).astype(np.float32)
    import onnxruntime as ort

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"memory": memory})

    for got, expected in zip(run(unrolled), run(model)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_decoder_loop_compiles_and_matches_onnxruntime(tmp_path, config_path):
    path = helpers.save(decoder_model(steps=7), tmp_path / "decoder.onnx")
    result = api.compile_model(path, config_path(schedule="default"), ["memory:1x6x8"], output_dir=tmp_path / "build")
    model = load(result.artifact)
    for seed in (1, 2):
        memory = np.random.default_rng(seed).standard_normal((1, MEMORY, HIDDEN)).astype(np.float32)
        got, expected = model.run({"memory": memory}), helpers.ort_outputs(path, {"memory": memory})
        for name in ("scores", "state_final"):
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_a_counted_loop_without_condition_stacks_its_scan_output(tmp_path, config_path):
    path = helpers.save(counted_model(trips=4), tmp_path / "counted.onnx")
    model = load(api.compile_model(path, config_path(schedule="default"), output_dir=tmp_path / "build").artifact)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    got, expected = model.run({"x": x}), helpers.ort_outputs(path, {"x": x})
    assert got["rows"].shape == (4, 2, 3)
    for name in ("acc", "rows"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6)


def test_must_not_unroll_a_loop_that_stops_on_data(tmp_path):
    with pytest.raises(ModelError, match=r"Loop greedy_decoder cannot be unrolled: its condition depends on data"):
        _unrolled(decoder_model(early_stop=True), {"memory": (1, MEMORY, HIDDEN)})
    with pytest.raises(ModelError, match="greedy_decoder"):
        api.prepare(helpers.save(decoder_model(early_stop=True), tmp_path / "early.onnx"), None, ["memory:1x6x8"])


def test_must_not_unroll_a_loop_whose_step_count_follows_the_input_size():
    """Steps = the memory's length (Shape -> Gather as the trip count): a range of lengths has
    no one step count."""
    model = counted_model()
    tensor = helper.make_tensor_value_info
    model.graph.input[0].CopyFrom(tensor("x", TensorProto.FLOAT, ["rows", 3]))
    model.graph.node.insert(0, helper.make_node("Shape", ["x"], ["x_shape"]))
    model.graph.node.insert(1, helper.make_node("Gather", ["x_shape", "first"], ["trips_from_x"], axis=0))
    model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "first"))
    model.graph.node[2].input[0] = "trips_from_x"
    model.graph.node[2].input[2] = "x"  # the state has the input's rows
    del model.graph.output[:]
    model.graph.output.append(tensor("acc", TensorProto.FLOAT, ["rows", 3]))
    specs = onnx_frontend.bind_input_shapes(model, dict([onnx_frontend.parse_shape_flag("x:2..8x3")]))
    feeds = [random_inputs(model, onnx_frontend.inputs_at(specs, {"rows": rows}), seed=0) for rows in (2, 8)]
    with pytest.raises(ModelError, match="step count follows the input size"):
        unroll_loops(model, feeds)
