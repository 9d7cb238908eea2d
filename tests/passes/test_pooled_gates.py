"""A squeeze-and-excitation gate spelled through ops no fixed pattern lists (a quantized model's
Q/DQ pairs) is one ``squeeze_excitation.pooled_gate`` composite (passes/pooled_gates.py)."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("squeeze_excitation")], report)(mod), report


def test_the_pool_and_every_op_on_the_pooled_values_are_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 6, 6), "float32"), w: R.Tensor((8, 8, 1, 1), "float32")):
            with R.dataflow():
                lv = R.mean(x, axis=[2, 3], keepdims=True)
                lv1 = R.multiply(lv, R.const(20.0, "float32"))
                lv2 = R.round(lv1)
                lv3 = R.subtract(lv2, R.const(3.0, "float32"))
                lv4 = R.nn.conv2d(lv3, w)
                lv5 = R.sigmoid(lv4)
                gv = R.multiply(x, lv5)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_pooled_gate(map: R.Tensor((1, 8, 6, 6), "float32"), gate_param_0: R.Tensor((), "float32"),
                              gate_param_1: R.Tensor((), "float32"), w: R.Tensor((8, 8, 1, 1), "float32")
                              ) -> R.Tensor((1, 8, 1, 1), "float32"):
            R.func_attr({"Composite": "squeeze_excitation.pooled_gate", "Primitive": True})
            with R.dataflow():
                lv = R.mean(map, axis=[2, 3], keepdims=True)
                lv1 = R.multiply(lv, gate_param_0)
                lv2 = R.round(lv1)
                lv3 = R.subtract(lv2, gate_param_1)
                lv4 = R.nn.conv2d(lv3, w)
                lv5 = R.sigmoid(lv4)
                R.output(lv5)
            return lv5

        @R.function
        def main(x: R.Tensor((1, 8, 6, 6), "float32"), w: R.Tensor((8, 8, 1, 1), "float32")
                 ) -> R.Tensor((1, 8, 6, 6), "float32"):
            cls = Expected
            with R.dataflow():
                lv5 = cls.fused_pooled_gate(x, R.const(20.0, "float32"), R.const(3.0, "float32"), w)
                gv = R.multiply(x, lv5)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    (instance,) = report.instances
    assert instance.variant == "squeeze_excitation.pooled_gate"
    assert instance.absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5"]


def test_must_not_merge_a_classifier_head():
    """A pool, a flatten and a dense layer end in logits, not in a gate of the pool's shape."""
    @I.ir_module
    class Head:
        @R.function
        def main(x: R.Tensor((1, 8, 6, 6), "float32"), w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                lv = R.mean(x, axis=[2, 3], keepdims=True)
                lv1 = R.reshape(lv, R.shape([1, 8]))
                lv2 = R.matmul(lv1, w)
                lv3 = R.multiply(lv2, R.const(0.5, "float32"))
                gv = R.sigmoid(lv3)
                R.output(gv)
            return gv

    after, report = fuse(Head)
    tvm.ir.assert_structural_equal(after, Head)
    assert not report.instances


def gate_module(channels: int = 8, leak: bool = False, weights: bool = True):
    """pool -> round(x * 20) -> [1x1 conv ->] sigmoid -> scale the map; ``leak``: the rounded
    pool is also an output."""
    x = relax.Var("x", relax.TensorType((1, channels, 6, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pooled = bb.emit(relax.op.mean(x, axis=[2, 3], keepdims=True))
            rounded = bb.emit(relax.op.round(relax.op.multiply(pooled, relax.const(20.0, "float32"))))
            value = rounded
            if weights:
                w = np.random.default_rng(0).normal(size=(channels, channels, 1, 1)).astype("float32")
                value = bb.emit(relax.op.nn.conv2d(value, relax.const(w)))
            gate = bb.emit(relax.op.sigmoid(value))
            scaled = bb.emit(relax.op.multiply(x, gate))
            gv = bb.emit_output(relax.Tuple([scaled, rounded]) if leak else scaled)
        bb.emit_func_output(gv)
    return bb.get()


def test_a_gate_with_weights_is_one_composite():
    after, report = fuse(gate_module())
    assert [i.variant for i in report.instances] == ["squeeze_excitation.pooled_gate"]


@pytest.mark.parametrize("case", [
    pytest.param(dict(leak=True), id="an intermediate is also an output"),
    pytest.param(dict(weights=False), id="no squeeze or excitation by weights (a pool's arithmetic alone)"),
    pytest.param(dict(channels=320), id="weights past what the gate kernel computes well (320 x 320)"),
])
def test_must_not_merge(case):
    before = gate_module(**case)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.instances
