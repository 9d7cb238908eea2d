"""EinsumAsMatmul: contractions written as Einsum become matmuls the patterns and rules know."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion import api
from tvm_fusion.passes.einsum_as_matmul import EinsumAsMatmul, parse_equation


def _rewritten(module):
    return EinsumAsMatmul()(module)


def test_heads_first_scores_are_a_matmul_by_the_transposed_keys():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 2, 5, 4), "float32"), k: R.Tensor((1, 2, 6, 4), "float32")):
            with R.dataflow():
                s = R.einsum((q, k), "bhqd,bhkd->bhqk")
                R.output(s)
            return s

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 2, 5, 4), "float32"), k: R.Tensor((1, 2, 6, 4), "float32")):
            with R.dataflow():
                kt = R.permute_dims(k, [0, 1, 3, 2])
                s = R.matmul(q, kt)
                R.output(s)
            return s

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_heads_transposed_operands_are_put_heads_first():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((2, 5, 3, 4), "float32"), k: R.Tensor((2, 6, 3, 4), "float32")):
            with R.dataflow():
                s = R.einsum((q, k), "bqhd,bkhd->bhqk")
                R.output(s)
            return s

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((2, 5, 3, 4), "float32"), k: R.Tensor((2, 6, 3, 4), "float32")):
            with R.dataflow():
                qh = R.permute_dims(q, [0, 2, 1, 3])
                kt = R.permute_dims(k, [0, 2, 3, 1])
                s = R.matmul(qh, kt)
                R.output(s)
            return s

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_a_batched_matmul_with_broadcast_dims_is_one_matmul():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3, 4, 5), "float32"), b: R.Tensor((2, 3, 5, 6), "float32")):
            with R.dataflow():
                c = R.einsum((a, b), "...ij,...jk->...ik")
                R.output(c)
            return c

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3, 4, 5), "float32"), b: R.Tensor((2, 3, 5, 6), "float32")):
            with R.dataflow():
                c = R.matmul(a, b)
                R.output(c)
            return c

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_a_dense_layer_into_heads_keeps_its_rows_and_merges_the_output_axes():
    """jax2tf/keras write a dense layer into heads as ``bsd,dhk->bshk``: (rows, d) @ (d, h*k)."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 8), "float32"), w: R.Tensor((8, 2, 4), "float32")):
            with R.dataflow():
                y = R.einsum((x, w), "bsd,dhk->bshk")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 8), "float32"), w: R.Tensor((8, 2, 4), "float32")):
            with R.dataflow():
                w2 = R.reshape(w, R.shape([8, 8]))
                y2 = R.matmul(x, w2)
                y = R.reshape(y2, R.shape([2, 3, 2, 4]))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_one_operand_is_a_transpose_or_a_sum():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((3, 4, 5), "float32")):
            with R.dataflow():
                b = R.einsum((a,), "ijk->kj")
                R.output(b)
            return b

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((3, 4, 5), "float32")):
            with R.dataflow():
                s = R.sum(a, axis=[0])
                b = R.permute_dims(s, [1, 0])
                R.output(b)
            return b

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_three_operands_are_contracted_left_to_right():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((3, 4), "float32"), c: R.Tensor((4, 5), "float32")):
            with R.dataflow():
                d = R.einsum((a, b, c), "ij,jk,kl->il")
                R.output(d)
            return d

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((3, 4), "float32"), c: R.Tensor((4, 5), "float32")):
            with R.dataflow():
                ab = R.matmul(a, b)
                d = R.matmul(ab, c)
                R.output(d)
            return d

    tvm.ir.assert_structural_equal(_rewritten(Before), Expected)


def test_a_trace_keeps_its_einsum():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((3, 3), "float32")):
            with R.dataflow():
                d = R.einsum((a,), "ii->i")
                R.output(d)
            return d

    tvm.ir.assert_structural_equal(_rewritten(Before), Before)


def test_equations_with_ellipsis_and_implicit_output():
    parsed = parse_equation("...ij,...jk", [4, 3])
    assert parsed.inputs == (("a", "b", "i", "j"), ("b", "j", "k")) and parsed.output == ("a", "b", "i", "k")
    assert parse_equation("bij,bjk", [3, 3]).output == ("i", "k")  # numpy: indices used once, sorted
    assert parse_equation("ij,jk->ik", [2, 2, 2]) is None  # three operands for two terms
    assert parse_equation("ij->ik", [2]) is None  # an output index no operand has


EQUATIONS = [
    ("bhqd,bhkd->bhqk", [(1, 2, 5, 4), (1, 2, 6, 4)]),
    ("bqhd,bkhd->bhqk", [(2, 5, 3, 4), (2, 6, 3, 4)]),
    ("bhqk,bhkd->bqhd", [(1, 2, 5, 6), (1, 2, 6, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 6)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bij,bjk", [(2, 3, 4), (2, 4, 5)]),
    ("bsd,dhk->bshk", [(2, 3, 8), (8, 2, 4)]),
    ("...d,dn->...n", [(2, 3, 8), (8, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,jk->i", [(2, 3), (3, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("ijk->kj", [(3, 4, 5)]),
    ("ii->i", [(3, 3)]),
]


def _einsum_model(equation: str, shapes: list[tuple]) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(shapes))]
    out = np.einsum(equation, *[np.zeros(s, np.float32) for s in shapes]).shape
    graph = helper.make_graph(
        [helper.make_node("Einsum", names, ["y"], equation=equation, name="einsum")], "einsum",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(names, shapes)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("equation, shapes", EQUATIONS, ids=[e for e, _ in EQUATIONS])
def test_every_spelling_matches_onnx_runtime(equation, shapes, tmp_path, config_path):
    path = tmp_path / "einsum.onnx"
    onnx.save(_einsum_model(equation, shapes), path)
    result = api.compile_model(path, config_path(), output_dir=tmp_path / "build")  # verified, or it raises
    assert result.metadata["verification"]["outputs"][0]["max_abs"] <= 1e-4
    kept = "R.einsum" in api.ModelSession(path).fused(api.ModelSession(path).prepared(config_path())).module.script()
    assert kept == (equation == "ii->i")


def _attention_model(heads_first: bool) -> onnx.ModelProto:
    """Q, K, V projections split into heads, scores and context as Einsum, heads merged."""
    batch, seq, heads, dim = 1, 8, 2, 16
    scores, context = (("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd") if heads_first else
                       ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"))
    nodes = [helper.make_node("Reshape", [f"{n}_proj", "heads"], [f"{n}_split"], name=f"split_{n}") for n in "qkv"]
    if heads_first:
        nodes += [helper.make_node("Transpose", [f"{n}_split"], [n], perm=[0, 2, 1, 3], name=f"t_{n}") for n in "qkv"]
    else:
        nodes += [helper.make_node("Identity", [f"{n}_split"], [n], name=f"id_{n}") for n in "qkv"]
    nodes += [helper.make_node("Einsum", ["q", "k"], ["s"], equation=scores, name="scores"),
              helper.make_node("Mul", ["s", "scale"], ["scaled"], name="scale"),
              helper.make_node("Softmax", ["scaled"], ["p"], axis=-1, name="softmax"),
              helper.make_node("Einsum", ["p", "v"], ["o"], equation=context, name="context")]
    if heads_first:
        nodes.append(helper.make_node("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3], name="t_o"))
    nodes.append(helper.make_node("Reshape", ["o_t" if heads_first else "o", "merged"], ["y"], name="merge"))
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info(f"{n}_proj", TensorProto.FLOAT, [batch, seq, heads * dim]) for n in "qkv"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, heads * dim])],
        [numpy_helper.from_array(np.array(dim ** -0.5, np.float32), "scale"),
         numpy_helper.from_array(np.array([batch, seq, heads, dim], np.int64), "heads"),
         numpy_helper.from_array(np.array([batch, seq, heads * dim], np.int64), "merged")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("heads_first", [True, False], ids=["bhqd", "bqhd"])
def test_einsum_attention_is_one_attention_kernel(heads_first, tmp_path, config_path):
    path = tmp_path / "attention.onnx"
    onnx.save(_attention_model(heads_first), path)
    inspected = api.inspect_model(path, config_path())
    assert inspected.report.fired == {"attention": 1} and inspected.kernels == 1
    api.compile_model(path, config_path(), output_dir=tmp_path / "build")  # verified against ONNX Runtime
