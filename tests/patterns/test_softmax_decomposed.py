"""Decomposed stable softmax (jax through jax2tf) -> nn.softmax: the spellings, the declines,
and the numbers against ONNX Runtime (-inf entries and an all -inf row included)."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from rewrite_helpers import apply_rule
from test_skip_layernorm import compile_and_run
from tvm_fusion import api
from tvm_fusion.config import load_config

# Stated tolerances: float32; the fast-math exp is within ~4e-6 relative of libm's.
RTOL, ATOL = 1e-4, 1e-5


@I.ir_module
class JaxExport:
    """jax.nn.softmax over the last axis of [2, 8] as jax2tf writes it, imported by TVM (after
    stacked_max_min): max and sum without keepdims, reshaped back, the max clamped by -inf."""

    @R.function
    def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
        with R.dataflow():
            lv = R.max(x, axis=[1], keepdims=False)
            lv1 = R.maximum(R.const(float("-inf"), "float32"), lv)
            lv2 = R.reshape(lv1, R.shape([2, 1]))
            lv3 = R.subtract(x, lv2)
            lv4 = R.exp(lv3)
            lv5 = R.sum(lv4, axis=[1], keepdims=False)
            lv6 = R.reshape(lv5, R.shape([2, 1]))
            gv = R.divide(lv4, lv6)
            R.output(gv)
        return gv


def test_jax_export_becomes_softmax():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                gv = R.nn.softmax(x, axis=-1)
                R.output(gv)
            return gv

    after, report = apply_rule(JaxExport, "softmax_decomposed")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["softmax_decomposed"] == 1
    [instance] = report.instances
    assert instance.absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6", "gv"]


def decomposed(shape=(2, 3, 8), axis=-1, sum_axis=None, keepdims=False, restore="reshape", clamp="first",
               floor=float("-inf"), max_axes=None):
    """exp(x - [maximum(floor,] max(x)[)]) / sum(exp(...)), one spelling at a time. ``restore``
    (without keepdims): reshape | expand_dims; ``clamp``: first (floor first) | second | None."""
    rank = len(shape)
    axis = axis % rank
    kept = [1 if i == axis else d for i, d in enumerate(shape)]
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()

    def back(t, axes):
        if keepdims:
            return t
        if restore == "reshape":
            return bb.emit(relax.op.reshape(t, kept))
        return bb.emit(relax.op.expand_dims(t, axes))

    with bb.function("main", [x]):
        with bb.dataflow():
            row_max = bb.emit(relax.op.max(x, axis=list(max_axes or [axis]), keepdims=keepdims))
            low = relax.const(floor, "float32")
            if clamp:
                clamped = relax.op.maximum(low, row_max) if clamp == "first" else relax.op.maximum(row_max, low)
                row_max = bb.emit(clamped)
            exp = bb.emit(relax.op.exp(bb.emit(relax.op.subtract(x, back(row_max, list(max_axes or [axis]))))))
            row_sum = bb.emit(relax.op.sum(exp, axis=[sum_axis if sum_axis is not None else axis], keepdims=keepdims))
            out = bb.emit_output(relax.op.divide(exp, back(row_sum, [axis])))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("kwargs, axis", [
    ({}, -1),
    ({"keepdims": True, "clamp": None}, -1),  # the classic decomposed softmax
    ({"restore": "expand_dims", "clamp": "second"}, -1),
    ({"axis": 1}, -2),  # over an outer axis (SoftmaxOverOuterAxis schedules it)
    ({"shape": (5, 8), "axis": 0, "keepdims": True}, -2),
])
def test_spellings_become_softmax(kwargs, axis):
    before = decomposed(**kwargs)
    after, report = apply_rule(before, "softmax_decomposed")
    assert report.fired["softmax_decomposed"] == 1, report.near_misses
    (binding,) = after["main"].body.blocks[0].bindings
    assert binding.value.op.name == "relax.nn.softmax" and int(binding.value.attrs.axis) == axis
    x = np.random.default_rng(0).standard_normal([int(d) for d in before["main"].params[0].ty.shape]) * 4
    x = x.astype("float32")
    np.testing.assert_allclose(compile_and_run(after, [x]), compile_and_run(before, [x]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kwargs, reason", [
    ({"floor": 0.0}, "the row maximum is clamped at 0.0, not -inf: that shifts rows below it (and can underflow them)"),
    ({"keepdims": True, "axis": 1, "sum_axis": 2}, "the maximum is over axis 1, the sum over axes [2]"),
    ({"keepdims": True, "max_axes": [1, 2]}, "the maximum is over axes [1, 2]: a softmax reduces one axis"),
])
def test_must_not_rewrite(kwargs, reason):
    before = decomposed(**kwargs)
    after, report = apply_rule(before, "softmax_decomposed")
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [m.reason for m in report.near_misses] == [reason]


def jax2tf_softmax(shape) -> onnx.ModelProto:
    """jax.nn.softmax as tf2onnx writes it after jax2tf: ReduceMax (no keepdims), Max(-inf, .)
    of two, Reshape back, Sub, Exp, ReduceSum (no keepdims), Reshape back, Div."""
    kept = [*shape[:-1], 1]
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], axes=[-1], keepdims=0),
        helper.make_node("Max", ["floor", "m"], ["m2"]),
        helper.make_node("Reshape", ["m2", "kept"], ["m_kept"]),
        helper.make_node("Sub", ["x", "m_kept"], ["shifted"]),
        helper.make_node("Exp", ["shifted"], ["e"]),
        helper.make_node("ReduceSum", ["e", "axis"], ["s"], keepdims=0),
        helper.make_node("Reshape", ["s", "kept"], ["s_kept"]),
        helper.make_node("Div", ["e", "s_kept"], ["y"]),
    ]
    initializers = [numpy_helper.from_array(np.array(-np.inf, np.float32), "floor"),
                    numpy_helper.from_array(np.array(kept, np.int64), "kept"),
                    numpy_helper.from_array(np.array([-1], np.int64), "axis")]
    graph = helper.make_graph(nodes, "jax2tf_softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_jax2tf_softmax_matches_onnxruntime(tmp_path):
    """Partly -inf rows and an all -inf row (NaN in ONNX Runtime and here)."""
    shape = [3, 4, 40]
    model = jax2tf_softmax(shape)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared, tuning_log=False)
    assert optimized.report.fired["softmax_decomposed"] == 1, optimized.report.near_misses
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    x[rng.random(shape) < 0.2] = -np.inf
    x[2, 3, :] = -np.inf
    (fused,) = helpers.assert_fused_matches_references(model, prepared, optimized, {"x": x}, RTOL, ATOL)
    assert np.isnan(fused[2, 3]).all() and not np.isnan(fused[:2]).any()
