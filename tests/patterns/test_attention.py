"""Attention fusion: the head split, scores, scale, masks, softmax, ·V and head merge become one
composite; real exporter graphs fuse; the numbers agree with ONNX Runtime and the unfused module."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from machine import host_target
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion import api
from tvm_fusion.config import load_config, parse_config
from tvm_fusion.frontend.onnx import random_inputs
from tvm_fusion.passes import FusePatterns, fusion_pipeline
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.verify import reference_outputs

REPO = Path(__file__).resolve().parents[2]
FLOAT_MIN = float(np.finfo(np.float32).min)
# Stated tolerances: float32, softmax with the fast-math exp (~4e-6 rel) over <= 64 keys.
RTOL, ATOL = 1e-4, 1e-5


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("attention")], report)(mod), report


def test_bert_form_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 8, 16), "float32"), k: R.Tensor((1, 8, 16), "float32"),
                 v: R.Tensor((1, 8, 16), "float32"), mask: R.Tensor((1, 1, 1, 8), "float32")):
            with R.dataflow():
                lv = R.reshape(q, R.shape([1, 8, 2, 8]))
                lv1 = R.reshape(k, R.shape([1, 8, 2, 8]))
                lv2 = R.reshape(v, R.shape([1, 8, 2, 8]))
                lv3 = R.permute_dims(lv, axes=[0, 2, 1, 3])
                lv4 = R.permute_dims(lv1, axes=[0, 2, 3, 1])
                lv5 = R.matmul(lv3, lv4)
                lv6 = R.divide(lv5, R.const(2.0, "float32"))
                lv7 = R.add(lv6, mask)
                lv8 = R.nn.softmax(lv7, axis=-1)
                lv9 = R.permute_dims(lv2, axes=[0, 2, 1, 3])
                lv10 = R.matmul(lv8, lv9)
                lv11 = R.permute_dims(lv10, axes=[0, 2, 1, 3])
                gv = R.reshape(lv11, R.shape([1, 8, 16]))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_reshape_relax_reshape_relax_reshape_relax_permute_dims_relax_permute_dims_relax_matmul_relax_divide_relax_add_relax_nn_softmax_relax_permute_dims_relax_matmul_relax_permute_dims_relax_reshape(  # noqa: E501
            q: R.Tensor((1, 8, 16), "float32"), k: R.Tensor((1, 8, 16), "float32"),
            v: R.Tensor((1, 8, 16), "float32"), param_3: R.Tensor((), "float32"),
            mask: R.Tensor((1, 1, 1, 8), "float32"),
        ) -> R.Tensor((1, 8, 16), "float32"):
            R.func_attr({"Composite": "attention.masked", "Primitive": True})
            with R.dataflow():
                lv = R.reshape(q, R.shape([1, 8, 2, 8]))
                lv1 = R.reshape(k, R.shape([1, 8, 2, 8]))
                lv2 = R.reshape(v, R.shape([1, 8, 2, 8]))
                lv3 = R.permute_dims(lv, axes=[0, 2, 1, 3])
                lv4 = R.permute_dims(lv1, axes=[0, 2, 3, 1])
                lv5 = R.matmul(lv3, lv4)
                lv6 = R.divide(lv5, param_3)
                lv7 = R.add(lv6, mask)
                lv8 = R.nn.softmax(lv7, axis=-1)
                lv9 = R.permute_dims(lv2, axes=[0, 2, 1, 3])
                lv10 = R.matmul(lv8, lv9)
                lv11 = R.permute_dims(lv10, axes=[0, 2, 1, 3])
                gv = R.reshape(lv11, R.shape([1, 8, 16]))
                R.output(gv)
            return gv

        @R.function
        def main(q: R.Tensor((1, 8, 16), "float32"), k: R.Tensor((1, 8, 16), "float32"),
                 v: R.Tensor((1, 8, 16), "float32"),
                 mask: R.Tensor((1, 1, 1, 8), "float32")) -> R.Tensor((1, 8, 16), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_reshape_relax_reshape_relax_reshape_relax_permute_dims_relax_permute_dims_relax_matmul_relax_divide_relax_add_relax_nn_softmax_relax_permute_dims_relax_matmul_relax_permute_dims_relax_reshape(  # noqa: E501
                    q, k, v, R.const(2.0, "float32"), mask)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["attention"] == 1
    assert report.variants["attention.masked"] == 1


def _attention_module(scale_op=relax.op.divide, scale=None, causal=False, mask_shape=(1, 1, 1, 8),
                      qk_dtype="float32", scores_dtype=None, probs_output=False, packed=False,
                      qk_heads=False, stacked=False, scale_at="scores", stack_order=(0, 1, 2),
                      dynamo=False, seq=8, dim=8):
    """A [1, 8, 2x8] attention in Relax with the given variations (defaults: BERT's form);
    ``packed``: Q, K, V split from one [1, 8, 3x2x8] projection (GPT-2's c_attn); ``stacked``:
    that projection viewed as [1, 8, 3, 2, 8] and Q, K, V sliced from axis 0 in ``stack_order``
    (SVTR, timm's ViT); ``qk_heads``: Q and K given as [1, 2, 8, 8] (Llama's, after the rotary
    embedding); ``scale_at``: "scores", "query" (Q scaled before Q·Kᵀ), "query_and_key" or "none";
    ``dynamo``: torch's dynamo SDPA form (K transposed in 3-D, NaN rows of the probabilities zeroed);
    ``seq``, ``dim``: the sequence length and head dim, a ``tirx.Var`` for a symbolic one;
    ``causal``: True for GPT-2's ``where(triangle, scores, min)``, "fill" for torch's masked_fill
    order ``where(above_triangle, min, scores)``."""
    heads = 2
    scale_dim = dim if isinstance(dim, int) else 8  # the constant scale of a symbolic head dim
    proj = relax.TensorType((1, seq, heads * dim), qk_dtype)
    if packed or stacked:
        qkv = relax.Var("qkv", relax.TensorType((1, seq, 3 * heads * dim), "float32"))
        params = [qkv]
    elif qk_heads:
        head_first = relax.TensorType((1, heads, seq, dim), qk_dtype)
        params = [relax.Var("q", head_first), relax.Var("k", head_first),
                  relax.Var("v", relax.TensorType((1, seq, heads * dim), "float32"))]
    else:
        params = [relax.Var("q", proj), relax.Var("k", proj),
                  relax.Var("v", relax.TensorType((1, seq, heads * dim), "float32"))]
    if mask_shape is not None:
        mask = relax.Var("mask", relax.TensorType(mask_shape, "float32"))
        params.append(mask)
    if scale is None:
        scale = relax.const(np.sqrt(scale_dim), "float32")
    elif isinstance(scale, relax.Var):
        params.append(scale)

    def heads_first(x, axes):
        return relax.op.permute_dims(relax.op.reshape(x, (1, seq, heads, dim)), axes)

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            v_heads = None
            if stacked:
                stack = bb.emit(relax.op.permute_dims(relax.op.reshape(params[0], (1, seq, 3, heads, dim)),
                                                      [2, 0, 3, 1, 4]))
                q, k, v_heads = (bb.emit(relax.op.squeeze(relax.op.strided_slice(stack, [0], [i], [i + 1]), [0]))
                                 for i in stack_order)
            elif packed:
                split = bb.emit(relax.op.split(params[0], 3, axis=-1))
                q, k, v = (bb.emit(relax.TupleGetItem(split, i)) for i in range(3))
            else:
                q, k, v = params[:3]
            if qk_heads or stacked:
                q_heads, k_transposed = q, relax.op.permute_dims(k, [0, 1, 3, 2])
            elif dynamo:
                q_heads = heads_first(q, [0, 2, 1, 3])
                k_flat = relax.op.reshape(heads_first(k, [0, 2, 1, 3]), (heads, seq, dim))
                k_transposed = relax.op.reshape(relax.op.permute_dims(k_flat, [0, 2, 1]), (1, heads, dim, seq))
            else:
                q_heads, k_transposed = heads_first(q, [0, 2, 1, 3]), heads_first(k, [0, 2, 3, 1])
            if scale_at == "query":
                q_heads = bb.emit(relax.op.multiply(q_heads, relax.const(1 / np.sqrt(scale_dim), "float32")))
            if scale_at == "query_and_key":
                root = relax.const(scale_dim ** -0.25, "float32")
                q_heads = bb.emit(relax.op.multiply(q_heads, root))
                k_transposed = bb.emit(relax.op.multiply(k_transposed, root))
            scores = bb.emit(relax.op.matmul(q_heads, k_transposed, out_dtype=scores_dtype))
            logits = bb.emit(scale_op(scores, scale)) if scale_at == "scores" else scores
            if causal:
                triangle = np.tril(np.ones((1, 1, seq, seq), bool))
                fill = relax.const(FLOAT_MIN, "float32")
                logits = bb.emit(relax.op.where(relax.const(~triangle), fill, logits) if causal == "fill"
                                 else relax.op.where(relax.const(triangle), logits, fill))
            if mask_shape is not None:
                logits = bb.emit(relax.op.add(logits, mask))
            probs = bb.emit(relax.op.nn.softmax(logits, axis=-1))
            if dynamo:
                probs = bb.emit(relax.op.where(relax.op.isnan(probs), relax.const(0.0, "float32"), probs))
            if v_heads is None:
                v_heads = heads_first(v, [0, 2, 1, 3])
            context = bb.emit(relax.op.matmul(probs, v_heads))
            # A mask of the wrong shape widens the batch (or, symbolic, leaves it unknown).
            batch = context.ty.shape[0] if context.ty.shape is not None else 1
            out = relax.op.reshape(relax.op.permute_dims(context, [0, 2, 1, 3]), (batch, seq, heads * dim))
            out = bb.emit_output(relax.Tuple([out, probs]) if probs_output else out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("variant, kwargs", [
    ("masked", {}),
    ("masked", {"scale_op": relax.op.multiply, "scale": relax.const(0.125, "float32")}),
    ("causal_masked", {"causal": True, "mask_shape": (1, 1, 8, 8)}),
    ("causal", {"causal": True, "mask_shape": None}),
    ("masked_fill", {"causal": "fill", "mask_shape": None}),
    ("masked_fill_masked", {"causal": "fill", "mask_shape": (1, 1, 8, 8)}),
    ("unmasked", {"mask_shape": None}),
    ("masked", {"mask_shape": (1, 2, 8, 8)}),
    ("qkv_causal_masked", {"packed": True, "causal": True}),
    ("qk_heads_masked", {"qk_heads": True}),
    ("qkv_stacked_unmasked_query_scaled", {"stacked": True, "mask_shape": None, "scale_at": "query"}),
    ("qkv_stacked_masked", {"stacked": True}),
    ("masked_query_scaled", {"scale_at": "query"}),
    ("causal_unscaled", {"causal": True, "mask_shape": None, "scale_at": "none"}),
    ("masked_qk_scaled_nan_guarded", {"dynamo": True, "scale_at": "query_and_key"}),
])
def test_variants_fire(variant, kwargs):
    after, report = fuse(_attention_module(**kwargs))
    assert report.variants[f"attention.{variant}"] == 1
    assert not report.near_misses
    assert [b.var.name for b in after["main"].body.blocks[0].bindings][-1:] == ["gv"]
    assert len(after["main"].body.blocks[0].bindings) == 1


@pytest.mark.parametrize("kwargs, reason", [
    ({"probs_output": True},
     "an intermediate result (scores or probabilities) is also used outside the chain"),
    ({"probs_output": True, "packed": True},
     "an intermediate result (scores or probabilities) is also used outside the chain"),
    ({"scale": relax.Var("scale", relax.TensorType((), "float32"))},
     "the score scale is not a constant scalar"),
    ({"mask_shape": (2, 1, 1, 8)},
     "additive mask shape (2, 1, 1, 8) does not broadcast into the scores shape (1, 2, 8, 8)"),
    ({"qk_dtype": "float16", "scores_dtype": "float32"},
     "dtype mismatch (q_proj float16, k_proj float16, v_proj float32, scores float32, out float32): "
     "the kernel computes in one dtype"),
    ({"stacked": True, "stack_order": (1, 0, 2)},
     "q is not slice 0 of the stacked Q, K, V (axes [0], begin [1], end [2])"),
])
def test_must_not_fuse(kwargs, reason):
    before = _attention_module(**kwargs)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [(miss.pattern, miss.reason) for miss in report.near_misses] == [("attention", reason)]


SEQ, HEAD_DIM, OTHER_SEQ = (tvm.tirx.Var(name, "int64") for name in ("sequence", "head_dim", "other"))


@pytest.mark.parametrize("variant, kwargs", [
    ("masked", {"seq": SEQ, "mask_shape": (1, 1, 1, SEQ)}),
    ("unmasked", {"seq": SEQ, "mask_shape": None}),
    ("qkv_masked", {"seq": SEQ, "mask_shape": (1, 1, 1, SEQ), "packed": True}),
    ("masked_qk_scaled_nan_guarded", {"seq": SEQ, "mask_shape": (1, 1, 1, SEQ), "dynamo": True,
                                      "scale_at": "query_and_key"}),
])
def test_symbolic_sequence_fuses(variant, kwargs):
    """Batch, query and key lengths may be symbolic: one kernel for a range of sequence lengths,
    the head split/merge shapes ([1, sequence, 2, 8]) written inline in the composite."""
    after, report = fuse(_attention_module(**kwargs))
    assert report.variants[f"attention.{variant}"] == 1
    assert not report.near_misses
    (composite,) = [f for _, f in after.functions_items() if f.attrs and "Composite" in f.attrs]
    assert not [p for p in composite.params if isinstance(p.ty, relax.ShapeType)]
    assert len(after["main"].body.blocks[0].bindings) == 1


@pytest.mark.parametrize("kwargs, reason", [
    ({"seq": SEQ, "dim": HEAD_DIM, "mask_shape": (1, 1, 1, SEQ)},
     "the attention output (1, 2, sequence, head_dim) has the symbolic dim head_dim at axis 3 (head dim): "
     "the kernel needs it static (bind it)"),
    ({"seq": SEQ, "mask_shape": (1, 1, 1, OTHER_SEQ)},
     "additive mask shape (1, 1, 1, other) does not broadcast into the scores shape "
     "(1, 2, sequence, sequence)"),
])
def test_must_not_fuse_symbolic(kwargs, reason):
    before = _attention_module(**kwargs)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [(miss.pattern, miss.reason) for miss in report.near_misses] == [("attention", reason)]


@pytest.mark.parametrize("model, shapes, variant, layers", [
    ("examples/models/bert_tiny.onnx", ["input_ids:1x128", "attention_mask:1x128"], "masked", 2),
    ("examples/models/gpt2_tiny.onnx", ["input_ids:1x128"], "qkv_causal_masked", 2),
    ("tests/data/bert_block_opset14.onnx", ["input_ids:1x8", "attention_mask:1x8"], "masked", 1),
    ("tests/data/gpt2_block_opset14.onnx", ["input_ids:1x8"], "qkv_causal_masked", 1),
    ("tests/data/llama_block.onnx", ["input_ids:1x8"], "qk_heads_masked", 1),
])
def test_every_attention_of_the_exported_models_fuses(model, shapes, variant, layers):
    """What `tvm-fusion inspect` reports: every layer's attention fused, nothing declined."""
    inspected = api.inspect_model(REPO / model, input_shapes=shapes)
    assert inspected.report.fired["attention"] == layers
    assert inspected.report.variants[f"attention.{variant}"] == layers
    assert not [m for m in inspected.report.near_misses if m.pattern == "attention"]
    assert "softmax" not in inspected.fused_ops


def test_llama_block_matches_onnxruntime_and_unfused():
    """Real exporter output with Q and K through the rotary embedding before the attention."""
    prepared = api.prepare(REPO / "tests" / "data" / "llama_block.onnx", load_config(), ["input_ids:2x8"])
    optimized = api.optimize(prepared)
    assert optimized.report.variants["attention.qk_heads_masked"] == 1
    assert "Attention" in optimized.schedule_rules.values()
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, seed=0)
    arrays = [inputs[spec.name] for spec in prepared.inputs]
    fused = _run(api.build(optimized.module, prepared.config), arrays)
    unfused = _run(tvm.compile(relax.get_pipeline("zero")(prepared.relax_module),
                               target=prepared.config.tvm_target()), arrays)
    (expected,) = reference_outputs(prepared.onnx_model, inputs).values()
    np.testing.assert_allclose(fused, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fused, unfused, rtol=RTOL, atol=ATOL)


# Numerics: single attention blocks written the way the exporters write them -----------------

def _attention_onnx(batch, seq, heads, dim, mask_form):
    """q, k, v [B, S, H*D] (+ attention_mask [B, S] int64) -> the exported attention subgraph.

    mask_form: "padding" (BERT: (1 - mask) * float_min, added), "padding_inf" (Where(mask, 0, -inf),
    added), "masked_fill" (torch's ``scores.masked_fill(mask == 0, float_min)``: Where(padded,
    float_min, scores), nothing added), "causal" (GPT-2: qkv [B, S, 3*H*D] split in three,
    Where(triangle, scores, float_min), then + an additive bias; an all-zero one would be folded
    away by the simplifier).
    """
    hidden = heads * dim
    nodes, inits = [], [numpy_helper.from_array(np.array([batch, seq, heads, dim], np.int64), "split"),
                        numpy_helper.from_array(np.array([batch, seq, hidden], np.int64), "merge"),
                        numpy_helper.from_array(np.array(np.sqrt(dim), np.float32), "scale")]
    if mask_form == "causal":
        inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [batch, seq, 3 * hidden])]
        inits.append(numpy_helper.from_array(np.array([hidden] * 3, np.int64), "sections"))
        nodes.append(helper.make_node("Split", ["qkv", "sections"], ["q", "k", "v"], axis=2))
    else:
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, seq, hidden]) for n in "qkv"]
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("Reshape", [name, "split"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}h"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["qh", "kh"], ["scores"]),
              helper.make_node("Div", ["scores", "scale"], ["scaled"])]
    if mask_form == "causal":
        inits += [numpy_helper.from_array(np.tril(np.ones((1, 1, seq, seq), bool)), "triangle"),
                  numpy_helper.from_array(np.array(FLOAT_MIN, np.float32), "fill"),
                  numpy_helper.from_array(np.linspace(-1, 0, seq, dtype=np.float32).reshape(1, 1, 1, seq),
                                          "position_bias")]
        nodes += [helper.make_node("Where", ["triangle", "scaled", "fill"], ["causal"]),
                  helper.make_node("Add", ["causal", "position_bias"], ["masked"])]
    else:
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, seq]))
        inits.append(numpy_helper.from_array(np.array([1, 2], np.int64), "axes"))
        nodes += [helper.make_node("Unsqueeze", ["attention_mask", "axes"], ["mask4"])]
        if mask_form == "masked_fill":
            inits += [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                      numpy_helper.from_array(np.array(FLOAT_MIN, np.float32), "fill")]
            nodes += [helper.make_node("Equal", ["mask4", "zero"], ["padded"]),
                      helper.make_node("Where", ["padded", "fill", "scaled"], ["masked"])]
        elif mask_form == "padding":
            inits += [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                      numpy_helper.from_array(np.array(FLOAT_MIN, np.float32), "fill")]
            nodes += [helper.make_node("Cast", ["mask4"], ["maskf"], to=TensorProto.FLOAT),
                      helper.make_node("Sub", ["one", "maskf"], ["inverted"]),
                      helper.make_node("Mul", ["inverted", "fill"], ["extended"])]
        else:
            inits += [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                      numpy_helper.from_array(np.array(-np.inf, np.float32), "fill")]
            nodes += [helper.make_node("Cast", ["mask4"], ["keep"], to=TensorProto.BOOL),
                      helper.make_node("Where", ["keep", "zero", "fill"], ["extended"])]
        if mask_form != "masked_fill":
            nodes.append(helper.make_node("Add", ["scaled", "extended"], ["masked"]))
    nodes += [helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "vh"], ["context"]),
              helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["merged", "merge"], ["out"])]
    graph = helper.make_graph(nodes, f"attention_{mask_form}", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, seq, hidden])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _run(executable, arrays):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


@pytest.mark.parametrize("mask_form, seq, variant", [
    ("padding", 48, "masked"), ("padding_inf", 40, "masked"), ("masked_fill", 24, "masked_fill"),
    ("causal", 64, "qkv_causal_masked"),
])
def test_fused_matches_onnxruntime_and_unfused(tmp_path, mask_form, seq, variant):
    """Batch item 1 is fully padded: -3.4e38 gives uniform rows, -inf gives NaN, as in ORT."""
    batch, heads, dim = 2, 2, 16
    model = _attention_onnx(batch, seq, heads, dim, mask_form)
    path = tmp_path / "attention.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.variants[f"attention.{variant}"] == 1
    assert "Attention" in optimized.schedule_rules.values()

    rng = np.random.default_rng(0)
    if mask_form == "causal":
        inputs = {"qkv": rng.standard_normal((batch, seq, 3 * heads * dim)).astype(np.float32)}
    else:
        inputs = {name: rng.standard_normal((batch, seq, heads * dim)).astype(np.float32) for name in "qkv"}
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq - 5:] = 0
        mask[1, :] = 0
        inputs["attention_mask"] = mask
    arrays = [inputs[spec.name] for spec in prepared.inputs]
    fused = _run(api.build(optimized.module, prepared.config), arrays)
    unfused = _run(tvm.compile(relax.get_pipeline("zero")(prepared.relax_module),
                               target=prepared.config.tvm_target()), arrays)
    (expected,) = reference_outputs(model, inputs).values()
    np.testing.assert_allclose(fused, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fused, unfused, rtol=RTOL, atol=ATOL)
    if mask_form == "padding_inf":
        assert np.isnan(fused[1]).all() and not np.isnan(fused[0]).any()
    if mask_form in ("padding", "masked_fill"):
        v_mean = inputs["v"][1].mean(axis=0)
        np.testing.assert_allclose(fused[1], np.broadcast_to(v_mean, fused[1].shape), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kwargs", [{"stacked": True, "mask_shape": None, "scale_at": "query"},
                                    {"causal": True, "mask_shape": (1, 1, 8, 8), "scale_at": "none"},
                                    {"dynamo": True, "scale_at": "query_and_key"}])
def test_new_forms_are_scheduled_by_the_attention_rule_and_match_unfused(kwargs):
    """SVTR's form (stacked Q, K, V; Q scaled) and an unscaled one, through the whole pipeline."""
    module = _attention_module(**kwargs)
    config = parse_config({"target": host_target(), "pipeline": {"patterns": ["attention"]}}, name="test")
    schedule_log: dict[str, str] = {}
    fused = fusion_pipeline(config, PatternReport(), schedule_log=schedule_log)(module)
    assert list(schedule_log.values()) == ["Attention"]
    rng = np.random.default_rng(0)
    inputs = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32"))
              for p in module["main"].params]
    run = lambda mod: relax.VirtualMachine(tvm.compile(mod, target=config.tvm_target()), tvm.cpu())[  # noqa: E731
        "main"](*inputs).numpy()
    np.testing.assert_allclose(run(fused), run(relax.get_pipeline("zero")(module)), rtol=1e-5, atol=1e-5)
