"""Bf16Matmuls: matmuls by constant float32 weights become bf16 kernels (frontend/bf16_matmul.py)
on an AMX-BF16 target, at the top level and inside our patterns' composites, and the module is
left as it was for a weight that is not a constant, a non-float32 product, a symbolic row
count, a parameter read elsewhere too, and a target without AMX-BF16 (or none)."""

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
import tvm
from machine import host_target
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.config import load_config
from tvm_fusion.frontend.bf16_matmul import pack_weight
from tvm_fusion.passes.bf16_matmuls import Bf16Matmuls
from tvm_fusion.passes.pipeline import GRAPH_PHASES, fusion_pipeline, lowering_passes
from tvm_fusion.patterns import PatternReport

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
HOST = tvm.target.Target(host_target())
WEIGHT = np.random.default_rng(0).standard_normal((24, 20)).astype(np.float32)


def ops(mod: tvm.IRModule) -> list[str]:
    found = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name) if isinstance(
                e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def kernel_weights(mod: tvm.IRModule) -> list[np.ndarray]:
    """The packed bf16 weights (uint16 constants) anywhere in ``mod``."""
    found = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e.value.numpy()) if isinstance(
                e, tvm.ir.GenericConst) and e.value.dtype == "uint16" else None)
    return found


def run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    lowered = tvm.transform.Sequential(lowering_passes())(mod)
    return relax.VirtualMachine(tvm.compile(lowered, target=HOST), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


@I.ir_module
class Dense:
    @R.function
    def main(x: R.Tensor((3, 24), "float32")):
        with R.dataflow():
            y = R.matmul(x, R.const(WEIGHT))
            gv = R.nn.relu(y)
            R.output(gv)
        return gv


@I.ir_module
class TransposedDense:
    @R.function
    def main(x: R.Tensor((2, 3, 24), "float32")):
        with R.dataflow():
            t = R.permute_dims(R.const(np.ascontiguousarray(WEIGHT.T)), axes=[1, 0])
            gv = R.matmul(x, t)
            R.output(gv)
        return gv


@pytest.mark.parametrize("before, shape", [(Dense, (3, 24)), (TransposedDense, (2, 3, 24))],
                         ids=["x@W", "x@permute_dims(W)"])
def test_a_matmul_by_a_constant_becomes_the_bf16_kernel(before, shape):
    after = Bf16Matmuls(AMX)(before)
    assert "relax.matmul" not in ops(after) and "relax.permute_dims" not in ops(after)
    (packed,) = kernel_weights(after)
    np.testing.assert_array_equal(packed, pack_weight(WEIGHT))
    assert any(gv.name_hint.startswith("bf16_matmul") for gv in after.get_global_vars())
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ra, rw = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, WEIGHT))
    expected = ra @ rw if before is TransposedDense else np.maximum(ra @ rw, 0)
    np.testing.assert_allclose(run(after, x), expected, rtol=1e-5, atol=1e-5)  # float32 sums of 24 products


def test_the_current_target_is_used_when_none_is_given():
    with AMX:
        assert "relax.matmul" not in ops(Bf16Matmuls()(Dense))


@I.ir_module
class WeightInput:
    @R.function
    def main(x: R.Tensor((3, 24), "float32"), w: R.Tensor((24, 20), "float32")):
        with R.dataflow():
            gv = R.matmul(x, w)
            R.output(gv)
        return gv


@I.ir_module
class HalfPrecision:
    @R.function
    def main(x: R.Tensor((3, 24), "float16")):
        with R.dataflow():
            gv = R.matmul(x, R.const(WEIGHT.astype(np.float16)))
            R.output(gv)
        return gv


@I.ir_module
class SymbolicRows:
    @R.function
    def main(x: R.Tensor(("n", 24), "float32")):
        with R.dataflow():
            gv = R.matmul(x, R.const(WEIGHT))
            R.output(gv)
        return gv


@pytest.mark.parametrize("before", [WeightInput, HalfPrecision, SymbolicRows],
                         ids=["weight-not-constant", "float16", "symbolic-rows"])
def test_must_not_rewrite_other_operands(before):
    tvm.ir.assert_structural_equal(Bf16Matmuls(AMX)(before), before)


@pytest.mark.parametrize("mcpu", ["znver4", "cooperlake", "skylake-avx512", "znver3"])
def test_must_not_rewrite_for_a_target_without_amx_bf16(mcpu):
    """AVX512_BF16 alone (znver4, cooperlake) is not enough: no kernel there beats float32."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert Bf16Matmuls(target)(Dense).same_as(Dense)


def test_must_not_rewrite_without_a_target():
    assert Bf16Matmuls()(Dense).same_as(Dense)


def mlp_model() -> onnx.ModelProto:
    """MatMul + Add + Gelu (our gemm_epilogue pattern's composite), then a Gemm with transB=1."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W", (16, 32)), ("B", (32,)), ("W2", (48, 32)))]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["y"]), helper.make_node("Add", ["y", "B"], ["z"]),
             helper.make_node("Gelu", ["z"], ["g"]), helper.make_node("Gemm", ["g", "W2"], ["out"], transB=1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 48])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_matmuls_in_our_composites_and_at_the_top_level_become_bf16_kernels():
    """After the graph phases the first matmul is in a composite, its weight a parameter bound
    to a constant at the one call: the composite takes the packed weight instead. The result
    stays within bf16 rounding of ONNX Runtime's float32 (relative to the output's scale)."""
    model = mlp_model()
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(
        from_onnx(model))
    composites = [f for _, f in fused.functions_items() if isinstance(f, relax.Function) and "Composite" in (f.attrs or {})]
    assert composites and "relax.matmul" in ops(tvm.IRModule({"c": composites[0]}))
    after = Bf16Matmuls(AMX)(fused)
    assert "relax.matmul" not in ops(after)
    assert len(kernel_weights(after)) == 2
    (composite,) = [f for _, f in after.functions_items() if isinstance(f, relax.Function) and "Composite" in (f.attrs or {})]
    assert [str(p.ty.dtype) for p in composite.params] == ["float32", "uint16", "float32"]
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"X": x})[0]
    got = run(after, x)
    assert np.abs(got - expected).max() <= 2e-2 * np.abs(expected).max()  # two bf16 roundings, K=16 and 32


@I.ir_module
class SharedParameter:
    @R.function(private=True)
    def composite(x: R.Tensor((3, 24), "float32"), w: R.Tensor((24, 20), "float32")) -> R.Tensor((3, 20), "float32"):
        R.func_attr({"Composite": "test.matmul_and_sum", "Primitive": True})
        with R.dataflow():
            y = R.matmul(x, w)
            gv = R.add(y, R.sum(w, axis=[0]))
            R.output(gv)
        return gv

    @R.function
    def main(x: R.Tensor((3, 24), "float32")):
        cls = SharedParameter
        with R.dataflow():
            gv = cls.composite(x, R.const(WEIGHT))
            R.output(gv)
        return gv


def test_must_not_rewrite_a_composite_weight_read_elsewhere_too():
    tvm.ir.assert_structural_equal(Bf16Matmuls(AMX)(SharedParameter), SharedParameter)
