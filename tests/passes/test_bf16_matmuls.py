"""Bf16Matmuls: matmuls by constant float32 weights become bf16 kernels (frontend/bf16_matmul.py)
on a target with AMX-BF16 or AVX512_BF16, at the top level and inside our patterns' composites, and the module is
left as it was for a weight that is not a constant, a non-float32 product, a symbolic row
count, a parameter read elsewhere too, a target with neither (or none), and a matmul the
per-kernel bf16 gate declined (named by its binding)."""

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
import tvm
import tvm_ffi
from machine import host_target
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.config import load_config
from tvm_fusion.frontend.bf16_conv import BF16_PATCHES
from tvm_fusion.frontend.bf16_matmul import pack_weight
from tvm_fusion.frontend.conv_patches import DIRECT_INPUT
from tvm_fusion.passes.bf16_matmuls import Bf16Matmuls, bf16_candidates
from tvm_fusion.passes.blocked_layout_legalize import winograd_tile_of
from tvm_fusion.passes.pipeline import GRAPH_PHASES, fusion_pipeline, lowering_passes
from tvm_fusion.patterns import PatternReport

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
HOST = tvm.target.Target(host_target())
WEIGHT = np.random.default_rng(0).standard_normal((24, 20)).astype(np.float32)


def op_calls(mod: tvm.IRModule) -> list[relax.Call]:
    """Every call of an operator in ``mod``'s Relax functions."""
    found = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(
                e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def ops(mod: tvm.IRModule) -> list[str]:
    return [call.op.name for call in op_calls(mod)]


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


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "znver3"])
def test_must_not_rewrite_for_a_target_without_bf16_dot_products(mcpu):
    """Neither AMX-BF16 nor AVX512_BF16: the kernel would run as float32 FMAs on widened bf16."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    assert Bf16Matmuls(target)(Dense).same_as(Dense)


@pytest.mark.parametrize("mcpu", ["znver4", "cooperlake"])
def test_avx512_bf16_without_amx_rewrites_as_amx_does(mcpu):
    """The same kernel: Bf16MatmulAvx512 puts it on vdpbf16ps registers, not tiles."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    tvm.ir.assert_structural_equal(Bf16Matmuls(target)(Dense), Bf16Matmuls(AMX)(Dense))


def test_without_amx_rows_are_padded_to_the_register_tiles():
    """2 x 3 rows are 6, padded to 8 for vdpbf16ps tiles of 4 rows (AMX tiles take any count);
    the outputs are the bf16 product all the same."""
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    slices = lambda mod: [c for c in op_calls(mod) if c.op.name == "relax.strided_slice"]
    padded, tiles = Bf16Matmuls(zen4)(TransposedDense), Bf16Matmuls(AMX)(TransposedDense)
    axes = lambda mod: [[int(a) for a in c.args[1]] for c in slices(mod)]
    assert axes(padded) == [[0, 1]] and axes(tiles) == [[1]]  # N 20 is sliced from 32 in both
    x = np.random.default_rng(1).standard_normal((2, 3, 24)).astype(np.float32)
    np.testing.assert_array_equal(run(padded, x), run(tiles, x))


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


OTHER = np.random.default_rng(5).standard_normal((24, 20)).astype(np.float32)
SECOND = np.random.default_rng(6).standard_normal((20, 20)).astype(np.float32)


@I.ir_module
class SharedComposite:
    """One composite for two layers of one shape, as our patterns make it for a transformer's."""

    @R.function(private=True)
    def dense(x: R.Tensor((3, 20), "float32"), w: R.Tensor((20, 20), "float32")) -> R.Tensor((3, 20), "float32"):
        R.func_attr({"Composite": "test.dense", "Primitive": True})
        with R.dataflow():
            gv = R.matmul(x, w)
            R.output(gv)
        return gv

    @R.function
    def main(x: R.Tensor((3, 20), "float32")):
        cls = SharedComposite
        with R.dataflow():
            first = cls.dense(x, R.const(WEIGHT[:20]))
            gv = cls.dense(first, R.const(SECOND))
            R.output(gv)
        return gv


def test_a_composite_called_for_several_layers_takes_each_calls_own_packed_weight():
    after = Bf16Matmuls(AMX)(SharedComposite)
    assert "relax.matmul" not in ops(after)
    packed = kernel_weights(after)
    assert len(packed) == 2 and not np.array_equal(packed[0], packed[1])
    assert {w.tobytes() for w in packed} == {pack_weight(WEIGHT[:20]).tobytes(), pack_weight(SECOND).tobytes()}
    x = np.random.default_rng(7).standard_normal((3, 20)).astype(np.float32)
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731 - the kernel's operand rounding
    first = (bf16(x) @ bf16(WEIGHT[:20])).astype(np.float32)
    expected = bf16(first) @ bf16(SECOND)
    np.testing.assert_allclose(run(after, x), expected, rtol=1e-4, atol=1e-4)
    candidates = bf16_candidates(SharedComposite, AMX)
    assert len(candidates) == 2 and {c.weight.tobytes() for c in candidates} == {WEIGHT[:20].tobytes(), SECOND.tobytes()}


def test_one_call_of_a_shared_composite_is_declined_by_its_key():
    """``gv#1``: the second layer keeps calling the float32 composite, kept beside the rewrite,
    and the first takes its packed weight; ``gv`` alone would decline both."""
    assert [c.key for c in bf16_candidates(SharedComposite, AMX)] == ["gv#0", "gv#1"]
    after = Bf16Matmuls(AMX, frozenset({"gv#1"}))(SharedComposite)
    (packed,) = kernel_weights(after)
    np.testing.assert_array_equal(packed, pack_weight(WEIGHT[:20]))
    composites = sorted([str(p.ty.dtype) for p in f.params] for _, f in after.functions_items()
                        if isinstance(f, relax.Function) and "Composite" in (f.attrs or {}))
    assert composites == [["float32", "float32"], ["float32", "uint16"]]  # the float32 one and its rewrite
    x = np.random.default_rng(8).standard_normal((3, 20)).astype(np.float32)
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731 - the kernel's operand rounding
    first = (bf16(x) @ bf16(WEIGHT[:20])).astype(np.float32)
    np.testing.assert_allclose(run(after, x), first.astype(np.float64) @ SECOND, rtol=1e-5, atol=1e-4)
    tvm.ir.assert_structural_equal(Bf16Matmuls(AMX, frozenset({"gv#0", "gv#1"}))(SharedComposite), SharedComposite)


@I.ir_module
class SharedCompositeOneInput:
    @R.function(private=True)
    def dense(x: R.Tensor((3, 20), "float32"), w: R.Tensor((20, 20), "float32")) -> R.Tensor((3, 20), "float32"):
        R.func_attr({"Composite": "test.dense", "Primitive": True})
        with R.dataflow():
            gv = R.matmul(x, w)
            R.output(gv)
        return gv

    @R.function
    def main(x: R.Tensor((3, 20), "float32"), w: R.Tensor((20, 20), "float32")):
        cls = SharedCompositeOneInput
        with R.dataflow():
            first = cls.dense(x, R.const(SECOND))
            gv = cls.dense(first, w)
            R.output(gv)
        return gv


def test_must_not_rewrite_a_shared_composite_whose_weight_is_an_input_at_one_call():
    tvm.ir.assert_structural_equal(Bf16Matmuls(AMX)(SharedCompositeOneInput), SharedCompositeOneInput)


@I.ir_module
class TwoMatmuls:
    @R.function
    def main(x: R.Tensor((3, 24), "float32")):
        with R.dataflow():
            kept = R.matmul(x, R.const(WEIGHT))
            taken = R.matmul(x, R.const(OTHER))
            gv = R.add(kept, taken)
            R.output(gv)
        return gv


def test_a_declined_matmul_stays_float32_and_the_other_becomes_bf16():
    after = Bf16Matmuls(AMX, frozenset({"kept"}))(TwoMatmuls)
    assert ops(after).count("relax.matmul") == 1
    (packed,) = kernel_weights(after)
    np.testing.assert_array_equal(packed, pack_weight(OTHER))
    x = np.random.default_rng(6).standard_normal((3, 24)).astype(np.float32)
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ OTHER.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(run(after, x), x.astype(np.float64) @ WEIGHT + rounded, rtol=1e-5, atol=1e-4)


def test_declining_every_matmul_leaves_the_module_as_it_was():
    tvm.ir.assert_structural_equal(Bf16Matmuls(AMX, frozenset({"kept", "taken"}))(TwoMatmuls), TwoMatmuls)


def test_the_candidates_are_what_the_pass_rewrites_with_their_activations():
    """A top-level matmul reads a variable of main; one in a composite reads the composite's
    parameter, given as its argument at the one call. Listing them changes nothing."""
    assert [(c.name, c.activation.name) for c in bf16_candidates(TwoMatmuls, AMX)] == [("kept", "x"), ("taken", "x")]
    np.testing.assert_array_equal(bf16_candidates(TwoMatmuls, AMX)[1].weight, OTHER)
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(mlp_model()))
    candidates = bf16_candidates(fused, AMX)
    assert len(candidates) == 2 and all(isinstance(c.activation, relax.Var) for c in candidates)
    assert {c.weight.shape for c in candidates} == {(16, 32), (32, 48)}  # the Gemm's transB=1 weight as [K, N]
    main_params = {p.name for p in fused["main"].params}
    assert any(c.activation.name in main_params for c in candidates)  # the composite's x is main's input


def test_a_matmul_in_a_composite_is_declined_by_its_binding_name():
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(mlp_model()))
    inside = next(c.name for c in bf16_candidates(fused, AMX) if c.weight.shape == (16, 32))
    after = Bf16Matmuls(AMX, frozenset({inside}))(fused)
    assert len(kernel_weights(after)) == 1  # the Gemm's
    (composite,) = [f for _, f in after.functions_items()
                    if isinstance(f, relax.Function) and "Composite" in (f.attrs or {})]
    assert [str(p.ty.dtype) for p in composite.params] == ["float32"] * 3  # its weight stays a float32 parameter


@I.ir_module
class ActivationInside:
    @R.function(private=True)
    def composite(x: R.Tensor((3, 24), "float32"), w: R.Tensor((24, 20), "float32")) -> R.Tensor((3, 20), "float32"):
        R.func_attr({"Composite": "test.relu_matmul", "Primitive": True})
        with R.dataflow():
            r = R.nn.relu(x)
            gv = R.matmul(r, w)
            R.output(gv)
        return gv

    @R.function
    def main(x: R.Tensor((3, 24), "float32")):
        cls = ActivationInside
        with R.dataflow():
            gv = cls.composite(x, R.const(WEIGHT))
            R.output(gv)
        return gv


def test_a_candidate_whose_composite_computes_its_activation_has_none_to_judge_on():
    (candidate,) = bf16_candidates(ActivationInside, AMX)
    assert candidate.name == "gv" and candidate.activation is None
    assert len(kernel_weights(Bf16Matmuls(AMX)(ActivationInside))) == 1  # still rewritten: the outputs' gate judges it


# An image whose two dense convs have enough multiply-adds for bf16 (``MIN_CONV_MACS``: 4.7M and 9.4M).
HEIGHT, WIDTH = 32, 32


def cnn_model(height: int = HEIGHT, width: int = WIDTH) -> onnx.ModelProto:
    """An RGB stem conv, then two 3x3 convs with bias and ReLU (our conv_epilogue composite,
    one composite for both, in the blocked layout), then a depthwise conv."""
    rng = np.random.default_rng(8)
    shapes = {"W0": (16, 3, 3, 3), "W1": (32, 16, 3, 3), "B1": (32,), "W2": (32, 32, 3, 3), "B2": (32,),
              "W3": (32, 1, 3, 3)}
    inits = [numpy_helper.from_array((0.2 * rng.standard_normal(s)).astype(np.float32), n) for n, s in shapes.items()]
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    nodes = [helper.make_node("Conv", ["X", "W0"], ["c0"], **conv),
             helper.make_node("Conv", ["c0", "W1", "B1"], ["c1"], **conv), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], **conv), helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "W3"], ["out"], group=32, **conv)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 3, height, width])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 32, height, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_calls(mod: tvm.IRModule) -> list[relax.Call]:
    return [call for call in op_calls(mod) if call.op.name == "relax.nn.conv2d"]


def test_dense_convs_become_bf16_kernels_and_the_stem_and_depthwise_stay_float32():
    """The two 3x3 convs (in composites, blocked) take packed weights, each call its own; the
    RGB stem (3 input channels) and the depthwise conv are still conv2d. Within bf16 rounding of
    ONNX Runtime's float32, relative to the output's scale."""
    model = cnn_model()
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(model))
    assert len(conv_calls(fused)) == 4
    after = Bf16Matmuls(AMX)(fused)
    remaining = conv_calls(after)
    assert sorted(int(call.attrs.groups) for call in remaining) == [1, 32]
    (stem,) = [call for call in remaining if int(call.attrs.groups) == 1]
    assert int(stem.args[0].ty.shape.values[1]) == 3
    assert len(kernel_weights(after)) == 2
    candidates = bf16_candidates(fused, AMX)
    assert len(candidates) == 2 and all(c.conv is not None for c in candidates)
    x = np.random.default_rng(9).standard_normal((1, 3, HEIGHT, WIDTH)).astype(np.float32)
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"X": x})[0]
    got = run(after, x)
    assert np.abs(got - expected).max() <= 2e-2 * np.abs(expected).max()
    assert np.abs(got - expected).max() > 1e-5 * np.abs(expected).max()  # bf16 was used


def test_must_not_take_convs_too_small_for_tiles_to_pay():
    """The same convs on an 8 x 8 image (0.3M and 0.6M multiply-adds, under ``MIN_CONV_MACS``)
    stay float32 convs: their patches and calls cost more than the tiles save."""
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(cnn_model(8, 8)))
    after = Bf16Matmuls(AMX)(fused)
    assert sorted(int(call.attrs.groups) for call in conv_calls(after)) == [1, 1, 1, 32]
    assert not bf16_candidates(fused, AMX)


def test_a_conv_candidates_rows_times_its_weight_is_its_conv():
    """What the per-kernel gate multiplies: the candidate's patch rows of its activation by its
    ``[K, Co]`` weight are the conv's output pixels (here the first dense conv, on the stem's output)."""
    model = cnn_model()
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(model))
    first = bf16_candidates(fused, AMX)[0]
    stem_out = np.random.default_rng(10).standard_normal((1, 16, HEIGHT, WIDTH)).astype(np.float32)
    weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "W1"))
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, HEIGHT, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    conv = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    expected = onnxruntime.InferenceSession(conv.SerializeToString()).run(None, {"x": stem_out})[0]
    activation = stem_out.reshape(1, 1, 16, HEIGHT, WIDTH).transpose(0, 1, 3, 4, 2)  # NCHW16c, as the conv reads it
    got = first.rows(activation) @ first.weight
    np.testing.assert_allclose(got.reshape(HEIGHT, WIDTH, 32).transpose(2, 0, 1)[None], expected, rtol=1e-4, atol=1e-4)


def test_without_amx_a_conv_that_float32_runs_by_winograd_stays_float32():
    """On vdpbf16ps registers (Zen 4) a direct bf16 3x3 conv does 2.25-4x Winograd's
    multiply-adds at under twice the FMAs' peak: the two 3x3 convs stay float32 unless the
    config turns Winograd off; on AMX tiles they take the bf16 kernel either way."""
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(cnn_model()))
    assert len([call for call in conv_calls(fused) if winograd_tile_of(call)]) == 2  # not the stem nor the depthwise
    assert Bf16Matmuls(zen4)(fused).same_as(fused) and not bf16_candidates(fused, zen4)
    assert len(kernel_weights(Bf16Matmuls(zen4, winograd=False)(fused))) == 2
    assert len(bf16_candidates(fused, zen4, winograd=False)) == 2
    assert len(kernel_weights(Bf16Matmuls(AMX)(fused))) == 2


def test_must_not_take_a_conv_of_fewer_output_channels_than_a_column_block():
    """basic-pitch's one-channel heads: 16 columns computed for each one kept."""
    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array((0.2 * rng.standard_normal((1, 32, 3, 3))).astype(np.float32), "W")
    node = helper.make_node("Conv", ["X", "W"], ["out"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 32, 32, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 32, 32])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(model))
    assert len(conv_calls(fused)) == 1 and int(conv_calls(fused)[0].ty.shape.values[1]) == 1
    assert Bf16Matmuls(AMX)(fused).same_as(fused) and not bf16_candidates(fused, AMX)


def patch_row_shapes(mod: tvm.IRModule) -> list[tuple[int, ...]]:
    """The rows of each bf16 conv kernel's patch matrix (its last axis, K, left off)."""
    shapes = []

    def visit(block):
        if block.name_hint == BF16_PATCHES.patches_name:
            shapes.append(tuple(int(d) for d in block.writes[0].source.shape[:-1]))

    for func in mod.functions.values():
        if isinstance(func, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, visit))
    return shapes


def test_register_tiles_keep_a_conv_per_output_row_that_four_divides():
    """76 output columns: no divisor from an AMX tile's 5 to 16, so AMX's patch rows run over
    every pixel (a tile may straddle two output rows); 4
    divides them, so register tiles of 4 rows keep each output row's pixels together and the
    epilogue follows each tile (picodet-layout's 1x1 convs over 100x76 on Zen 4)."""
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(cnn_model(8, 76)))
    assert patch_row_shapes(Bf16Matmuls(AMX)(fused)) == [(8 * 76,)] * 2
    assert patch_row_shapes(Bf16Matmuls(zen4, winograd=False)(fused)) == [(8, 76)] * 2


def test_on_amx_a_conv_of_whole_tile_rows_of_channels_reads_its_input_directly():
    """The second 3x3 conv's 32 channels are one 32-k tile row of bf16 per tap: on AMX its
    patch block is marked for the tiles to read the input directly (pixel major); the first
    conv's 16 channels are read by kernel rows (48 k padded to 64); on Zen 4's registers both
    keep their patches."""
    def marked(mod):
        found = []

        def visit(block):
            if block.name_hint == BF16_PATCHES.patches_name:
                found.append(DIRECT_INPUT in block.annotations)

        for func in mod.functions.values():
            if isinstance(func, tvm.tirx.PrimFunc):
                tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, visit))
        return sorted(found)

    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(from_onnx(cnn_model()))
    assert marked(Bf16Matmuls(AMX)(fused)) == [True, True]
    assert marked(Bf16Matmuls(zen4, winograd=False)(fused)) == [False, False]
    # the bf16 gate's candidates see the convs as the pass builds them for each target
    assert {c.conv.tile_row_depth for c in bf16_candidates(fused, AMX)} == {32}
    assert {c.conv.tile_row_depth for c in bf16_candidates(fused, zen4, winograd=False)} == {0}


def one_conv_model(channels: int, out_channels: int, kernel: list[int], strides: list[int], pads: list[int],
                   height: int, width: int) -> onnx.ModelProto:
    rng = np.random.default_rng(6)
    weight = numpy_helper.from_array((0.2 * rng.standard_normal((out_channels, channels, *kernel))).astype(np.float32), "W")
    node = helper.make_node("Conv", ["X", "W"], ["out"], kernel_shape=kernel, strides=strides, pads=pads)
    out = [(size + pads[i] + pads[i + 2] - kernel[i]) // strides[i] + 1 for i, size in enumerate((height, width))]
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                             [1, channels, height, width])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, out_channels, *out])],
                              [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("channels, out_channels, kernel, strides, pads, height, width, rewritten", [
    (24, 32, [3, 1], [1, 1], [1, 0, 1, 0], 48, 48, True),  # oww-embedding's: 24 channels stay NCHW
    (8, 32, [5, 5], [1, 3], [2, 1, 2, 1], 64, 200, True),  # basic-pitch's
    (3, 64, [7, 7], [2, 2], [3, 3, 3, 3], 96, 96, True),  # an RGB stem, its channels padded to 4
    (3, 16, [3, 3], [2, 2], [1, 1, 1, 1], 192, 192, False),  # one column of tiles
    (1, 32, [1, 64], [1, 4], [0, 0, 0, 0], 8, 1024, False),  # a filter over a raw signal
], ids=["24-channels-3x1", "8-channels-strided", "rgb-stem", "rgb-stem-16-out", "one-channel-filter"])
def test_an_nchw_conv_is_rewritten_unless_its_patches_do_not_pay(channels, out_channels, kernel, strides, pads,
                                                                  height, width, rewritten):
    """An NCHW input (too few channels for whole blocks) converted pixel major, each kernel row
    of a patch one run of values; not for one output tile of columns or one input channel."""
    fused = fusion_pipeline(load_config(None), PatternReport(), phases=GRAPH_PHASES)(
        from_onnx(one_conv_model(channels, out_channels, kernel, strides, pads, height, width)))
    (conv,) = conv_calls(fused)
    assert str(conv.attrs.data_layout) == "NCHW"
    assert len(kernel_weights(Bf16Matmuls(AMX)(fused))) == int(rewritten)
    assert len(bf16_candidates(fused, AMX)) == int(rewritten)
