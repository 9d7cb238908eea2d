"""The reference's variants: models that compute the same function as the one given with their
float operations off by rounding noise (``tvm_fusion/accuracy/reference_variants.py``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import quantize_dynamic

from tvm_fusion import verify
from tvm_fusion.accuracy.reference_variants import halved_reductions, nudged_quantization_inputs

RTOL, ATOL = 1e-3, 1e-4
NUDGED = "run-time quantizations' inputs an ulp up"


def compare_outputs(actual, expected):
    return verify.compare_outputs(actual, expected, RTOL, ATOL)


def test_sums_of_halves_compute_the_same_function():
    """Each float ReduceMean / ReduceSum over a static, even last axis becomes the reduction of
    its halves' reductions, at opsets with axes as an attribute and as an input; others stay."""
    x = np.random.default_rng(1).standard_normal((3, 6, 8)).astype(np.float32)
    for opset, axes_as_input in ((13, False), (18, True)):
        def reduce(op, source, out, axes, keepdims=1):
            if axes_as_input or (op == "ReduceSum" and opset >= 13):
                return helper.make_node(op, [source, f"axes{axes}"], [out], keepdims=keepdims)
            return helper.make_node(op, [source], [out], axes=[axes], keepdims=keepdims)
        nodes = [reduce("ReduceMean", "x", "a", -1), reduce("ReduceSum", "x", "b", 2, keepdims=0),
                 reduce("ReduceMean", "x", "c", 0), helper.make_node("Slice", ["x", "s0", "s1", "s2"], ["odd"]),
                 reduce("ReduceSum", "odd", "d", -1)]
        initializers = [numpy_helper.from_array(np.array([axes], np.int64), f"axes{axes}") for axes in (-1, 2, 0)]
        initializers += [numpy_helper.from_array(np.array([value], np.int64), name)
                         for name, value in (("s0", 0), ("s1", 7), ("s2", 2))]
        outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
                   for name, shape in zip("abcd", ([3, 6, 1], [3, 6], [1, 6, 8], [3, 6, 1]))]
        source = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6, 8])
        graph = helper.make_graph(nodes, "reductions", [source], outputs, initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
        halved = halved_reductions(model)
        onnx.checker.check_model(halved)
        ops = [node.op_type for node in halved.graph.node]
        assert ops.count("Reshape") == 2 and ops.count("ReduceMean") == 3 and ops.count("ReduceSum") == 3
        expected, got = verify.reference_outputs(model, {"x": x}), verify.reference_outputs(halved, {"x": x})
        for name in "abcd":
            assert got[name].shape == expected[name].shape
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6)


def quantize_linear_model() -> onnx.ModelProto:
    """x -> DynamicQuantizeLinear, its nudged input exposed when the test adds it as an output."""
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero_point"])
    graph = helper.make_graph([node], "dql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in
                               (("q", TensorProto.UINT8, [4, 16]), ("scale", TensorProto.FLOAT, []),
                                ("zero_point", TensorProto.UINT8, []))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_each_quantized_value_moves_one_or_two_ulps_up():
    nudged = nudged_quantization_inputs(quantize_linear_model())
    onnx.checker.check_model(nudged)
    [mul] = [node for node in nudged.graph.node if node.op_type == "Mul"]
    assert mul.input[0] == "x" and nudged.graph.node[-1].input[0] == mul.output[0]
    nudged.graph.output.append(helper.make_tensor_value_info(mul.output[0], TensorProto.FLOAT, [4, 16]))
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    x[0, :3] = (0.0, 1.0, -1.0)
    moved = verify.reference_outputs(nudged, {"x": x})[mul.output[0]]
    steps = moved.view(np.int32).astype(np.int64) - x.view(np.int32)  # ulps, the sign kept
    assert steps[0, 0] == 0 and steps[0, 1] == steps[0, 2] == 1
    assert set(np.unique(steps[x != 0]).tolist()) <= {1, 2}


def test_a_model_without_run_time_quantization_is_not_rerun(mlp_path):
    model = onnx.load(mlp_path)
    assert nudged_quantization_inputs(model) is model
    assert NUDGED not in verify.reference_variants(model, {"x": np.zeros((4, 16), np.float32)})


@pytest.fixture
def layer_norm_before_quantized_lstm(tmp_path) -> onnx.ModelProto:
    """LayerNormalization -> LSTM through ``quantize_dynamic``: a DynamicQuantizeLSTM whose input
    scale comes from the norm's max (voicefilter-lite-int8's shape, smaller)."""
    seq, width, hidden = 50, 32, 32
    rng = np.random.default_rng(0)
    fan_in = np.float32(4 / np.sqrt(width))  # gate sums of the same size at any width
    weights = {"W": rng.uniform(-0.6, 0.6, (1, 4 * hidden, width)).astype(np.float32) * fan_in,
               "R": rng.uniform(-0.6, 0.6, (1, 4 * hidden, hidden)).astype(np.float32) * fan_in,
               "B": rng.uniform(-0.5, 0.5, (1, 8 * hidden)), "g": rng.uniform(0.5, 1.5, width),
               "b": rng.uniform(-0.5, 0.5, width)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1),
             helper.make_node("LSTM", ["n", "W", "R", "B"], ["Y", "Y_h", "Y_c"], hidden_size=hidden)]
    graph = helper.make_graph(nodes, "norm_lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, 1, width])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "int8.onnx")
    model = onnx.load(tmp_path / "int8.onnx")
    assert [node.op_type for node in model.graph.node] == ["LayerNormalization", "DynamicQuantizeLSTM"]
    return model


def test_only_the_nudge_shows_a_quantized_lstms_spread(layer_norm_before_quantized_lstm):
    """A norm's last bits move the LSTM's input scale and every step after it; reordering and
    thread counts leave ONNX Runtime's LayerNormalization as it is, so they alone called such an
    output well conditioned, and a build whose norm sums in other lanes failed on it."""
    model = layer_norm_before_quantized_lstm
    spreads = []
    for seed in range(24):  # here one input in twelve moved a step's quantized state (seed 1)
        x = np.random.default_rng(seed).standard_normal((50, 1, 32)).astype(np.float32)
        expected = verify.reference_outputs(model, {"x": x})
        runs = verify.reference_variants(model, {"x": x})
        assert set(runs) == set(verify.REFERENCE_VARIANTS)
        for name in set(runs) - {NUDGED}:
            np.testing.assert_array_equal(runs[name]["Y"], expected["Y"])
        spreads.append(verify.tolerance_multiple(runs[NUDGED]["Y"], expected["Y"], RTOL, ATOL))
        if spreads[-1] > 1:
            ours = {"Y": runs[NUDGED]["Y"]}
            [result] = verify.judge_conditioning(compare_outputs(ours, expected), ours, expected, lambda: runs,
                                                 RTOL, ATOL)
            assert not result.within_tolerance and result.passed
            assert result.reference_spread.configuration == NUDGED
            return
    pytest.fail(f"one ulp before the quantized LSTM never left the tolerance (multiples {spreads})")
