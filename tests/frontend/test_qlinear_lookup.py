"""com.microsoft QOperator ops that ONNX Runtime computes through tables and float passes
(frontend/qlinear_lookup.py), QLinearGlobalAveragePool and DynamicQuantizeMatMul
(frontend/qoperator.py), against ONNX Runtime bit for bit: every one of the 256 input values
where the op is a table."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from helpers import assert_fused_matches_references, run_imported
from test_qoperator import MS, assert_equal_to_onnxruntime, const, finish, integers, tensor
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.frontend.qdq_fusion import fuse_qdq_groups
from tvm_fusion.verify import reference_outputs

ALL_VALUES = {dtype: np.arange(np.iinfo(dtype).min, int(np.iinfo(dtype).max) + 1).astype(dtype).reshape(1, 256)
              for dtype in (np.uint8, np.int8)}


def zero(dtype, value):
    return np.array(value if dtype == np.uint8 else value - 128, dtype)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("x_scale, y_scale", [(0.05, 1 / 256), (0.11, 0.0041), (0.0173, 0.0023)])
def test_qlinear_sigmoid_equals_onnxruntime_on_every_value(dtype, x_scale, y_scale):
    node = helper.make_node("QLinearSigmoid", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS)
    model = finish([node], [tensor("x", dtype, [1, 256])], [tensor("y", dtype, [1, 256])],
                   [const("sx", np.float32(x_scale)), const("zx", zero(dtype, 131)), const("sy", np.float32(y_scale)),
                    const("zy", zero(dtype, 0 if y_scale == 1 / 256 else 9))])
    assert_equal_to_onnxruntime(model, {"x": ALL_VALUES[dtype]})


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("alpha", [0.01, 0.1, 0.3])
def test_qlinear_leaky_relu_equals_onnxruntime_on_every_value(dtype, alpha):
    node = helper.make_node("QLinearLeakyRelu", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, alpha=alpha)
    model = finish([node], [tensor("x", dtype, [1, 256])], [tensor("y", dtype, [1, 256])],
                   [const("sx", np.float32(0.037)), const("zx", zero(dtype, 140)), const("sy", np.float32(0.029)),
                    const("zy", zero(dtype, 101))])
    assert_equal_to_onnxruntime(model, {"x": ALL_VALUES[dtype]})


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_concat_equals_onnxruntime_on_every_value(dtype):
    """Three inputs: requantized from a larger and a smaller scale, and one already in the
    output's scale and zero point (copied)."""
    names = ["sy", "zy", "a", "sa", "za", "b", "sb", "zb", "c", "sy", "zy"]
    node = helper.make_node("QLinearConcat", names, ["y"], domain=MS, axis=0)
    model = finish([node], [tensor(n, dtype, [1, 256]) for n in "abc"], [tensor("y", dtype, [3, 256])],
                   [const("sy", np.float32(0.043)), const("zy", zero(dtype, 120)), const("sa", np.float32(0.0917)),
                    const("za", zero(dtype, 133)), const("sb", np.float32(0.0129)), const("zb", zero(dtype, 77))])
    values = ALL_VALUES[dtype]
    assert_equal_to_onnxruntime(model, {"a": values, "b": values[:, ::-1].copy(), "c": np.roll(values, 5, axis=1)})


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
    dict(kernel_shape=[2, 3], strides=[2, 1], pads=[0, 1, 1, 0], ceil_mode=1),
    dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], channels_last=1),
], ids=["pads", "count-pads", "ceil", "channels-last"])
def test_qlinear_average_pool_equals_onnxruntime(dtype, attrs):
    shape = [1, 9, 11, 6] if attrs.get("channels_last") else [1, 6, 9, 11]
    node = helper.make_node("QLinearAveragePool", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, **attrs)
    model = finish([node], [tensor("x", dtype, shape)], [tensor("y", dtype, None)],
                   [const("sx", np.float32(0.0231)), const("zx", zero(dtype, 119)), const("sy", np.float32(0.0117)),
                    const("zy", zero(dtype, 131))])
    expected = reference_outputs(model, {"x": integers(np.random.default_rng(0), dtype, shape)})
    model.graph.output[0].CopyFrom(tensor("y", dtype, list(expected["y"].shape)))
    assert_equal_to_onnxruntime(model, {"x": integers(np.random.default_rng(0), dtype, shape)})


@pytest.mark.parametrize("dtype, channels_last", [(np.uint8, False), (np.int8, False), (np.uint8, True)])
def test_qlinear_global_average_pool_equals_onnxruntime(dtype, channels_last):
    shape = [2, 7, 5, 16] if channels_last else [2, 16, 7, 5]
    out = [2, 1, 1, 16] if channels_last else [2, 16, 1, 1]
    node = helper.make_node("QLinearGlobalAveragePool", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS,
                            channels_last=int(channels_last))
    model = finish([node], [tensor("x", dtype, shape)], [tensor("y", dtype, out)],
                   [const("sx", np.float32(0.0231)), const("zx", zero(dtype, 119)), const("sy", np.float32(0.0037)),
                    const("zy", zero(dtype, 131))])
    rng = np.random.default_rng(1)
    # values around x's zero point, shifted per channel so that the means spread over y's range
    center = int(zero(dtype, 119)) + rng.uniform(-20, 20, out)
    x = np.clip(np.round(center + rng.normal(0, 40, shape)), np.iinfo(dtype).min, np.iinfo(dtype).max).astype(dtype)
    assert_equal_to_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("per_channel, with_bias, with_zero_point", [(True, True, False), (False, False, True),
                                                                     (True, False, False)])
def test_dynamic_quantize_matmul_equals_onnxruntime(per_channel, with_bias, with_zero_point):
    rng = np.random.default_rng(3)
    k, n = 48, 20
    names = ["a", "b", "sb", "zb" if with_zero_point else "", "bias" if with_bias else ""]
    node = helper.make_node("DynamicQuantizeMatMul", names, ["y"], domain=MS)
    inits = [const("b", integers(rng, np.int8, (k, n))),
             const("sb", rng.uniform(0.002, 0.01, n if per_channel else 1).astype(np.float32))]
    if with_zero_point:
        inits.append(const("zb", np.zeros(n if per_channel else 1, np.int8)))
    if with_bias:
        inits.append(const("bias", rng.standard_normal(n).astype(np.float32)))
    model = finish([node], [tensor("a", np.float32, [3, 7, k])], [tensor("y", np.float32, [3, 7, n])], inits)
    feeds = {"a": rng.standard_normal((3, 7, k)).astype(np.float32)}
    np.testing.assert_array_equal(run_imported(model, feeds)[0], reference_outputs(model, feeds)["y"])


def small_cnn() -> onnx.ModelProto:
    """Conv -> LeakyRelu -> AveragePool, then a Sigmoid and a Relu branch, Concat,
    GlobalAveragePool, Gemm: each op ``quantize_static`` writes as a QOperator one."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32),
                                       name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["c1"], ["l1"], alpha=0.1),
             helper.make_node("AveragePool", ["l1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["s2"]),
             helper.make_node("Conv", ["p1", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Concat", ["s2", "r3"], ["cat"], axis=1),
             helper.make_node("GlobalAveragePool", ["cat"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], transB=1)]
    inits = [weight("w1", 16, 3, 3, 3), weight("b1", 16), weight("w2", 16, 16, 3, 3), weight("b2", 16),
             weight("w3", 16, 16, 3, 3), weight("b3", 16), weight("w4", 10, 32), weight("b4", 10)]
    graph = helper.make_graph(nodes, "cnn", [tensor("x", np.float32, [1, 3, 32, 32])],
                              [tensor("y", np.float32, [1, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Calibration(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(1)
        self._batches = iter([{"x": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self._batches, None)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_qoperator_cnn_compiles_and_equals_onnxruntime(tmp_path, per_channel):
    """``quantize_static(quant_format=QOperator)`` of a small CNN, compiled with the default
    config: the same floats as ONNX Runtime's (its outputs are dequantized integers)."""
    onnx.save(small_cnn(), tmp_path / "float.onnx")
    quantize_static(tmp_path / "float.onnx", tmp_path / "qop.onnx", _Calibration(), quant_format=QuantFormat.QOperator,
                    per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    model = onnx.load(tmp_path / "qop.onnx")
    ops = {node.op_type for node in model.graph.node}
    assert {"QLinearLeakyRelu", "QLinearAveragePool", "QLinearSigmoid", "QLinearConcat",
            "QLinearGlobalAveragePool", "QGemm"} <= ops
    prepared = api.prepare(tmp_path / "qop.onnx", load_config(None), input_shapes="x:1x3x32x32")
    optimized = api.optimize(prepared, tuning_log=False)
    inputs = {"x": np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    (fused,) = assert_fused_matches_references(model, prepared, optimized, inputs, rtol=0, atol=0)
    assert len(np.unique(fused)) > 5


@pytest.mark.parametrize("op, attrs", [("Sigmoid", {}), ("LeakyRelu", {"alpha": 0.2}),
                                       ("AveragePool", {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]}),
                                       ("GlobalAveragePool", {}), ("Concat", {"axis": 1}), ("Softmax", {})])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_a_qdq_group_runs_as_onnxruntime_s_qlinear_op(op, attrs, dtype):
    """DequantizeLinear -> op -> QuantizeLinear: ONNX Runtime runs it as com.microsoft
    QLinear<op> (frontend/qdq_fusion.py), and so do we, to its values."""
    inputs = ["a", "b"] if op == "Concat" else ["a"]
    nodes = [helper.make_node("DequantizeLinear", [name, f"s{name}", f"z{name}"], [f"{name}f"]) for name in inputs]
    nodes += [helper.make_node(op, [f"{name}f" for name in inputs], ["yf"], **attrs),
              helper.make_node("QuantizeLinear", ["yf", "sy", "zy"], ["y"])]
    inits = [const("sa", np.float32(0.047)), const("za", zero(dtype, 137)), const("sb", np.float32(0.021)),
             const("zb", zero(dtype, 90))][:2 * len(inputs)]
    inits += [const("sy", np.float32(0.013 if op not in ("Sigmoid", "Softmax") else 1 / 256)),
              const("zy", zero(dtype, 125 if op not in ("Sigmoid", "Softmax") else 0))]
    shape = [1, 4, 16, 16]
    rng = np.random.default_rng(4)
    feeds = {name: integers(rng, dtype, shape) for name in inputs}
    feeds["a"].reshape(-1)[:256] = ALL_VALUES[dtype].reshape(-1)
    model = finish(nodes, [tensor(name, dtype, shape) for name in inputs], [tensor("y", dtype, None)], inits, opset=19)
    model.graph.output[0].CopyFrom(tensor("y", dtype, list(reference_outputs(model, feeds)["y"].shape)))
    assert f"QLinear{op}" in {node.op_type for node in fuse_qdq_groups(model).graph.node}
    expected = reference_outputs(model, feeds)["y"]
    np.testing.assert_array_equal(run_imported(model, feeds)[0], expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("opset, axis, shape", [(13, -1, [4, 2, 256]), (13, 1, [2, 256, 3]), (11, 1, [2, 4, 64])])
def test_qlinear_softmax_equals_onnxruntime(dtype, opset, axis, shape):
    """Rows holding every input value (and random ones), a softmax over the last axis, over an
    inner one (opset 13) and over all axes from ``axis`` on (opset 11)."""
    node = helper.make_node("QLinearSoftmax", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, axis=axis, opset=opset)
    zy = zero(dtype, 0)
    model = finish([node], [tensor("x", dtype, shape)], [tensor("y", dtype, shape)],
                   [const("sx", np.float32(0.0713)), const("zx", zero(dtype, 120)), const("sy", np.float32(1 / 256)),
                    const("zy", zy)])
    x = integers(np.random.default_rng(5), dtype, shape)
    x.reshape(-1)[:256] = ALL_VALUES[dtype].reshape(-1)
    assert_equal_to_onnxruntime(model, {"x": x})


# A row of attention scores (smart-turn-v3-qdq's first QLinearSoftmax, seed 0) on which a table
# built with a double-precision log(FLT_MAX / 400) rounds one output a step off ONNX Runtime's.
_NEAR_TIE_ROW = ("a28262566b8fab976942405476856c4b39527da2a08b6f6a83a6ae9f795758738c9276544f6e92afa9876e7090aeb99d"
                 "775e6682968e714e4b66899b8d705c68869795784e3b476271633c2122446e7d6b4c46577b9592744d4358798472533d"
                 "4f76969e8b6a657ea2b5a77d5f5668797c65402d395b7b7c654740617c8e744e30324d69664a2f213f63837f64555e7f"
                 "9fac8f6d58647c8c875f44466288a2997b677a9cb2b697776a7996a6937658587aa1ae987e7889a6c4b6957168799093"
                 "7a563d5174919183676181a4b8ad876e7290aba89372647da6c0c1ae9ba2b7e2eed4b59b9bb6cabc9d796d7a9faaa087"
                 "6d789ab5b9996f5f6b829484634648688a998c70667ca2c0bfa3827586a7ae9b745b5b819fa694717186aab8b795726c"
                 "7a999c845d4854758d93795f5f789ba9977b58597286815d342e35586e6a503b3e6185907d58444e6b85755a3b365272"
                 "8a7c60576b93b1b599786c799cad966c514f66868b795748597e9a9375524a5c767a613e272b4c6972503f465f879f98"
                 "7861648197967b5c485a7d969177606b")


def test_qlinear_softmax_table_shift_is_a_float_log():
    """ONNX Runtime computes the table's shift with C++'s float log: on this row the double
    log's table gives one output a step off."""
    row = np.frombuffer(bytes.fromhex(_NEAR_TIE_ROW), np.uint8).reshape(1, 400)
    node = helper.make_node("QLinearSoftmax", ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, axis=-1, opset=13)
    model = finish([node], [tensor("x", np.uint8, [1, 400])], [tensor("y", np.uint8, [1, 400])],
                   [const("sx", np.float32(0.2081935852766037)), const("zx", np.uint8(114)),
                    const("sy", np.float32(0.0038751268293708563)), const("zy", np.uint8(0))])
    np.testing.assert_array_equal(run_imported(model, {"x": row})[0], reference_outputs(model, {"x": row})["y"])
