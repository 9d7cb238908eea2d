"""Winograd F(m x m, 3 x 3) for blocked 3x3 convs: the transforms, which convs take it, and
whole models against ONNX Runtime and the direct conv."""

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_fused_matches_references
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.kernels.cpu_features import has_amx_int8, has_vnni
from tvm_fusion.kernels.winograd_conv2d import transform_matrices, winograd_tile


@pytest.mark.parametrize("tile", [2, 4])
def test_the_transforms_compute_a_3x3_correlation(tile):
    """A^T [(G g G^T) * (B^T d B)] A is the valid 3x3 correlation of a (tile+2)^2 input tile."""
    bt, g, at = transform_matrices(tile)
    rng = np.random.default_rng(tile)
    data, weight = rng.standard_normal((tile + 2, tile + 2)), rng.standard_normal((3, 3))
    winograd = at @ ((g @ weight @ g.T) * (bt @ data @ bt.T)) @ at.T
    direct = np.array([[np.sum(data[y:y + 3, x:x + 3] * weight) for x in range(tile)] for y in range(tile)])
    np.testing.assert_allclose(winograd, direct, rtol=1e-12, atol=1e-12)


def blocked(channels, rows, columns, block=8):
    return (1, channels // block, rows, columns, block)


@pytest.mark.parametrize("kernel, strides, dilation, groups, data, out, dtype, tile", [
    ((3, 3), (1, 1), (1, 1), 1, blocked(48, 16, 64), blocked(192, 16, 64), "float32", 4),
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 10, 14), blocked(16, 10, 14), "float32", 4),  # 3x4 tiles over 12x16
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 6, 6), blocked(16, 6, 6), "float32", 2),      # tie (4 per output): F(2x2)
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 4, 4), blocked(16, 4, 4), "float32", 2),      # one 4x4 tile: too few
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 13, 13), blocked(16, 13, 13), "float32", 4),  # odd map: 4x4 tiles
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 7, 7), blocked(16, 7, 7), "float32", 4),      # a 7x7 map, few channels
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 3, 3), blocked(16, 3, 3), "float32", 2),      # one 4x4 tile: too few
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 2, 2), blocked(16, 2, 2), "float32", 2),      # one 2x2 tile
    # With 16 lanes, transformed filters over 1 MiB and 32 values per map value ((m+2)^2 x
    # channels / pixels) stay direct; with 8 lanes Winograd stays:
    ((3, 3), (1, 1), (1, 1), 1, blocked(512, 7, 7, 16), blocked(512, 7, 7, 16), "float32", None),  # ResNet's last stage: 167
    ((3, 3), (1, 1), (1, 1), 1, blocked(512, 7, 7), blocked(512, 7, 7), "float32", 2),
    # Filters past 1 MiB stream from memory on every call: a map of fewer than 24 tiles (each
    # filter value's reuse) waits on them, and F(2x2)'s 16 values a channel pair beat F(4x4)'s 36.
    ((3, 3), (1, 1), (1, 1), 1, blocked(256, 14, 14, 16), blocked(256, 14, 14, 16), "float32", 2),  # 16 per value
    ((3, 3), (1, 1), (1, 1), 1, blocked(128, 14, 14, 16), blocked(128, 14, 14, 16), "float32", 2),  # 16 F(4x4) tiles
    ((3, 3), (1, 1), (1, 1), 1, blocked(64, 14, 14, 16), blocked(64, 14, 14, 16), "float32", 4),    # 576 KiB: in cache
    ((3, 3), (1, 1), (1, 1), 1, blocked(128, 28, 28, 16), blocked(128, 28, 28, 16), "float32", 4),  # 49 tiles: reused
    ((3, 3), (1, 1), (1, 1), 1, blocked(32, 2, 2, 16), blocked(32, 2, 2, 16), "float32", 2),  # 128 per value, but 64 KiB
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 1, 40), blocked(16, 1, 40), "float32", None),  # one row: half zeros
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 40, 1), blocked(16, 40, 1), "float32", None),  # one column
    ((3, 3), (2, 2), (1, 1), 1, blocked(16, 16, 16), blocked(16, 8, 8), "float32", None),    # strided
    ((3, 3), (1, 1), (2, 2), 1, blocked(16, 16, 16), blocked(16, 12, 12), "float32", None),  # dilated
    ((1, 1), (1, 1), (1, 1), 1, blocked(16, 16, 16), blocked(16, 16, 16), "float32", None),  # 1x1
    ((3, 3), (1, 1), (1, 1), 2, blocked(16, 16, 16), blocked(16, 16, 16), "float32", None),  # grouped
    ((3, 3), (1, 1), (1, 1), 1, blocked(8, 16, 16), blocked(32, 16, 16), "float32", None),   # 8 input channels
    ((3, 3), (1, 1), (1, 1), 1, blocked(16, 16, 16), blocked(16, 16, 16), "float16", None),
    ((3, 3), (1, 1), (1, 1), 1, None, blocked(16, 16, 16), "float32", None),                 # symbolic map
])
def test_which_convs_take_winograd(kernel, strides, dilation, groups, data, out, dtype, tile):
    assert winograd_tile(kernel, strides, dilation, groups, data, out, dtype) == tile


def conv_chain_model(channels: int, seed: int = 0) -> onnx.ModelProto:
    """3x3 conv -> Relu -> 3x3 conv + residual -> 3x3 conv at stride 2: two convs Winograd takes
    (when the map allows), one it does not."""
    rng = np.random.default_rng(seed)

    def weight(name, out_channels, in_channels):
        value = rng.standard_normal((out_channels, in_channels, 3, 3)) / np.sqrt(9 * in_channels)
        return helper.make_tensor(name, TensorProto.FLOAT, value.shape, value.astype("float32").ravel())

    def bias(name, size):
        return helper.make_tensor(name, TensorProto.FLOAT, (size,), rng.standard_normal(size).astype("float32"))

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s2"]),
        helper.make_node("Conv", ["s2", "w3", "b3"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]),
    ]
    graph = helper.make_graph(
        nodes, "conv_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, "out_height", "out_width"])],
        [weight("w1", 32, channels), bias("b1", 32), weight("w2", 32, 32), bias("b2", 32),
         weight("w3", 16, 32), bias("b3", 16)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape, winograd_kernels", [
    ("x:1x16x20x28", 2),   # F(4x4): 5 x 7 tiles
    ("x:1x16x10x14", 2),   # F(4x4) over 12x16
    ("x:1x16x9x9", 2),     # odd map: F(4x4) over 12x12
    ("x:1x16x6x6", 2),     # F(2x2)
    ("x:1x16x1x24", 0),    # one row: the direct conv
])
def test_a_conv_chain_matches_onnx_runtime_and_the_direct_conv(tmp_path, shape, winograd_kernels):
    """Against ONNX Runtime and the unfused module (rtol 1e-4, atol 1e-4: the F(4x4) transforms'
    constants up to 8 round more than the direct sum), and against the same build with
    ``winograd = false``, whose convs are all direct."""
    model = conv_chain_model(16)
    path = tmp_path / "conv_chain.onnx"
    onnx.save(model, str(path))
    config = dataclasses.replace(load_config(None), conv_layout="NCHWc")
    outputs = {}
    for winograd in (True, False):
        cfg = dataclasses.replace(config, winograd=winograd)
        prepared = api.prepare(path, cfg, input_shapes=shape)
        optimized = api.optimize(prepared, tuning_log=False)
        rules = list(optimized.schedule_rules.values())
        assert rules.count("WinogradConv2dNCHWc") == (winograd_kernels if winograd else 0)
        assert "Fallback" not in rules
        rng = np.random.default_rng(0)
        inputs = {s.name: rng.standard_normal(s.shape).astype("float32") for s in prepared.inputs}
        (outputs[winograd],) = assert_fused_matches_references(model, prepared, optimized, inputs,
                                                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outputs[True], outputs[False], rtol=1e-4, atol=1e-4)


def quantized_conv_model(op: str, channels: int = 16, seed: int = 1) -> onnx.ModelProto:
    """One 3x3 stride-1 conv as ``op``: QLinearConv (uint8 out) or ConvInteger (int32 out), or
    the float Conv of the same weights; a conv Winograd takes by its shape."""
    rng = np.random.default_rng(seed)
    weights = rng.integers(-128, 128, (16, channels, 3, 3)).astype(np.int8)
    inits = {"QLinearConv": [("sx", np.float32(0.021)), ("zx", np.uint8(117)), ("w", weights),
                             ("sw", np.float32(0.003)), ("zw", np.int8(0)),
                             ("sy", np.float32(0.063)), ("zy", np.uint8(101))],
             "ConvInteger": [("w", weights), ("zx", np.uint8(117))],
             "Conv": [("w", weights.astype(np.float32) / 128)]}[op]
    names = {"QLinearConv": ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy"], "ConvInteger": ["x", "w", "zx"],
             "Conv": ["x", "w"]}[op]
    in_type, out_type = {"QLinearConv": (TensorProto.UINT8, TensorProto.UINT8),
                         "ConvInteger": (TensorProto.UINT8, TensorProto.INT32),
                         "Conv": (TensorProto.FLOAT, TensorProto.FLOAT)}[op]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], pads=[1, 1, 1, 1])], "conv3x3",
        [helper.make_tensor_value_info("x", in_type, [1, channels, 20, 28])],
        [helper.make_tensor_value_info("y", out_type, [1, 16, 20, 28])],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["QLinearConv", "ConvInteger", "Conv"])
def test_an_integer_conv_stays_direct_and_equals_onnx_runtime(tmp_path, op):
    """A quantized conv is an integer sum in float32 (frontend/qoperator.py): exact on the
    direct conv, not through Winograd's transforms (which flip a requantized value by a step,
    or leave ConvInteger's int32 a fraction off). So with the default config it stays direct
    and equals ONNX Runtime (as the int8 kernel where the host has AVX512-VNNI, on AMX tiles
    where it has AMX-INT8: passes/int8_convs.py); a float conv of the same shape still takes
    Winograd."""
    model = quantized_conv_model(op)
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config(None), input_shapes="x:1x16x20x28")
    optimized = api.optimize(prepared, tuning_log=False)
    rules = list(optimized.schedule_rules.values())
    assert rules.count("WinogradConv2dNCHWc") == (1 if op == "Conv" else 0)
    rng = np.random.default_rng(0)
    if op == "Conv":
        inputs = {"x": rng.standard_normal((1, 16, 20, 28)).astype(np.float32)}
        assert_fused_matches_references(model, prepared, optimized, inputs, rtol=1e-4, atol=1e-4)
        return
    host = load_config(None).tvm_target()
    direct = "Int8MatmulAmx" if has_amx_int8(host) else "Int8MatmulVnni" if has_vnni(host) else "Conv2dNCHWc"
    assert rules.count(direct) == 1
    inputs = {"x": rng.integers(0, 256, (1, 16, 20, 28)).astype(np.uint8)}
    (fused,) = assert_fused_matches_references(model, prepared, optimized, inputs, rtol=0, atol=0)
    assert len(np.unique(fused)) > 10
