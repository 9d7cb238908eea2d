"""The generic-rule guard: a contraction or a heavy kernel that only Reduction, Injective or
Fallback scheduled is named by compile and inspect; profile marks kernels far off their roof."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from tvm import te

from tvm_fusion import api
from tvm_fusion.commands.profile.report import KernelProfile
from tvm_fusion.kernels.costs import has_contraction, kernel_costs


def _prim_func(compute):
    return te.create_prim_func(compute())


def test_a_matmul_is_a_contraction_and_a_sum_of_squares_is_not():
    def matmul():
        a, b = te.placeholder((4, 8), name="a"), te.placeholder((8, 3), name="b")
        k = te.reduce_axis((0, 8), name="k")
        return [a, b, te.compute((4, 3), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k))]

    def squares():
        x = te.placeholder((4, 8), name="x")
        k = te.reduce_axis((0, 8), name="k")
        return [x, te.compute((4,), lambda i: te.sum(x[i, k] * x[i, k], axis=k))]

    def scaled():
        x, y = te.placeholder((4, 8), name="x"), te.placeholder((4, 8), name="y")
        return [x, y, te.compute((4, 8), lambda i, j: x[i, j] * y[i, j])]

    assert has_contraction(_prim_func(matmul))
    assert not has_contraction(_prim_func(squares))
    assert not has_contraction(_prim_func(scaled))  # a product, but no reduction


def _diagonal_einsum_model() -> onnx.ModelProto:
    """``ii,ij->j``: the diagonal of A times B's rows. A repeated index keeps the Einsum (no
    matmul spells it), so a generic rule schedules its contraction."""
    graph = helper.make_graph(
        [helper.make_node("Einsum", ["a", "b"], ["y"], equation="ii,ij->j", name="diag_einsum")], "diag",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [16, 16]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [16, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_compile_and_inspect_name_a_contraction_left_to_a_generic_rule(tmp_path, config_path):
    path = tmp_path / "diag.onnx"
    onnx.save(_diagonal_einsum_model(), path)
    said: list[str] = []
    result = api.compile_model(path, config_path(), output_dir=tmp_path / "build", progress=said.append)
    (kernel,) = result.metadata["generic_kernels"]
    assert kernel["contraction"] and kernel["rule"] in ("Reduction", "Injective", "Fallback")
    assert kernel["onnx_nodes"] == ["diag_einsum"] and kernel["flops"] == 2 * 16 * 32
    assert any(m.startswith(f"WARNING: kernel {kernel['kernel']}") and "holds a contraction" in m for m in said)
    inspected = api.inspect_model(path, config_path())
    assert [k.kernel for k in inspected.generic_kernels] == [kernel["kernel"]]


def _reduced_model(axes: list[int] | None) -> onnx.ModelProto:
    """y = x @ w + ReduceMax(|x|) (over everything, or the given axes): the reduction does most of
    the float work the guard counts."""
    node = helper.make_node
    nodes = [node("Abs", ["x"], ["a"]), node("Sin", ["a"], ["s"]),
             node("ReduceMax", ["s"] + (["axes"] if axes is not None else []), ["m"], keepdims=1),
             node("MatMul", ["x", "w"], ["xw"]), node("Add", ["xw", "m"], ["y"])]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [256, 1], np.ones(256, np.float32))]
    if axes is not None:
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes))
    graph = helper.make_graph(nodes, "reduced", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_a_tensor_reduced_to_one_value_is_reductions_own_but_a_heavy_row_reduction_is_named(tmp_path, config_path):
    """A whole tensor's max (quantization's min and max) has its proper rule in Reduction; the same
    work reduced per row is a kernel the guard names."""
    found = {}
    for name, axes in (("whole", None), ("rows", [1])):
        path = tmp_path / f"{name}.onnx"
        onnx.save(_reduced_model(axes), path)
        inspected = api.inspect_model(path, config_path())
        found[name] = [(k.rule, k.contraction) for k in inspected.generic_kernels]
    assert found["whole"] == []
    assert found["rows"] and all(not contraction for _, contraction in found["rows"])


def test_a_model_whose_kernels_all_have_their_rules_reports_none(mlp_build):
    assert mlp_build.metadata["generic_kernels"] == []


def _kernel(roof_percent: float, share: float) -> KernelProfile:
    return KernelProfile("k", "single op", "Reduction", "reduction", 1, 10.0, 10.0, share, 100, 100, 1.0, 1.0,
                         1.0, "memory", roof_percent, [])


def test_profile_marks_a_slow_kernel_that_takes_real_time():
    assert _kernel(roof_percent=4.0, share=0.2).far_off_roof
    assert not _kernel(roof_percent=4.0, share=0.01).far_off_roof  # far off, but it hardly matters
    assert not _kernel(roof_percent=40.0, share=0.5).far_off_roof
    assert np.isfinite(_kernel(4.0, 0.2).total_us)


def test_an_int8_matmul_is_work_in_the_guards_shares_though_no_flops():
    """Integer products count where the guard weighs a kernel's share (an int8 model's LSTM
    products are most of its work), never as FLOPs for the roofline."""
    def int8_matmul():
        a, b = te.placeholder((4, 8), "uint8", name="a"), te.placeholder((8, 3), "int8", name="b")
        k = te.reduce_axis((0, 8), name="k")
        return [a, b, te.compute((4, 3), lambda i, j: te.sum(a[i, k].astype("int32") * b[k, j].astype("int32"),
                                                              axis=k))]

    func = _prim_func(int8_matmul)
    assert kernel_costs(func)[0] == 0
    assert kernel_costs(func, integers=True)[0] == 2 * 4 * 3 * 8
