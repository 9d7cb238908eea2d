"""Single-head attention: the 3-D chain becomes the one-head 4-D form, which the attention
fusion then takes; numbers match ONNX Runtime and the unfused module."""

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
from tvm_fusion.passes import ApplyRewriteRules
from tvm_fusion.patterns import PatternReport, get_pattern

# Stated tolerances: float32; the fast-math exp is within ~4e-6 relative of libm's.
RTOL, ATOL = 1e-4, 1e-5
FILL = -1e30


def rewrite(mod):
    report = PatternReport()
    return ApplyRewriteRules([get_pattern("single_head_attention")], report)(mod), report


def test_decoder_attention_over_its_memory_gets_one_head():
    """One query over six memory rows, torch's masked_fill order (the fill first)."""
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 1, 8), "float32"), memory: R.Tensor((1, 6, 8), "float32"),
                 padded: R.Tensor((1, 1, 6), "bool")):
            with R.dataflow():
                keys = R.permute_dims(memory, [0, 2, 1])
                scores = R.matmul(q, keys)
                masked = R.where(padded, R.const(FILL, "float32"), scores)
                probs = R.nn.softmax(masked, axis=-1)
                gv = R.matmul(probs, memory)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 1, 8), "float32"), memory: R.Tensor((1, 6, 8), "float32"),
                 padded: R.Tensor((1, 1, 6), "bool")):
            with R.dataflow():
                padded_heads = R.expand_dims(padded, [1])
                q_heads = R.reshape(q, R.shape([1, 1, 1, 8]))
                k_heads = R.reshape(memory, R.shape([1, 1, 6, 8]))
                keys = R.permute_dims(k_heads, [0, 1, 3, 2])
                scores = R.matmul(q_heads, keys)
                masked = R.where(padded_heads, R.const(FILL, "float32"), scores)
                probs = R.nn.softmax(masked, axis=-1)
                v_view = R.reshape(memory, R.shape([1, 6, 1, 8]))
                v_heads = R.permute_dims(v_view, [0, 2, 1, 3])
                context = R.matmul(probs, v_heads)
                merged = R.permute_dims(context, [0, 2, 1, 3])
                gv = R.reshape(merged, R.shape([1, 1, 8]))
                R.output(gv)
            return gv

    after, report = rewrite(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["single_head_attention"] == 1


def _three_d_attention(probs_output=False, key_axes=(0, 2, 1), q_shape=(2, 4, 8)):
    q = relax.Var("q", relax.TensorType(q_shape, "float32"))
    k = relax.Var("k", relax.TensorType((2, 6, 8) if key_axes == (0, 2, 1) else (2, 8, 6), "float32"))
    v = relax.Var("v", relax.TensorType((2, 6, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            scores = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, list(key_axes))))
            probs = bb.emit(relax.op.nn.softmax(relax.op.divide(scores, relax.const(2.0, "float32")), axis=-1))
            out = bb.emit(relax.op.matmul(probs, v))
            gv = bb.emit_output(relax.Tuple([out, probs]) if probs_output else out)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("kwargs, reason", [
    ({"probs_output": True}, "the intermediate probs (lv3) is also used outside the chain"),
    ({"key_axes": (0, 1, 2)}, "the key is permuted by (0, 1, 2), not transposed (0, 2, 1)"),
])
def test_must_not_rewrite(kwargs, reason):
    before = _three_d_attention(**kwargs)
    after, report = rewrite(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [miss.reason for miss in report.near_misses] == [reason]


def _decoder_attention_onnx(batch, keys, dim) -> onnx.ModelProto:
    """The romanizer decoder's attention: q [B, 1, D] against memory [B, T, D] (keys and
    values), masked by ``Where(src_mask, -inf, scores)``, scaled by 1/sqrt(D) first."""
    node = helper.make_node
    nodes = [node("Transpose", ["memory"], ["keys"], perm=[0, 2, 1]),
             node("MatMul", ["q", "keys"], ["scores"]), node("Mul", ["scores", "scale"], ["scaled"]),
             node("Unsqueeze", ["src_mask", "axis"], ["mask3"]),
             node("Cast", ["mask3"], ["padded"], to=TensorProto.BOOL),
             node("Where", ["padded", "fill", "scaled"], ["masked"]),
             node("Softmax", ["masked"], ["probs"], axis=-1), node("MatMul", ["probs", "memory"], ["context"])]
    graph = helper.make_graph(
        nodes, "decoder_attention",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, 1, dim]),
         helper.make_tensor_value_info("memory", TensorProto.FLOAT, [batch, keys, dim]),
         helper.make_tensor_value_info("src_mask", TensorProto.INT64, [batch, keys])],
        [helper.make_tensor_value_info("context", TensorProto.FLOAT, [batch, 1, dim])],
        [numpy_helper.from_array(np.array(dim ** -0.5, np.float32), "scale"),
         numpy_helper.from_array(np.array([1], np.int64), "axis"),
         numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_decoder_attention_is_one_kernel_and_matches_onnxruntime(tmp_path):
    """Batch item 1 is fully masked: NaN, as in ONNX Runtime."""
    batch, keys, dim = 2, 16, 32
    model = _decoder_attention_onnx(batch, keys, dim)
    path = tmp_path / "decoder_attention.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.fired["single_head_attention"] == 1
    assert optimized.report.variants["attention.qk_heads_masked_fill"] == 1
    assert "Attention" in optimized.schedule_rules.values()
    rng = np.random.default_rng(0)
    src_mask = (rng.random((batch, keys)) < 0.3).astype(np.int64)
    src_mask[1] = 1
    inputs = {"q": rng.standard_normal((batch, 1, dim)).astype(np.float32),
              "memory": rng.standard_normal((batch, keys, dim)).astype(np.float32), "src_mask": src_mask}
    (fused,) = helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)
    assert np.isnan(fused[1]).all() and not np.isnan(fused[0]).any()
