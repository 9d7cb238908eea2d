"""Each fused ONNX op (tvm_fusion/onnx_export/fusions/) against ONNX Runtime on the nodes it replaces.

Every test builds the unfused chain from standard ONNX nodes, lets ``onnx_export`` turn the
whole chain into its one ``tvm_fusion`` node (as ``inspect --onnx`` does with the nodes a
fusion absorbed), and runs that node under onnx.reference with our OpRun classes. No TVM:
the exporter reads parameters from the ONNX nodes and the ops are numpy.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tvm_fusion.api import FusedNodes
from tvm_fusion.onnx_export import DOMAIN, evaluator, fused_onnx
from tvm_fusion.onnx_export.fusions.dropout_training import philox_uniform
from tvm_fusion.verify import reference_outputs

RNG = np.random.default_rng(0)


def const(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def model_of(nodes, inputs: dict, outputs: list[str], constants: dict, opset: int = 17) -> onnx.ModelProto:
    """A model of ``nodes``; ``inputs`` name -> shape (float) or (shape, dtype); constants as initializers."""
    value_infos = []
    for name, spec in inputs.items():
        shape, dtype = spec if isinstance(spec, tuple) else (spec, TensorProto.FLOAT)
        value_infos.append(helper.make_tensor_value_info(name, dtype, shape))
    graph = helper.make_graph(
        nodes, "chain", value_infos, [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.BOOL:
            feeds[value.name] = RNG.random(shape) > 0.3
        else:
            feeds[value.name] = RNG.standard_normal(shape).astype(np.float32)
    return feeds


def type_outputs(model: onnx.ModelProto, feeds: dict) -> None:
    """Give the outputs their dtypes and shapes: ONNX Runtime refuses untyped outputs."""
    for output, value in zip(model.graph.output, ReferenceEvaluator(model).run(None, feeds)):
        output.CopyFrom(helper.make_tensor_value_info(output.name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                      value.shape))


def fuse_whole(model: onnx.ModelProto, variant: str, feeds=None) -> tuple[onnx.ModelProto, dict]:
    """The model with all its nodes as one fusion ``variant`` (pattern.variant), and the feeds."""
    feeds = feeds or feeds_for(model)
    type_outputs(model, feeds)
    nodes = list(model.graph.node)
    instance = FusedNodes(variant.split(".")[0], variant, [n.name or f"#{i}" for i, n in enumerate(nodes)],
                          [n.op_type for n in nodes], list(range(len(nodes))))
    result = fused_onnx(model, [instance], feeds)
    assert not result.kept, result.kept
    return result.model, feeds


def assert_fused_matches(model: onnx.ModelProto, variant: str, op_type: str, feeds=None, atol=1e-5,
                         outputs=None) -> onnx.NodeProto:
    """``model`` fused into one ``op_type`` node whose OpRun agrees with ORT on ``model``."""
    fused, feeds = fuse_whole(model, variant, feeds)
    custom = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in custom] == [op_type]
    expected = reference_outputs(model, feeds)
    actual = dict(zip([o.name for o in fused.graph.output], evaluator(fused).run(None, feeds)))
    for name in outputs or expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4, atol=atol, err_msg=name)
    return custom[0]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# GEMM epilogue --------------------------------------------------------------------------------

def erf_gelu(x: str, out: str) -> list[onnx.NodeProto]:
    """x * 0.5 * (1 + erf(x / sqrt 2)) as exporters write it."""
    return [helper.make_node("Div", [x, "sqrt2"], [f"{out}_d"]), helper.make_node("Erf", [f"{out}_d"], [f"{out}_e"]),
            helper.make_node("Add", [f"{out}_e", "one"], [f"{out}_a"]),
            helper.make_node("Mul", [x, f"{out}_a"], [f"{out}_m"]), helper.make_node("Mul", [f"{out}_m", "half"], [out])]


GELU_CONSTANTS = {"sqrt2": np.float32(np.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5)}

ACTIVATION_NODES = {  # name: (nodes on "h" -> "act", constants, expected attribute params)
    "relu": ([helper.make_node("Relu", ["h"], ["act"])], {}, None),
    "sigmoid": ([helper.make_node("Sigmoid", ["h"], ["act"])], {}, None),
    "gelu": (erf_gelu("h", "act"), GELU_CONSTANTS, None),
    "gelu_tanh": ([helper.make_node("Mul", ["h", "half"], ["g0"]), helper.make_node("Pow", ["h", "three"], ["g1"]),
                   helper.make_node("Mul", ["g1", "c"], ["g2"]), helper.make_node("Add", ["h", "g2"], ["g3"]),
                   helper.make_node("Mul", ["g3", "k"], ["g4"]), helper.make_node("Tanh", ["g4"], ["g5"]),
                   helper.make_node("Add", ["g5", "one"], ["g6"]), helper.make_node("Mul", ["g0", "g6"], ["act"])],
                  {"half": np.float32(0.5), "three": np.float32(3), "c": np.float32(0.044715),
                   "k": np.float32(np.sqrt(2 / np.pi)), "one": np.float32(1)}, None),
    "silu": ([helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["act"])], {}, None),
    "clip": ([helper.make_node("Clip", ["h", "lo", "hi"], ["act"])], {"lo": np.float32(-0.5), "hi": np.float32(0.7)},
             [-0.5, 0.7]),
    "leakyrelu": ([helper.make_node("LeakyRelu", ["h"], ["act"], alpha=0.2)], {}, [0.2]),
    "hardsigmoid": ([helper.make_node("HardSigmoid", ["h"], ["act"], alpha=0.25, beta=0.4)], {}, [0.25, 0.4]),
    "hardswish": ([helper.make_node("HardSwish", ["h"], ["act"])], {}, None),
}


@pytest.mark.parametrize("activation", sorted(ACTIVATION_NODES))
def test_gemm_epilogue_matmul_bias_activation_residual(activation):
    act_nodes, constants, params = ACTIVATION_NODES[activation]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["h"]),
             *act_nodes, helper.make_node("Add", ["act", "r"], ["y"])]
    model = model_of(nodes, {"x": [2, 8, 16], "r": [2, 8, 12]}, ["y"],
                     {"w": const(16, 12), "b": const(12), **constants})
    node = assert_fused_matches(model, f"gemm_epilogue.matmul_bias_{activation}_residual", "GemmEpilogue")
    found = attrs(node)
    assert found["activation"] == activation.encode() and found["has_bias"] == 1 and found["has_residual"] == 1
    assert list(node.input) == ["x", "w", "b", "r"]
    if params:
        np.testing.assert_allclose(found["activation_params"], params, rtol=1e-6)


def test_gemm_epilogue_gemm_trans_b_and_flattened_linear():
    """Gemm(transB, alpha, beta) on a Reshape-flattened N-D input, reshaped back (GPT-2's Conv1D)."""
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("Gemm", ["x2", "w", "b"], ["g"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Reshape", ["g", "back"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    model = model_of(nodes, {"x": [2, 4, 6]}, ["y"], {"w": const(10, 6), "b": const(10),
                                                     "flat": np.array([-1, 6]), "back": np.array([2, 4, 10])})
    node = assert_fused_matches(model, "gemm_epilogue.matmul_bias_relu", "GemmEpilogue")
    assert attrs(node)["output_shape"] == [2, 4, 10] and list(node.input) == ["x", "w", "b"]


def test_gemm_dropout_values_follow_the_philox_mask():
    """ORT draws its own mask, so: values = mask * (ORT's inference output) / (1 - ratio), and the
    mask is Philox-4x32-10 (checked against Random123's known answer) at the flat index."""
    assert philox_uniform(1, 0)[0] == np.float32((0x6627E8D5 >> 8) * 2.0 ** -24)
    ratio, seed = 0.25, 7
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["h"]),
             *erf_gelu("h", "g"),
             helper.make_node("Dropout", ["g", "ratio", "training"], ["y", "mask"], seed=seed)]
    constants = {"w": const(16, 32), "b": const(32), "ratio": np.float32(ratio), "training": np.array(True),
                 **GELU_CONSTANTS}
    model = model_of(nodes, {"x": [64, 16]}, ["y", "mask"], constants)
    fused, feeds = fuse_whole(model, "dropout_training.matmul_bias_gelu_dropout")
    inference = model_of(nodes[:-1] + [helper.make_node("Identity", ["g"], ["y"])], {"x": [64, 16]}, ["y"],
                         constants)
    type_outputs(inference, feeds)
    assert [n.op_type for n in fused.graph.node] == ["GemmDropout"]
    values, mask = evaluator(fused).run(None, feeds)
    expected = reference_outputs(inference, feeds)["y"]
    np.testing.assert_array_equal(mask, philox_uniform(mask.size, seed).reshape(mask.shape) >= ratio)
    np.testing.assert_allclose(values, np.where(mask, expected / (1 - ratio), 0), rtol=1e-5, atol=1e-6)
    assert abs(mask.mean() - (1 - ratio)) < 0.05


# attention ------------------------------------------------------------------------------------

def heads(name: str, proj: str, perm) -> list[onnx.NodeProto]:
    return [helper.make_node("Reshape", [proj, "split_shape"], [f"{name}_view"]),
            helper.make_node("Transpose", [f"{name}_view"], [name], perm=perm)]


def attention_tail(scores_from: list[onnx.NodeProto], logits: str) -> list[onnx.NodeProto]:
    return [*scores_from, helper.make_node("Softmax", [logits], ["probs"], axis=-1),
            helper.make_node("MatMul", ["probs", "v_heads"], ["context"]),
            helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["merged", "merge_shape"], ["y"])]


B, S, H, D = 2, 6, 2, 4
ATTENTION_SHAPES = {"split_shape": np.array([B, S, H, D]), "merge_shape": np.array([B, S, H * D])}


def test_attention_bert_projections_scale_and_padding_mask():
    nodes = [*heads("q_heads", "q", [0, 2, 1, 3]), *heads("k_heads", "k", [0, 2, 3, 1]),
             *heads("v_heads", "v", [0, 2, 1, 3]),
             *attention_tail([helper.make_node("MatMul", ["q_heads", "k_heads"], ["scores"]),
                              helper.make_node("Div", ["scores", "sqrt_d"], ["scaled"]),
                              helper.make_node("Add", ["scaled", "mask"], ["masked"])], "masked")]
    model = model_of(nodes, {"q": [B, S, H * D], "k": [B, S, H * D], "v": [B, S, H * D], "mask": [B, 1, 1, S]},
                     ["y"], {**ATTENTION_SHAPES, "sqrt_d": np.float32(2.0)})
    node = assert_fused_matches(model, "attention.masked", "Attention")
    assert list(node.input) == ["q", "k", "v", "", "mask"]
    assert attrs(node)["num_heads"] == H and attrs(node)["scale"] == pytest.approx(0.5)


def test_attention_gpt2_packed_qkv_causal_where_and_mask():
    nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2),
             *heads("q_heads", "q", [0, 2, 1, 3]), *heads("k_heads", "k", [0, 2, 3, 1]),
             *heads("v_heads", "v", [0, 2, 1, 3]),
             *attention_tail([helper.make_node("MatMul", ["q_heads", "k_heads"], ["scores"]),
                              helper.make_node("Mul", ["scores", "inv_sqrt_d"], ["scaled"]),
                              helper.make_node("Where", ["causal", "scaled", "fill"], ["filled"]),
                              helper.make_node("Add", ["filled", "mask"], ["masked"])], "masked")]
    causal = np.tril(np.ones((S, S), bool)).reshape(1, 1, S, S)
    model = model_of(nodes, {"qkv": [B, S, 3 * H * D], "mask": [B, 1, 1, S]}, ["y"],
                     {**ATTENTION_SHAPES, "sizes": np.array([H * D] * 3), "inv_sqrt_d": np.float32(0.5),
                      "causal": causal, "fill": np.float32(-3.4028235e38)})
    node = assert_fused_matches(model, "attention.qkv_causal_masked", "Attention")
    assert attrs(node)["qk_form"] == b"packed" and attrs(node)["qkv_split"] == [H * D] * 3
    assert list(node.input) == ["qkv", "", "", "causal", "mask"]


def test_attention_q_k_already_in_heads():
    nodes = [helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]), *heads("v_heads", "v", [0, 2, 1, 3]),
             *attention_tail([helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
                              helper.make_node("Div", ["scores", "sqrt_d"], ["scaled"])], "scaled")]
    model = model_of(nodes, {"q": [B, H, S, D], "k": [B, H, S, D], "v": [B, S, H * D]}, ["y"],
                     {**ATTENTION_SHAPES, "sqrt_d": np.float32(2.0)})
    node = assert_fused_matches(model, "attention.qk_heads_unmasked", "Attention")
    assert attrs(node)["qk_form"] == b"heads"


def stacked_qkv(slice_order=(0, 1, 2)) -> list[onnx.NodeProto]:
    """One projection viewed as [B, S, 3, H, D], stacked heads first, sliced into q, k, v_heads
    (paddle2onnx's SVTR attention); ``slice_order``: which stack index each of them takes."""
    nodes = [helper.make_node("Reshape", ["qkv", "stack_shape"], ["qkv_view"]),
             helper.make_node("Transpose", ["qkv_view"], ["stack"], perm=[2, 0, 3, 1, 4])]
    for name, index in zip(("q", "k", "v_heads"), slice_order):
        nodes += [helper.make_node("Slice", ["stack", f"at{index}", f"at{index + 1}", "at0", "at1"], [f"{name}_s"]),
                  helper.make_node("Squeeze", [f"{name}_s", "at0"], [name])]
    return nodes


STACK_CONSTANTS = {"stack_shape": np.array([B, S, 3, H, D]), **{f"at{i}": np.array([i]) for i in range(4)}}


def test_attention_svtr_stacked_qkv_with_the_scale_on_q():
    nodes = [*stacked_qkv(), helper.make_node("Mul", ["q", "scale"], ["q_scaled"]),
             helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
             *attention_tail([helper.make_node("MatMul", ["q_scaled", "k_t"], ["scores"])], "scores")]
    model = model_of(nodes, {"qkv": [B, S, 3 * H * D]}, ["y"],
                     {**ATTENTION_SHAPES, **STACK_CONSTANTS, "scale": np.float32(0.5)})
    node = assert_fused_matches(model, "attention.qkv_stacked_unmasked_query_scaled", "Attention")
    assert list(node.input) == ["qkv"]
    assert attrs(node)["qk_form"] == b"stacked" and attrs(node)["qkv_shape"] == [B, S, 3, H, D]
    assert attrs(node)["scale"] == pytest.approx(0.5)


def test_attention_stacked_slices_out_of_order_keep_the_nodes():
    nodes = [*stacked_qkv(slice_order=(0, 2, 1)), helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
             *attention_tail([helper.make_node("MatMul", ["q", "k_t"], ["scores"])], "scores")]
    model = model_of(nodes, {"qkv": [B, S, 3 * H * D]}, ["y"], {**ATTENTION_SHAPES, **STACK_CONSTANTS})
    feeds = feeds_for(model)
    type_outputs(model, feeds)
    instance = FusedNodes("attention", "attention.qkv_stacked_unmasked_unscaled", [n.name for n in nodes],
                          [n.op_type for n in nodes], list(range(len(nodes))))
    result = fused_onnx(model, [instance], feeds)
    assert [k.reason for k in result.kept] == ["k is not slice 1 of the stacked Q, K, V"]
    assert not any(n.domain == DOMAIN for n in result.model.graph.node)


def test_attention_dynamo_3d_key_transpose_scale_on_q_and_k_and_nan_guard():
    """torch's dynamo exporter: Kᵀ through [B*H, S, D], sqrt(scale) on Q and on Kᵀ, and
    Where(IsNaN(p), 0, p) zeroing the rows the mask left all -inf (batch 1 here)."""
    nodes = [*heads("q_heads", "q", [0, 2, 1, 3]), *heads("k_heads", "k", [0, 2, 1, 3]),
             *heads("v_heads", "v", [0, 2, 1, 3]),
             helper.make_node("Reshape", ["k_heads", "flat_shape"], ["k_flat"]),
             helper.make_node("Transpose", ["k_flat"], ["k_flat_t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["k_flat_t", "kt_shape"], ["k_t"]),
             helper.make_node("Mul", ["q_heads", "root_scale"], ["q_scaled"]),
             helper.make_node("Mul", ["k_t", "root_scale"], ["k_scaled"]),
             helper.make_node("MatMul", ["q_scaled", "k_scaled"], ["scores"]),
             helper.make_node("Add", ["scores", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["probs"]),
             *attention_tail([], "masked")[1:]]
    model = model_of(nodes, {"q": [B, S, H * D], "k": [B, S, H * D], "v": [B, S, H * D], "mask": [B, 1, 1, S]},
                     ["y"], {**ATTENTION_SHAPES, "flat_shape": np.array([B * H, S, D]),
                             "kt_shape": np.array([B, H, D, S]), "root_scale": np.float32(D ** -0.25),
                             "zero": np.float32(0)}, opset=18)
    feeds = feeds_for(model)
    feeds["mask"][1] = -np.inf
    with np.errstate(invalid="ignore"):  # the all -inf rows: NaN before the guard, in ORT too
        node = assert_fused_matches(model, "attention.masked_qk_scaled_nan_guarded", "Attention", feeds)
        (y,) = evaluator(fuse_whole(model, "attention.masked_qk_scaled_nan_guarded", feeds)[0]).run(None, feeds)
    assert list(node.input) == ["q", "k", "v", "", "mask"]
    assert attrs(node)["scale"] == pytest.approx(D ** -0.5) and attrs(node)["nan_fill"] == 0.0
    assert not np.isnan(y).any() and (y[1] == 0).all()


# softmax --------------------------------------------------------------------------------------

@pytest.mark.parametrize("epilogue", ["multiply", "cast"])
def test_fused_softmax_prologue_and_epilogue(epilogue):
    last = (helper.make_node("Mul", ["p", "scale_out"], ["y"]) if epilogue == "multiply"
            else helper.make_node("Cast", ["p"], ["y"], to=TensorProto.DOUBLE))
    nodes = [helper.make_node("Div", ["x", "t"], ["xs"]), helper.make_node("Where", ["cond", "xs", "fill"], ["xw"]),
             helper.make_node("Add", ["xw", "mask"], ["xm"]), helper.make_node("Softmax", ["xm"], ["p"], axis=-1), last]
    model = model_of(nodes, {"x": [3, 5, 7], "cond": ([3, 5, 7], TensorProto.BOOL), "mask": [1, 5, 7]}, ["y"],
                     {"t": np.float32(3.0), "fill": np.float32(-1e4), "scale_out": const(7)})
    node = assert_fused_matches(model, f"softmax.scale_causal_mask_softmax_{epilogue}", "FusedSoftmax")
    assert attrs(node)["epilogue"] == epilogue.encode()


# skip norms -----------------------------------------------------------------------------------

def test_skip_layernorm_with_bias_and_the_sum_read_elsewhere():
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"]), helper.make_node("Add", ["xb", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-3)]
    model = model_of(nodes, {"x": [2, 5, 16], "skip": [2, 5, 16]}, ["y", "s"],
                     {"bias": const(16), "gamma": const(16), "beta": const(16)})
    node = assert_fused_matches(model, "skip_layernorm.bias_skip", "SkipLayerNorm")
    assert list(node.input) == ["x", "skip", "gamma", "beta", "bias"] and list(node.output) == ["y", "s"]
    assert attrs(node)["epsilon"] == pytest.approx(1e-3)


def test_skip_layernorm_takes_a_flattened_linears_bias():
    """GPT-2: the skip norm took the bias of Reshape-Gemm-Reshape; the matmul stays standard."""
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]), helper.make_node("Gemm", ["x2", "w", "b"], ["g"]),
             helper.make_node("Reshape", ["g", "back"], ["h"]), helper.make_node("Add", ["h", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 8], "skip": [1, 4, 8]}, ["y"],
                     {"w": const(8, 8), "b": const(8), "gamma": const(8), "beta": const(8),
                      "flat": np.array([-1, 8]), "back": np.array([1, 4, 8])})
    fused, feeds = fuse_whole(model, "skip_layernorm.bias_skip")
    assert [n.op_type for n in fused.graph.node] == ["Reshape", "Gemm", "Reshape", "SkipLayerNorm"]
    assert fused.graph.node[-1].input[-1] == "b" and len(fused.graph.node[1].input) == 2
    np.testing.assert_allclose(evaluator(fused).run(None, feeds)[0], reference_outputs(model, feeds)["y"],
                               rtol=1e-4, atol=1e-5)


def rms_nodes(x: str, out: str, weight: str | None = "gamma") -> list[onnx.NodeProto]:
    """x / sqrt(mean(x^2) + eps) [* weight], decomposed."""
    nodes = [helper.make_node("Pow", [x, "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["std"]),
             helper.make_node("Div", [x, "std"], ["normed" if weight else out])]
    return nodes + ([helper.make_node("Mul", ["normed", weight], [out])] if weight else [])


RMS_CONSTANTS = {"two": np.float32(2), "axes": np.array([-1]), "eps": np.float32(1e-5)}


def test_skip_rms_norm_decomposed():
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]), *rms_nodes("s", "y")]
    model = model_of(nodes, {"x": [2, 3, 16], "skip": [2, 3, 16]}, ["y"], {**RMS_CONSTANTS, "gamma": const(16)},
                     opset=18)
    node = assert_fused_matches(model, "skip_rms_norm.skip", "SkipRMSNorm")
    assert list(node.input) == ["x", "skip", "gamma"] and attrs(node)["epsilon"] == pytest.approx(1e-5)


# rewrites no fusion absorbed ------------------------------------------------------------------

def test_decomposed_layernorm_becomes_layernorm():
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]), helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"]),
             helper.make_node("Div", ["d", "std"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["ng"]),
             helper.make_node("Add", ["ng", "beta"], ["y"])]
    model = model_of(nodes, {"x": [3, 10]}, ["y"], {"two": np.float32(2), "eps": np.float32(1e-5),
                                                    "gamma": const(10), "beta": const(10)}, opset=13)
    node = assert_fused_matches(model, "layernorm_decomposed", "LayerNorm")
    assert list(node.input) == ["x", "gamma", "beta"]


def test_decomposed_rmsnorm_becomes_rmsnorm():
    model = model_of(rms_nodes("x", "y"), {"x": [3, 10]}, ["y"], {**RMS_CONSTANTS, "gamma": const(10)}, opset=18)
    assert list(assert_fused_matches(model, "rmsnorm_decomposed", "RMSNorm").input) == ["x", "gamma"]


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_decomposed_activation_becomes_activation(activation):
    act_nodes, constants, _ = ACTIVATION_NODES[activation]
    model = model_of(act_nodes, {"h": [4, 9]}, ["act"], constants)
    pattern = {"gelu": "gelu_erf"}.get(activation, activation)
    node = assert_fused_matches(model, pattern, "Activation")
    assert attrs(node)["activation"] == activation.encode()


def test_exported_hardswish_becomes_activation():
    nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
             helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Div", ["m", "six"], ["y"])]
    model = model_of(nodes, {"x": [4, 9]}, ["y"], {"three": np.float32(3), "zero": np.float32(0),
                                                  "six": np.float32(6)})
    assert attrs(assert_fused_matches(model, "hardswish", "Activation"))["activation"] == b"hardswish"


# convolutions ---------------------------------------------------------------------------------

BN = {"bn_s": const(8, low=0.5), "bn_b": const(8), "bn_m": const(8), "bn_v": const(8, low=0.5, high=2.0)}


def bn_node(x, out):
    return helper.make_node("BatchNormalization", [x, "bn_s", "bn_b", "bn_m", "bn_v"], [out], epsilon=1e-3)


def test_conv_epilogue_se_scale_bn_relu_residual_relu():
    nodes = [helper.make_node("Mul", ["x", "gate"], ["xs"]),
             helper.make_node("Conv", ["xs", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1]),
             bn_node("c", "n"), helper.make_node("Relu", ["n"], ["r"]), helper.make_node("Add", ["r", "res"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 9, 9], "gate": [1, 4, 1, 1], "res": [1, 8, 9, 9]}, ["y"],
                     {"w": const(8, 4, 3, 3), "b": const(8), **BN})
    node = assert_fused_matches(model, "conv_epilogue.conv_scaled_bias_relu_residual_relu", "ConvEpilogue")
    assert list(node.input) == ["x", "w", "b", "gate", "bn_s", "bn_b", "bn_m", "bn_v", "res"]
    found = attrs(node)
    assert found["batch_norm"] == 1 and found["post_activation"] == b"relu" and found["residual"] == b"tensor"


def test_conv_epilogue_grouped_strided_bias_add_and_clip():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], group=2, strides=[2, 2], pads=[0, 1, 1, 0],
                              dilations=[1, 2]),
             helper.make_node("Add", ["c", "b"], ["cb"]), helper.make_node("Clip", ["cb", "lo", "hi"], ["y"])]
    model = model_of(nodes, {"x": [2, 4, 11, 10]}, ["y"],
                     {"w": const(8, 2, 3, 3), "b": const(1, 8, 1, 1), "lo": np.float32(0), "hi": np.float32(6)})
    node = assert_fused_matches(model, "conv_epilogue.conv_bias_clip", "ConvEpilogue")
    assert attrs(node)["group"] == 2 and list(node.input) == ["x", "w", "b"]


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_conv_epilogue_upsampled_residual(mode):
    """FPN merge: lateral_conv(x) + Resize(top), the top map the fused node's residual."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["lat"]),
             helper.make_node("Resize", ["top", "", "scales"], ["up"], mode=mode),
             helper.make_node("Add", ["lat", "up"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 8, 8], "top": [1, 8, 4, 4]}, ["y"],
                     {"w": const(8, 4, 1, 1), "b": const(8), "scales": np.array([1, 1, 2, 2], np.float32)})
    node = assert_fused_matches(model, "conv_epilogue.conv_bias_upsampled_residual", "ConvEpilogue")
    found = attrs(node)
    assert found["residual"] == b"upsampled" and found["resize_scales"] == [1, 1, 2, 2]
    assert node.input[-1] == "top"


def test_conv_transpose_epilogue_bn_relu_and_output_padding_sigmoid():
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1],
                              output_padding=[1, 1]),
             bn_node("c", "n"), helper.make_node("Sigmoid", ["n"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(4, 8, 3, 3), "b": const(8), **BN})
    node = assert_fused_matches(model, "conv_transpose_epilogue.conv_transpose_bias_sigmoid",
                                "ConvTransposeEpilogue")
    assert attrs(node)["output_padding"] == [1, 1]


def test_conv_transpose_epilogue_bias_add_before_batch_norm_paddle_opset_12():
    """paddle2onnx's DB head (PP-OCRv4 det): ConvTranspose, bias as an Add, then a BN carrying
    ``momentum`` at opset 12, which onnx.reference alone would run with batch statistics."""
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["c"], strides=[2, 2]),
             helper.make_node("Add", ["c", "b"], ["cb"]),
             helper.make_node("BatchNormalization", ["cb", "bn_s", "bn_b", "bn_m", "bn_v"], ["n"], epsilon=1e-5,
                              momentum=0.9),
             helper.make_node("Relu", ["n"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(4, 8, 2, 2), "b": const(1, 8, 1, 1), **BN},
                     opset=12)
    node = assert_fused_matches(model, "conv_transpose_epilogue.conv_transpose_bias_relu", "ConvTransposeEpilogue")
    assert list(node.input) == ["x", "w", "b", "bn_s", "bn_b", "bn_m", "bn_v"] and attrs(node)["batch_norm"] == 1
    feeds = feeds_for(model)
    unfused = dict(zip(["y"], evaluator(model).run(None, feeds)))  # the standard BN, as a kept node runs
    np.testing.assert_allclose(unfused["y"], reference_outputs(model, feeds)["y"], rtol=1e-4, atol=1e-5)


# element-wise tails (passes/absorb_elementwise_tails.py: variants ending in _elementwise) -------

def pp_lcnet_block() -> list[onnx.NodeProto]:
    """PP-LCNetV3's conv as paddle2onnx writes it: Conv(+bias), a learned scale and shift,
    HardSwish spelled x * Clip(x + 3, 0, 6) / 6, another scale and shift, then the next Conv."""
    return [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Mul", ["c", "s1"], ["m1"], name="mul1"),
            helper.make_node("Add", ["m1", "t1"], ["a1"], name="add1"),
            helper.make_node("Add", ["a1", "three"], ["a3"], name="add3"),
            helper.make_node("Clip", ["a3", "zero", "six"], ["cl"], name="clip"),
            helper.make_node("Mul", ["a1", "cl"], ["hs6"], name="mul_x"),
            helper.make_node("Div", ["hs6", "six"], ["hs"], name="div6"),
            helper.make_node("Mul", ["hs", "s2"], ["m2"], name="mul2"),
            helper.make_node("Add", ["m2", "t2"], ["a2"], name="add2"),
            helper.make_node("Conv", ["a2", "w2", "b2"], ["y"], name="next_conv")]


PP_LCNET_CONSTANTS = {"w": const(8, 4, 3, 3), "b": const(8), "s1": np.float32(1.3), "t1": np.float32(-0.4),
                      "three": np.float32(3), "zero": np.float32(0), "six": np.float32(6), "s2": np.float32(0.8),
                      "t2": np.float32(0.25), "w2": const(6, 8, 1, 1), "b2": const(6)}


def test_conv_epilogue_takes_the_pp_lcnet_elementwise_tail():
    model = model_of(pp_lcnet_block(), {"x": [1, 4, 9, 9]}, ["y"], PP_LCNET_CONSTANTS)
    feeds = feeds_for(model)
    feeds["x"] *= 4  # reach both ends of the HardSwish clip
    type_outputs(model, feeds)
    names = [n.name for n in model.graph.node[:-1]]
    instance = FusedNodes("conv_epilogue", "conv_epilogue.conv_bias_elementwise", names,
                          [n.op_type for n in model.graph.node[:-1]], list(range(len(names))))
    result = fused_onnx(model, [instance], feeds)
    assert not result.kept, result.kept
    fused, standard_next = result.model.graph.node
    assert (fused.op_type, standard_next.op_type) == ("ConvEpilogue", "Conv")
    found = attrs(fused)
    assert found["tail"] == [b"mul", b"add", b"hardswish", b"mul", b"add"] and "activation" not in found
    assert list(fused.input) == ["x", "w", "b", "", "", "", "", "", "", "s1", "t1", "s2", "t2"]
    (expected,) = reference_outputs(model, feeds).values()
    (actual,) = evaluator(result.model).run(None, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_hardswish_with_other_constants_is_not_a_tail_step():
    """x * Clip(x + 3, 0, 5) / 6 is no HardSwish: the conv's nodes are kept, with the reason."""
    model = model_of(pp_lcnet_block(), {"x": [1, 4, 9, 9]}, ["y"], {**PP_LCNET_CONSTANTS, "zero": np.float32(-1)})
    feeds = feeds_for(model)
    names = [n.name for n in model.graph.node[:-1]]
    instance = FusedNodes("conv_epilogue", "conv_epilogue.conv_bias_elementwise", names,
                          [n.op_type for n in model.graph.node[:-1]], list(range(len(names))))
    result = fused_onnx(model, [instance], feeds)
    assert "other than a = 3, b = 0, c = 6" in result.kept[0].reason


def test_gemm_epilogue_tail_reversed_operands_activation_and_residual():
    """matmul + bias + silu, then c - x, / c, max with a constant and a residual add, all in the tail."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["sg"]), helper.make_node("Mul", ["h", "sg"], ["act"]),
             helper.make_node("Mul", ["act", "k"], ["scaled"]), helper.make_node("Sub", ["k", "scaled"], ["d"]),
             helper.make_node("Div", ["d", "k"], ["q"]), helper.make_node("Max", ["q", "floor"], ["mx"]),
             helper.make_node("Add", ["res", "mx"], ["y"])]
    model = model_of(nodes, {"x": [2, 3, 8], "res": [2, 3, 5]}, ["y"],
                     {"w": const(8, 5), "b": const(5), "k": np.float32(1.7), "floor": np.float32(-0.2)})
    node = assert_fused_matches(model, "gemm_epilogue.matmul_bias_silu_elementwise", "GemmEpilogue")
    found = attrs(node)
    assert found["activation"] == b"silu" and found["has_residual"] == 0
    assert found["tail"] == [b"mul", b"rsub", b"div", b"max", b"add"]
    assert list(node.input) == ["x", "w", "b", "", "k", "k", "k", "floor", "res"]


def test_conv_transpose_epilogue_tail_with_clip_params():
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Mul", ["r", "k"], ["m"]),
             helper.make_node("Clip", ["m", "lo", "hi"], ["cl"]), helper.make_node("Neg", ["cl"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(4, 8, 2, 2), "b": const(8),
                                                       "k": np.float32(2), "lo": np.float32(-0.5),
                                                       "hi": np.float32(0.5)})
    node = assert_fused_matches(model, "conv_transpose_epilogue.conv_transpose_bias_relu_elementwise",
                                "ConvTransposeEpilogue")
    found = attrs(node)
    assert found["activation"] == b"relu" and found["tail"] == [b"mul", b"clip", b"neg"]
    assert found["tail_params"] == [-0.5, 0.5]


def test_a_tail_without_the_elementwise_variant_keeps_the_nodes():
    """conv_bias (no tail absorbed by TVM) followed by a Sub: not the fusion TVM made."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), helper.make_node("Sub", ["c", "k"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(8, 4, 1, 1), "b": const(8), "k": np.float32(2)})
    feeds = feeds_for(model)
    type_outputs(model, feeds)
    instance = FusedNodes("conv_epilogue", "conv_epilogue.conv_bias", ["#0", "#1"], ["Conv", "Sub"], [0, 1])
    assert "Sub after the conv's epilogue" in fused_onnx(model, [instance], feeds).kept[0].reason


def test_conv_epilogue_takes_a_folded_per_channel_scale_and_shift():
    """captcha CRNN's convs: a BatchNormalization exported as conv * s + t (conv_affine_fold
    folds it, leaving conv_bias_relu), written as a BN without mean and variance."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "s"], ["cs"]), helper.make_node("Add", ["cs", "t"], ["ct"]),
             helper.make_node("Relu", ["ct"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(8, 4, 3, 3), "s": const(1, 8, 1, 1, low=0.5),
                                                          "t": const(1, 8, 1, 1)})
    node = assert_fused_matches(model, "conv_epilogue.conv_bias_relu", "ConvEpilogue")
    assert list(node.input) == ["x", "w", "", "", "s", "t"]
    assert attrs(node)["affine"] == 1 and attrs(node)["batch_norm"] == 0 and attrs(node)["activation"] == b"relu"


def test_a_scale_that_is_not_per_channel_keeps_the_nodes():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    model = model_of(nodes, {"x": [1, 4, 5, 5]}, ["y"], {"w": const(8, 4, 1, 1), "s": const(5)})
    feeds = feeds_for(model)
    type_outputs(model, feeds)
    instance = FusedNodes("conv_epilogue", "conv_epilogue.conv_bias", ["#0", "#1"], ["Conv", "Mul"], [0, 1])
    assert "Mul by other than a per-channel constant" in fused_onnx(model, [instance], feeds).kept[0].reason


def test_squeeze_excitation():
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]), helper.make_node("Conv", ["p", "w1", "b1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r"]), helper.make_node("Conv", ["r", "w2", "b2"], ["c2"]),
             helper.make_node("HardSigmoid", ["c2"], ["y"], alpha=1 / 6, beta=0.5)]
    model = model_of(nodes, {"x": [2, 8, 5, 5]}, ["y"],
                     {"w1": const(4, 8, 1, 1), "b1": const(4), "w2": const(8, 4, 1, 1), "b2": const(8)})
    node = assert_fused_matches(model, "squeeze_excitation.se_relu_hardsigmoid", "SqueezeExcitation")
    assert list(node.input) == ["x", "w1", "b1", "w2", "b2"] and attrs(node)["gate"] == b"hardsigmoid"


def test_squeeze_excitation_without_biases():
    """As torch's dynamo exporter writes it (all-zero biases dropped): the biases are empty inputs."""
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]), helper.make_node("Conv", ["p", "w1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r"]), helper.make_node("Conv", ["r", "w2"], ["c2"]),
             helper.make_node("Sigmoid", ["c2"], ["y"])]
    model = model_of(nodes, {"x": [2, 8, 5, 5]}, ["y"], {"w1": const(4, 8, 1, 1), "w2": const(8, 4, 1, 1)})
    node = assert_fused_matches(model, "squeeze_excitation.se_relu_sigmoid", "SqueezeExcitation")
    assert list(node.input) == ["x", "w1", "", "w2"] and attrs(node)["gate"] == b"sigmoid"  # trailing "" dropped


def test_resize_merge_concat_of_resized_and_plain_levels():
    nodes = [helper.make_node("Resize", ["p5", "", "s4"], ["u5"], mode="nearest"),
             helper.make_node("Resize", ["p4", "", "s2"], ["u4"], mode="nearest"),
             helper.make_node("Concat", ["u5", "u4", "p3"], ["y"], axis=1)]
    model = model_of(nodes, {"p5": [1, 2, 2, 2], "p4": [1, 2, 4, 4], "p3": [1, 2, 8, 8]}, ["y"],
                     {"s4": np.array([1, 1, 4, 4], np.float32), "s2": np.array([1, 1, 2, 2], np.float32)})
    node = assert_fused_matches(model, "resize_merge.concat3", "ResizeMerge")
    assert attrs(node)["resized"] == [1, 1, 0] and list(node.input) == ["p5", "p4", "p3"]


def test_resize_merge_add_with_sizes_and_relu():
    nodes = [helper.make_node("Resize", ["top", "", "", "sizes"], ["up"], mode="linear",
                              coordinate_transformation_mode="half_pixel"),
             helper.make_node("Add", ["lat", "up"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    model = model_of(nodes, {"top": [1, 3, 4, 4], "lat": [1, 3, 8, 8]}, ["y"], {"sizes": np.array([1, 3, 8, 8])})
    node = assert_fused_matches(model, "resize_merge.add_relu", "ResizeMerge")
    assert attrs(node)["merge"] == b"add" and attrs(node)["scales"] == [1, 1, 2, 2]


def test_add_eye_like():
    nodes = [helper.make_node("EyeLike", ["x"], ["eye"], k=1), helper.make_node("Add", ["eye", "other"], ["y"])]
    model = model_of(nodes, {"x": [5, 7], "other": [5, 7]}, ["y"], {})
    node = assert_fused_matches(model, "eye_like_add.add_eye_like", "AddEyeLike")
    assert attrs(node)["k"] == 1 and list(node.input) == ["x", "other"]


def test_gemm_epilogue_tail_of_a_log_mel_spectrogram():
    """A filterbank matmul, then ``sqrt(10 * log(clip(x, 1e-10)) / log(10)) ** 2``: the clip its
    activation, log, mul, div, abs, sqrt and pow in the tail."""
    nodes = [helper.make_node("MatMul", ["x", "mel"], ["mm"]), helper.make_node("Clip", ["mm", "lo", "hi"], ["c"]),
             helper.make_node("Log", ["c"], ["lg"]), helper.make_node("Mul", ["lg", "ten"], ["db"]),
             helper.make_node("Div", ["db", "ln10"], ["q"]), helper.make_node("Abs", ["q"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["r"]), helper.make_node("Pow", ["r", "two"], ["y"])]
    model = model_of(nodes, {"x": [1, 5, 16]}, ["y"],
                     {"mel": np.abs(const(16, 8)), "lo": np.float32(1e-10), "hi": np.float32(1e10),
                      "ten": np.float32(10), "ln10": np.float32(np.log(10)), "two": np.float32(2)})
    node = assert_fused_matches(model, "gemm_epilogue.matmul_clip_elementwise", "GemmEpilogue")
    assert attrs(node)["tail"] == [b"log", b"mul", b"div", b"abs", b"sqrt", b"pow"]
