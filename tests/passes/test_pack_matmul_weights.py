"""PackMatmulWeights: a constant matmul weight in column panels [N/P, K, P], the kernel over
whole panels; the result matches ONNX Runtime and the unfused module on widths P divides and
on widths it does not."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import tirx as T

import helpers
from machine import host_target
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.pack_matmul_weights import PackMatmulWeights, pack_columns
from tvm_fusion.targets.target_info import vector_lanes

TARGET = tvm.target.Target(host_target())
LANES = vector_lanes(TARGET, "float32")
PANEL = 2 * LANES  # two vectors: MatmulEpilogue's column tile
# Stated tolerances: float32 sums over K <= 64, in a different order than ONNX Runtime's.
RTOL, ATOL = 1e-4, 1e-4


def _matmul_bias_module(columns: int, weight_is_constant: bool = True):
    """``x[2, 3] @ w[3, columns] + b`` as FuseTIR leaves it: one kernel, called once."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3, columns)).astype(np.float32)
    bias = rng.standard_normal(columns).astype(np.float32)

    @T.prim_func(private=True, s_tir=True)
    def matmul_bias(x: T.Buffer((T.int64(2), T.int64(3)), "float32"),
                    w: T.Buffer((T.int64(3), T.int64(columns)), "float32"),
                    b: T.Buffer((T.int64(columns),), "float32"),
                    out: T.Buffer((T.int64(2), T.int64(columns)), "float32")):
        T.func_attr({"tirx.noalias": True})
        mm = T.sblock_alloc_buffer((T.int64(2), T.int64(columns)))
        for i, j, k in T.grid(T.int64(2), T.int64(columns), T.int64(3)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                T.reads(x[vi, vk], w[vk, vj])
                T.writes(mm[vi, vj])
                with T.init():
                    mm[vi, vj] = T.float32(0.0)
                mm[vi, vj] = mm[vi, vj] + x[vi, vk] * w[vk, vj]
        for i, j in T.grid(T.int64(2), T.int64(columns)):
            with T.sblock("T_add"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(mm[vi, vj], b[vj])
                T.writes(out[vi, vj])
                out[vi, vj] = mm[vi, vj] + b[vj]

    return _calling_main(matmul_bias, weight if weight_is_constant else None, bias, columns), weight, bias


def _calling_main(kernel: tvm.tirx.PrimFunc, weight, bias: np.ndarray, columns: int) -> tvm.IRModule:
    """``kernel`` and a ``main`` that calls it on its input ``x``, the weight (a constant, or
    ``main``'s second input when None) and the bias constant."""
    builder = relax.BlockBuilder()
    gvar = builder.add_func(kernel, "matmul_bias")
    params = [relax.Var("x", relax.TensorType((2, 3), "float32"))]
    if weight is None:
        params.append(relax.Var("w", relax.TensorType((3, columns), "float32")))
    with builder.function("main", params):
        with builder.dataflow():
            args = [params[0], params[1] if weight is None else relax.const(weight), relax.const(bias)]
            out = builder.emit_output(relax.call_tir(gvar, args, relax.TensorType((2, columns), "float32")))
        builder.emit_func_output(out)
    return builder.get()


def test_constant_weight_is_packed_in_column_panels():
    columns = 2 * PANEL
    panels = columns // PANEL
    before, weight, bias = _matmul_bias_module(columns)

    @T.prim_func(private=True, s_tir=True)
    def packed(x: T.Buffer((T.int64(2), T.int64(3)), "float32"),
               w: T.Buffer((T.int64(panels), T.int64(3), T.int64(PANEL)), "float32"),
               b: T.Buffer((T.int64(columns),), "float32"),
               out: T.Buffer((T.int64(2), T.int64(columns)), "float32")):
        T.func_attr({"tirx.noalias": True})
        mm = T.sblock_alloc_buffer((T.int64(2), T.int64(panels), T.int64(PANEL)))
        for i, jo, ji, k in T.grid(T.int64(2), T.int64(panels), T.int64(PANEL), T.int64(3)):
            with T.sblock("matmul"):
                vi, vjo, vji, vk = T.axis.remap("SSSR", [i, jo, ji, k])
                T.reads(x[vi, vk], w[vjo, vk, vji])
                T.writes(mm[vi, vjo, vji])
                with T.init():
                    mm[vi, vjo, vji] = T.float32(0.0)
                mm[vi, vjo, vji] = mm[vi, vjo, vji] + x[vi, vk] * w[vjo, vk, vji]
        for i, j in T.grid(T.int64(2), T.int64(columns)):
            with T.sblock("T_add"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(mm[vi, vj // T.int64(PANEL), vj % T.int64(PANEL)], b[vj])
                T.writes(out[vi, vj])
                out[vi, vj] = mm[vi, vj // T.int64(PANEL), vj % T.int64(PANEL)] + b[vj]

    expected = _calling_main(packed, pack_columns(weight, PANEL), bias, columns)
    tvm.ir.assert_structural_equal(PackMatmulWeights(TARGET)(before), expected)


def test_pack_columns_pads_the_last_panel_with_zeros():
    weight = np.arange(2 * 5, dtype=np.float32).reshape(2, 5)
    packed = pack_columns(weight, 4)
    assert packed.shape == (2, 2, 4)
    np.testing.assert_array_equal(packed[1, :, 0], weight[:, 4])
    np.testing.assert_array_equal(packed[1, :, 1:], 0)
    np.testing.assert_array_equal(packed.transpose(1, 0, 2).reshape(2, 8)[:, :5], weight)


@pytest.mark.parametrize("case", ["weight computed at run time", "whole vectors off the panel",
                                  "narrower than a vector"])
def test_must_not_pack(case):
    if case == "weight computed at run time":
        before, _, _ = _matmul_bias_module(2 * PANEL, weight_is_constant=False)
    elif case == "whole vectors off the panel":  # a padded panel would add 1/3 multiply-adds
        before, _, _ = _matmul_bias_module(PANEL + LANES)
    else:
        before, _, _ = _matmul_bias_module(LANES - 3)
    tvm.ir.assert_structural_equal(PackMatmulWeights(TARGET)(before), before)


def _linear(rows: int, depth: int, columns: int, epilogue: bool) -> onnx.ModelProto:
    """A classifier-head Gemm (weight [N, K], transB=1, as torch exports Linear) + Relu, or a
    bare MatMul whose kernel writes the model's output directly."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((columns, depth)).astype(np.float32) * 0.2
    if epilogue:
        inits = [numpy_helper.from_array(weight, "w"),
                 numpy_helper.from_array(rng.standard_normal(columns).astype(np.float32), "b")]
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1), helper.make_node("Relu", ["g"], ["y"])]
    else:
        inits = [numpy_helper.from_array(np.ascontiguousarray(weight.T), "w")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, columns])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("rows, columns, epilogue",
                         [(37, 8 * PANEL + 3, True), (1, 4 * PANEL, True), (6, 8 * PANEL, True), (5, 3 * PANEL, False),
                          (32, 59, True), (3, PANEL + 3, False), (2, LANES + 3, True)],
                         ids=["odd rows, width off the panel", "one row", "whole panels", "no epilogue",
                              "59 tags", "width off the vector", "under two vectors"])
def test_packed_linear_matches_onnxruntime_and_unfused(tmp_path, rows, columns, epilogue):
    depth = 40
    model = _linear(rows, depth, columns, epilogue)
    path = tmp_path / "linear.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    kernels = {gvar.name_hint: func for gvar, func in optimized.module.functions_items()
               if isinstance(func, tvm.tirx.PrimFunc)}
    packed = [name for name, func in kernels.items()
              if any(len(param.ty.shape) == 3 and int(param.ty.shape[2]) in (LANES, PANEL) for param in func.params
                     if hasattr(param.ty, "shape"))]
    assert packed, f"no kernel took a packed weight: {list(kernels)}"
    assert all(optimized.schedule_rules[name] == "MatmulEpilogue" for name in packed), optimized.schedule_rules
    inputs = {"x": np.random.default_rng(1).standard_normal((rows, depth)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)
