"""QDQ models (``quantize_static`` output) against ONNX Runtime: QuantizeLinear bit for bit, and
the groups ONNX Runtime runs as integer ops (frontend/qdq_fusion.py) with its arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from helpers import mlp_model, ort_outputs, run_imported, save
from machine import host_target, host_target_without_amx
from tvm import relax

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.frontend.qdq_fusion import fuse_qdq_groups
from tvm_fusion.kernels.cpu_features import has_vnni
from tvm_fusion.runtime import load
from tvm_fusion.session import ModelSession
from tvm_fusion.verify import reference_outputs


def quantize_linear_model(dtype, scale: np.ndarray, zero_point: np.ndarray, shape, axis: int = 1) -> onnx.ModelProto:
    node = helper.make_node("QuantizeLinear", ["x", "scale", "zero_point"], ["q"], name="quantize", axis=axis)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("q", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None)],
                              [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(zero_point, "zero_point")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_linear_rounds_ties_to_even_and_saturates_as_onnxruntime(dtype, per_channel):
    """Every x.5 step from far below to far above the range (ties: 2.5 -> 2, 3.5 -> 4), scales
    that are not powers of two (x / scale is then not x * (1 / scale)), and saturation."""
    channels = 3
    scale = (np.array([0.1, 0.37, 1.0], np.float32) if per_channel else np.array(0.37, np.float32))
    zero_point = (np.array([0, 3, -7] if dtype == np.int8 else [0, 3, 250], dtype) if per_channel
                  else np.array(3, dtype))
    steps = np.arange(-300, 300, 0.5, dtype=np.float32)
    x = (steps[None, :] * scale.reshape(-1, 1)).astype(np.float32) if per_channel else np.tile(steps * scale, (channels, 1))
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf))], axis=1)[None]  # ties and just above them
    model = quantize_linear_model(dtype, scale, zero_point, list(x.shape))
    expected = reference_outputs(model, {"x": x})["q"]
    (got,) = run_imported(model, {"x": x})
    assert got.dtype == expected.dtype
    assert np.unique(expected).size > 200 and {np.iinfo(dtype).min, np.iinfo(dtype).max} <= set(expected.ravel().tolist())
    np.testing.assert_array_equal(got, expected)


def two_conv_model(nodes: list, channels: int, second_kernel: int, opset: int) -> onnx.ModelProto:
    """``nodes`` over x [1, 3, 16, 16] -> y, with the weights of a 3x3 conv from RGB to
    ``channels`` (w1, b1) and a ``second_kernel`` square conv on those channels (w2, b2)."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name) for name, shape in (
        ("w1", (channels, 3, 3, 3)), ("b1", (channels,)), ("w2", (channels, channels, second_kernel, second_kernel)),
        ("b2", (channels,)))]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def conv_model(channels: int = 16) -> onnx.ModelProto:
    """x -> Conv(3x3, bias) -> Relu -> Conv(3x3, bias) -> Add(the Relu) -> Relu: a residual block."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "r1"], ["s"], name="residual"),
             helper.make_node("Relu", ["s"], ["y"], name="relu2")]
    return two_conv_model(nodes, channels, 3, opset=13)


class _RandomReader(CalibrationDataReader):
    def __init__(self, name: str, shape, seed: int = 0):
        rng = np.random.default_rng(seed)
        self._batches = iter([{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self._batches, None)


def static_quantized(model: onnx.ModelProto, tmp_path, shape, **options) -> onnx.ModelProto:
    """``quantize_static``'s QDQ rewrite of ``model`` (random calibration data, fixed seed)."""
    onnx.save(model, tmp_path / "float.onnx")
    quantize_static(tmp_path / "float.onnx", tmp_path / "qdq.onnx", _RandomReader(model.graph.input[0].name, shape),
                    quant_format=QuantFormat.QDQ, **options)
    return onnx.load(tmp_path / "qdq.onnx")


def assert_matches_onnxruntime(model: onnx.ModelProto, feeds: dict) -> None:
    expected = reference_outputs(model, feeds)
    got = run_imported(model, feeds)
    for ours, (name, theirs) in zip(got, expected.items()):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5, err_msg=name)


OPTIONS = {
    "per-channel u8/s8": dict(per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8),
    "per-tensor u8/u8": dict(per_channel=False, activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8),
    "per-channel s8/s8 symmetric": dict(per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}),
    "per-tensor u8/s8 asymmetric weights": dict(per_channel=False, activation_type=QuantType.QUInt8,
                                                weight_type=QuantType.QInt8, extra_options={"WeightSymmetric": False}),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_static_quantized_mlp_matches_onnxruntime(options, tmp_path):
    """MatMul, Add (bias and residual-like) and Mul groups: ONNX Runtime's QLinearMatMul,
    QLinearAdd and QLinearMul arithmetic, not the float ops' (which differ by whole steps)."""
    model = static_quantized(mlp_model(seed=3, in_features=64, hidden=96), tmp_path, (16, 64), **options)
    fused = {node.op_type for node in fuse_qdq_groups(model).graph.node}
    assert {"QLinearMatMul", "QLinearAdd"} <= fused and "MatMul" not in fused
    x = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32) * 2
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("options", list(OPTIONS.values())[:3], ids=list(OPTIONS.keys())[:3])
def test_static_quantized_conv_matches_onnxruntime(options, tmp_path):
    model = static_quantized(conv_model(), tmp_path, (1, 3, 16, 16), **options)
    assert "QLinearConv" in {node.op_type for node in fuse_qdq_groups(model).graph.node}
    x = np.random.default_rng(6).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert_matches_onnxruntime(model, {model.graph.input[0].name: x})


def hardswish_convs_model(channels: int = 16) -> onnx.ModelProto:
    """x -> Conv(3x3) -> HardSwish -> Conv(1x1) -> HardSwish: a MobileNet's layers."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h1"], name="hardswish1"),
             helper.make_node("Conv", ["h1", "w2", "b2"], ["c2"], name="conv2"),
             helper.make_node("HardSwish", ["c2"], ["y"], name="hardswish2")]
    return two_conv_model(nodes, channels, 1, opset=14)


def test_a_quantized_conv_computes_what_follows_it_up_to_the_next_conv_in_its_kernel(tmp_path):
    """Each QLinearConv's requantization, the DequantizeLinear, HardSwish and QuantizeLinear
    after it run on the conv's output tile: one kernel per conv (they were kernels of their
    own, each reading the map back), the first reading the quantized input's bytes itself
    (passes/absorb_dequantized_inputs.py), and the values stay ONNX Runtime's."""
    model = static_quantized(hardswish_convs_model(), tmp_path, (1, 3, 16, 16), **OPTIONS["per-channel u8/s8"])
    path = save(model, tmp_path / "layers_qdq.onnx")
    fused = api.inspect_model(path).fused_ops
    convs = [name for name in fused if "conv2d" in name]
    assert len(convs) == 2 and all("_elementwise" in name for name in convs)
    assert sum(name.endswith("_dequantized") for name in convs) == 1
    assert not {"round", "clip", "dequantize", "requantize", "cast", "subtract"} & set(fused)
    model = load(api.compile_model(path, output_dir=tmp_path / "build").artifact)
    x = np.random.default_rng(6).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(model.run({"x": x})["y"], ort_outputs(path, {"x": x})["y"], rtol=0, atol=1e-5)


def test_a_quantized_cnn_matches_onnxruntime_with_its_convs_as_int8_kernels_where_the_host_has_vnni(tmp_path):
    """The 1x1 conv of 64 channels is a uint8 x int8 kernel where the host has AVX512-VNNI (on
    AMX tiles where it has AMX-INT8: passes/int8_convs.py), a float32 conv of whole numbers
    elsewhere: the same values either way, ONNX Runtime's."""
    model = static_quantized(hardswish_convs_model(channels=64), tmp_path, (1, 3, 16, 16),
                             **OPTIONS["per-channel u8/s8"])
    path = save(model, tmp_path / "wide_qdq.onnx")
    result = api.compile_model(path, output_dir=tmp_path / "build")
    int8_kernels = [name for name in api.inspect_model(path).fused_ops if name.startswith("int8_conv2d")]
    assert len(int8_kernels) == (1 if has_vnni(api.resolve_config(None).tvm_target()) else 0)
    x = np.random.default_rng(8).standard_normal((1, 3, 16, 16)).astype(np.float32)
    got = load(result.artifact).run({"x": x})["y"]
    np.testing.assert_allclose(got, ort_outputs(path, {"x": x})["y"], rtol=0, atol=1e-5)


def conv_pair_model(channels: int, middle: int, out: int, height: int, width: int, stride: int, padding: int,
                    second_kernel: int) -> onnx.ModelProto:
    """x [1, channels, height, width] -> Conv(3x3, stride, padding) to ``middle`` channels -> Relu
    -> Conv(``second_kernel`` square, same padding) to ``out`` -> Relu."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name) for name, shape in (
        ("w1", (middle, channels, 3, 3)), ("b1", (middle,)), ("w2", (out, middle, second_kernel, second_kernel)),
        ("b2", (out,)))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], strides=[stride] * 2, pads=[padding] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[second_kernel // 2] * 4),
             helper.make_node("Relu", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "convs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, height, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


# conv_pair_model's arguments, and how many of its two convs become int8 kernels
VNNI_CONVS = {
    # the second conv on 9 x 7 pixels (one-row register tiles) to 24 channels (padded to 32); the
    # first reads the model input's 24 channels in NCHW, converted pixel major
    "stride-2-odd-pixels-24-channels": ((24, 48, 24, 17, 13, 2, 1, 3), 2),
    "unpadded-8x17-flat-rows": ((32, 64, 24, 10, 19, 1, 0, 1), 2),  # 17 columns: rows not per output row
    "padded-3x3-then-1x1": ((16, 80, 16, 12, 12, 1, 1, 1), 2),
}


@pytest.mark.skipif(not has_vnni(tvm.target.Target(host_target())), reason="the host CPU has no AVX512-VNNI")
@pytest.mark.parametrize("layers", VNNI_CONVS, ids=list(VNNI_CONVS))
def test_quantized_convs_on_vnni_registers_match_onnxruntime_and_the_unfused_module(layers, tmp_path):
    """Built for the host less its AMX (what Zen 4 or Ice Lake runs): the quantized convs are int8
    kernels that Int8MatmulVnni puts on ``vpdpbusd`` register tiles, with no AMX tile
    instruction, and give ONNX Runtime's values and the unfused module's."""
    arguments, int8_convs = VNNI_CONVS[layers]
    channels, *_, height, width, _, _, _ = arguments
    model = static_quantized(conv_pair_model(*arguments), tmp_path, (1, channels, height, width),
                             **OPTIONS["per-channel u8/s8"])
    path = save(model, tmp_path / "convs_qdq.onnx")
    config = dataclasses.replace(load_config(None), target=host_target_without_amx())
    session = ModelSession(path)
    rules = session.scheduled(config, tuning_log=False).schedule_rules
    int8_kernels = [rule for name, rule in rules.items() if name.startswith("fused_int8_conv2d")]
    assert int8_kernels == ["Int8MatmulVnni"] * int8_convs
    executable = session.built(config, tuning_log=False)
    assembly = executable.mod.imports[0].inspect_source("s")
    assert "vpdpbusd" in assembly and "tdpbusd" not in assembly
    x = np.random.default_rng(8).standard_normal((1, channels, height, width)).astype(np.float32)
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    expected = ort_outputs(path, {"x": x})["y"]
    assert len(np.unique(expected)) > 50  # a spread: the check means something
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    (unfused,) = run_imported(model, {"x": x})
    np.testing.assert_array_equal(got, unfused)


def unoptimized_onnxruntime(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("op", ["Add", "Mul"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qdq_group_equals_onnxruntime_where_float_ops_would_not(op, dtype):
    """DequantizeLinear x2 -> op -> QuantizeLinear on every pair of input values (MatMul: many
    rows): ONNX Runtime's integer kernel rounds some outputs a step away from what the float ops
    give (checked here against ONNX Runtime unoptimized), and we must give its values."""
    values = np.arange(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1).astype(dtype)
    zero = (lambda v: np.array(v, dtype))
    if op == "MatMul":
        rng = np.random.default_rng(8)
        a = rng.integers(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1, (512, 64)).astype(dtype)
        b_init = numpy_helper.from_array(rng.integers(-127, 128, (64, 32)).astype(np.int8), "b")
        b_scale, b_zero, output_scale = np.float32(0.0071), np.int8(0), np.float32(0.93)
        inputs = [helper.make_tensor_value_info("a", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(a.shape))]
        feeds = {"a": a}
    else:
        a, b = (v.reshape(1, -1) for v in np.meshgrid(values, values))
        b_init, b_scale, b_zero = None, np.float32(0.047), zero(-3 if dtype == np.int8 else 140)
        output_scale = np.float32(0.06 if op == "Add" else 0.093)
        inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(a.shape))
                  for n in ("a", "b")]
        feeds = {"a": a, "b": b}
    nodes = [helper.make_node("DequantizeLinear", ["a", "sa", "za"], ["fa"]),
             helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["fb"]),
             helper.make_node(op, ["fa", "fb"], ["f"], name="op"),
             helper.make_node("QuantizeLinear", ["f", "sc", "zc"], ["c"])]
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in (
        ("sa", np.float32(0.031)), ("za", zero(5)), ("sb", b_scale), ("zb", b_zero), ("sc", output_scale),
        ("zc", zero(2 if dtype == np.int8 else 128)))] + ([b_init] if b_init is not None else [])
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("c", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    expected = reference_outputs(model, feeds)["c"]
    assert np.any(expected != unoptimized_onnxruntime(model, feeds)[0])  # the float ops would fail this test
    (got,) = run_imported(model, feeds)
    np.testing.assert_array_equal(got, expected)


def test_groups_onnxruntime_keeps_float_stay_float():
    """A MatMul whose output is read by more than a QuantizeLinear is no group."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"]),
             helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]),
             helper.make_node("Relu", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [2, 4])],
                              [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("mq", "y")],
                              [numpy_helper.from_array(rng.integers(0, 255, (4, 3)).astype(np.uint8), "wq"),
                               numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.uint8(3), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert fuse_qdq_groups(model) is model
