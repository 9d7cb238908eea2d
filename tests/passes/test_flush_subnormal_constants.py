"""FlushSubnormalConstants: float32 constants lose their subnormal values (zeros of the same
sign), nothing else changes; a conv whose weights hold subnormals still matches ONNX Runtime
and the unfused module."""

import dataclasses

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.flush_subnormal_constants import FlushSubnormalConstants, flushed, subnormal_count

SUBNORMAL = np.float32(1e-40)
# Stated tolerances: float32 sums of 72 products in another order than ONNX Runtime's; a
# flushed weight changes a sum by less than 1e-40 times an input.
RTOL, ATOL = 1e-5, 1e-5


def _module(*constants: np.ndarray) -> tvm.IRModule:
    """``main(x) = x + c0 + c1 ..``, each constant a Relax constant."""
    x = relax.Var("x", relax.TensorType(constants[0].shape, str(constants[0].dtype)))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = x
            for constant in constants:
                out = builder.emit(relax.op.add(out, relax.const(constant)))
            out = builder.emit_output(out)
        builder.emit_func_output(out)
    return builder.get()


def _constants(mod: tvm.IRModule) -> list:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, tvm.ir.GenericConst) else None)
    return found


def test_subnormal_values_become_zeros_of_their_sign():
    values = np.array([1.5, SUBNORMAL, -SUBNORMAL, 0.0, -2e-38, np.finfo(np.float32).tiny], np.float32)
    before = _module(values)
    expected = _module(np.array([1.5, 0.0, -0.0, 0.0, -2e-38, np.finfo(np.float32).tiny], np.float32))
    after = FlushSubnormalConstants()(before)
    tvm.ir.assert_structural_equal(after, expected)
    (constant,) = _constants(after)
    np.testing.assert_array_equal(np.signbit(constant.value.numpy()), [False, False, True, False, True, False])


def test_must_not_flush_normal_or_float16_constants():
    # Float16 subnormals (below 6.1e-5) are ordinary values there, and convert without an assist.
    normal = np.array([1.0, -3.0, 1e-37], np.float32)
    half = np.array([1e-6, 3e-7, 1.0], np.float16)
    for values in (normal, half):
        before = _module(values)
        after = FlushSubnormalConstants()(before)
        assert _constants(after)[0].same_as(_constants(before)[0])


def _shared_constant_module(values: np.ndarray) -> tvm.IRModule:
    """``main(x) = (x + c) * c``, one constant ``c`` read twice."""
    shared = relax.const(values)
    x = relax.Var("x", relax.TensorType(values.shape, "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            first = builder.emit(relax.op.add(x, shared))
            out = builder.emit_output(relax.op.multiply(first, shared))
        builder.emit_func_output(out)
    return builder.get()


def test_a_shared_constant_stays_one_constant():
    first, second = _constants(FlushSubnormalConstants()(_shared_constant_module(np.array([SUBNORMAL, 1.0], np.float32))))
    assert first.same_as(second)
    np.testing.assert_array_equal(first.value.numpy(), [0.0, 1.0])


def test_flushed_returns_none_without_subnormals():
    assert flushed(np.ones(4, np.float32)) is None
    assert flushed(np.array([SUBNORMAL], np.float64)) is None  # only float32 is flushed


def _conv_model() -> onnx.ModelProto:
    """A 3x3 conv + BatchNormalization + Relu whose weights and BN scale hold subnormal values."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2
    weight.flat[::7] = SUBNORMAL * rng.choice([-1, 1], weight.size)[::7]
    scale = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    scale[3] = SUBNORMAL  # folding it into the conv makes that channel's weights subnormal or zero
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(scale, "scale"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) * 0.1, "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 2, 16).astype(np.float32), "var")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 20])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("flush", [True, False], ids=["flushed (default)", "flush_subnormals = false"])
def test_conv_with_subnormal_weights_matches_onnxruntime_and_unfused(tmp_path, flush):
    model = _conv_model()
    path = tmp_path / "conv.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, dataclasses.replace(load_config(), flush_subnormals=flush))
    optimized = api.optimize(prepared)
    left = subnormal_count(optimized.module)
    assert (left == 0) if flush else (left > 0), f"{left} subnormal values in the built module's constants"
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 8, 12, 20)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def test_subnormal_count_counts_each_constant_once():
    values = np.array([SUBNORMAL, -SUBNORMAL, 1.0], np.float32)
    assert subnormal_count(_shared_constant_module(values)) == 2  # one constant, read twice
    assert subnormal_count(_module(values, values)) == 4  # the array made into two constants
    assert subnormal_count(_module(np.array([1e-6, 3e-7], np.float16))) == 0
