"""Softmax fusion: the element-wise prologue (scale, causal where, mask) and epilogue join the
softmax in one composite, where the attention fusion does not take it; it agrees with ONNX
Runtime and the unfused module."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern

REPO = Path(__file__).resolve().parents[2]
# Stated tolerances: float32; the fast-math exp is within ~4e-6 relative of libm's.
RTOL, ATOL = 1e-4, 1e-5


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("softmax")], report)(mod), report


def test_prologue_softmax_epilogue_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4, 16), "float32"), mask: R.Tensor((2, 1, 16), "float32"),
                 w: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.divide(x, R.const(4.0, "float32"))
                lv1 = R.add(lv, mask)
                lv2 = R.nn.softmax(lv1, axis=-1)
                gv = R.multiply(lv2, w)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_divide_relax_add_relax_nn_softmax_relax_multiply(
            x: R.Tensor((2, 4, 16), "float32"), param_0: R.Tensor((), "float32"),
            mask: R.Tensor((2, 1, 16), "float32"), w: R.Tensor((16,), "float32"),
        ) -> R.Tensor((2, 4, 16), "float32"):
            R.func_attr({"Composite": "softmax.scale_mask_softmax_multiply", "Primitive": True})
            with R.dataflow():
                lv = R.divide(x, param_0)
                lv1 = R.add(lv, mask)
                lv2 = R.nn.softmax(lv1, axis=-1)
                gv = R.multiply(lv2, w)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((2, 4, 16), "float32"), mask: R.Tensor((2, 1, 16), "float32"),
                 w: R.Tensor((16,), "float32")) -> R.Tensor((2, 4, 16), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_divide_relax_add_relax_nn_softmax_relax_multiply(
                    x, R.const(4.0, "float32"), mask, w)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["softmax"] == 1


def _softmax_module(prologue, epilogue=None, x_shape=(1, 4, 8, 8), mask_shape=(1, 1, 1, 8), axis=-1,
                    extra_output=None):
    """softmax(prologue(x)) [-> epilogue]; ``extra_output`` names an intermediate also returned."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    mask = relax.Var("mask", relax.TensorType(mask_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, mask]):
        with bb.dataflow():
            named = {"x": x}
            logits = x
            if "scale" in prologue:
                logits = named["scaled"] = bb.emit(relax.op.multiply(logits, relax.const(0.125, "float32")))
            if "causal" in prologue:
                triangle = relax.const(np.tril(np.ones(x_shape[-2:], bool)))
                logits = named["causal"] = bb.emit(relax.op.where(triangle, logits, relax.const(-1e30, "float32")))
            if "masked_fill" in prologue:  # torch's order: where(masked, fill, x)
                above = relax.const(np.triu(np.ones(x_shape[-2:], bool), 1))
                logits = named["causal"] = bb.emit(relax.op.where(above, relax.const(-1e30, "float32"), logits))
            if "mask" in prologue:
                logits = named["masked"] = bb.emit(relax.op.add(logits, mask))
            out = bb.emit(relax.op.nn.softmax(logits, axis=axis))
            if epilogue == "astype":
                out = bb.emit(relax.op.astype(out, "float16"))
            result = relax.Tuple([out, named[extra_output]]) if extra_output else out
            gv = bb.emit_output(result)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("prologue, epilogue, variant", [
    (("scale",), None, "scale_softmax"),
    (("mask",), None, "mask_softmax"),
    (("scale", "causal", "mask"), None, "scale_causal_mask_softmax"),
    (("causal",), "astype", "causal_softmax_astype"),
    (("masked_fill",), None, "masked_fill_softmax"),
    (("scale", "masked_fill", "mask"), "astype", "scale_masked_fill_mask_softmax_astype"),
])
def test_variants_fire(prologue, epilogue, variant):
    after, report = fuse(_softmax_module(prologue, epilogue))
    assert report.variants[f"softmax.{variant}"] == 1
    calls = [b.value.op for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1 and isinstance(calls[0], relax.GlobalVar)


@pytest.mark.parametrize("kwargs, reason", [
    ({"prologue": ("mask",), "extra_output": "masked"},
     "an intermediate result is also used outside the chain"),
    ({"prologue": ("scale",), "axis": 2},
     "softmax is over axis 2, not the last: rows would not be contiguous"),
    ({"prologue": ("mask",), "mask_shape": (2, 1, 1, 8)},
     "the input shape (1, 4, 8, 8) differs from the softmax shape (2, 4, 8, 8)"),
])
def test_must_not_fuse(kwargs, reason):
    before = _softmax_module(**kwargs)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [(miss.pattern, miss.reason) for miss in report.near_misses] == [("softmax", reason)]


N, M, KEYS = (tvm.tirx.Var(name, "int64") for name in ("n", "m", "keys"))


def test_symbolic_rows_fuse():
    """The number of rows may vary (a symbolic sequence); the row itself is static."""
    after, report = fuse(_softmax_module(("scale", "mask"), x_shape=(1, 4, N, 8), mask_shape=(1, 1, N, 8)))
    assert report.variants["softmax.scale_mask_softmax"] == 1
    assert not report.near_misses
    calls = [b.value.op for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1 and isinstance(calls[0], relax.GlobalVar)


@pytest.mark.parametrize("kwargs, reason", [
    ({"prologue": ("scale",), "x_shape": (1, 4, N, KEYS)},
     "the softmax input (1, 4, n, keys) has the symbolic dim keys at axis 3 (softmax axis): "
     "the kernel needs it static (bind it)"),
    ({"prologue": ("mask",), "x_shape": (1, 4, N, 8), "mask_shape": (1, 1, M, 8)},
     "the softmax's shape is not known (from x (1, 4, n, 8), mask (1, 1, m, 8))"),
])
def test_must_not_fuse_symbolic(kwargs, reason):
    before = _softmax_module(**kwargs)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [(miss.pattern, miss.reason) for miss in report.near_misses] == [("softmax", reason)]


def test_attention_keeps_its_softmax():
    """In the examples every softmax belongs to an attention, which the attention pattern takes."""
    inspected = api.inspect_model(REPO / "examples" / "models" / "bert_tiny.onnx",
                                  input_shapes=["input_ids:1x32", "attention_mask:1x32"])
    assert inspected.report.fired["attention"] == 2
    assert inspected.report.fired["softmax"] == 0


def _check_against_references(model, tmp_path, inputs, fired):
    """Compile ``model`` with the default config: ``fired`` patterns, fused == unfused == ORT."""
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    report = optimized.report
    assert {name: (report.variants if "." in name else report.fired)[name] for name in fired} == fired
    assert "Softmax" in optimized.schedule_rules.values()
    return helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def _onnx_model(nodes, inputs, outputs, initializers):
    model = helper.make_model(helper.make_graph(nodes, "softmax_test", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_attention_returning_its_probabilities(tmp_path):
    """HF's ``output_attentions``: the probabilities are a graph output, so the attention pattern
    declines and the scale + mask + softmax become one kernel instead."""
    batch, heads, seq, dim = 1, 2, 32, 16
    heads_shape = [batch, heads, seq, dim]
    model = _onnx_model(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["q", "kt"], ["scores"]),
         helper.make_node("Div", ["scores", "scale"], ["scaled"]),
         helper.make_node("Add", ["scaled", "mask"], ["masked"]),
         helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
         helper.make_node("MatMul", ["probs", "v"], ["context"]),
         helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
         helper.make_node("Reshape", ["merged", "merge"], ["out"])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, heads_shape) for n in "qkv"]
        + [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [batch, 1, 1, seq])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, seq, heads * dim]),
         helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, heads, seq, seq])],
        [numpy_helper.from_array(np.array(4.0, np.float32), "scale"),
         numpy_helper.from_array(np.array([batch, seq, heads * dim], np.int64), "merge")])
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal(heads_shape).astype(np.float32) for n in "qkv"}
    inputs["mask"] = np.where(rng.random((batch, 1, 1, seq)) < 0.3, np.finfo(np.float32).min, 0).astype(np.float32)
    _check_against_references(model, tmp_path, inputs, {"attention": 0, "softmax.scale_mask_softmax": 1})


def test_inf_masked_rows_match_onnxruntime(tmp_path):
    """Softmax(x / 4 + mask) with -inf masks: partly masked rows and a fully masked (NaN) row."""
    shape = (2, 3, 48)
    model = _onnx_model(
        [helper.make_node("Div", ["x", "scale"], ["scaled"]),
         helper.make_node("Add", ["scaled", "mask"], ["masked"]),
         helper.make_node("Softmax", ["masked"], ["y"], axis=-1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(4.0, np.float32), "scale")])
    rng = np.random.default_rng(0)
    mask = np.where(rng.random(shape) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[1, 2, :] = -np.inf
    inputs = {"x": rng.standard_normal(shape).astype(np.float32), "mask": mask}
    (fused,) = _check_against_references(model, tmp_path, inputs, {"softmax.scale_mask_softmax": 1})
    assert np.isnan(fused[1, 2]).all() and not np.isnan(fused[0]).any()


def test_masked_fill_order_matches_onnxruntime(tmp_path):
    """``scores.masked_fill(mask == 0, -inf)`` as torch exports it, ``Where(padded, -inf, x)``
    (the fill first; an RNN decoder's attention over its memory): partly and fully masked rows."""
    shape = (2, 1, 16)
    model = _onnx_model(
        [helper.make_node("Cast", ["src_mask"], ["padded"], to=TensorProto.BOOL),
         helper.make_node("Where", ["padded", "fill", "x"], ["masked"]),
         helper.make_node("Softmax", ["masked"], ["y"], axis=-1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("src_mask", TensorProto.INT64, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")])
    rng = np.random.default_rng(0)
    src_mask = (rng.random(shape) < 0.3).astype(np.int64)
    src_mask[1] = 1
    inputs = {"x": rng.standard_normal(shape).astype(np.float32), "src_mask": src_mask}
    (fused,) = _check_against_references(model, tmp_path, inputs, {"softmax.masked_fill_softmax": 1})
    assert np.isnan(fused[1]).all() and not np.isnan(fused[0]).any()
