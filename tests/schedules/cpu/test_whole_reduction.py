"""WholeTensorReduction: a whole tensor's min, max or sum split into vector partials (and across
cores past a size), the kernels it leaves to Reduction, and DynamicQuantizeLinear through the
whole pipeline against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from helpers import write_config
from loop_structure import blocks_in, loop_kinds
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.op import max as reduce_max, min as reduce_min, nn, sum as reduce_sum, tanh

import tvm_fusion
from tvm_fusion.api import compile_model
from tvm_fusion.schedules.cpu import Reduction, WholeTensorReduction, whole_reduction
from tvm_fusion.schedules.registry import rule_name, rules_for_kind
from tvm_fusion.verify import reference_outputs

REDUCTIONS = {"min": (reduce_min, np.min), "max": (reduce_max, np.max), "sum": (reduce_sum, np.sum)}


def only_kernel(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


def scheduled(func, target) -> tvm.tirx.PrimFunc:
    sch = WholeTensorReduction().apply(func, target, False)
    assert sch is not None, "WholeTensorReduction declined"
    return sch.mod["main"]


def run(func, target, x: np.ndarray, out_shape=()) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    lib["main"](tvm.runtime.tensor(x), out)
    return out.numpy()


def small_integers(shape, seed: int = 0) -> np.ndarray:
    """Whole numbers in [-8, 8] as float32: a float32 sum of them is exact in any order, so a
    sum split into partials must equal numpy's exactly; the extremes sit in the last element
    (the tail a split must not drop) and the first."""
    x = np.random.default_rng(seed).integers(-8, 9, shape).astype("float32")
    x.flat[-1], x.flat[0] = -100.0, 100.0
    return x


@pytest.mark.parametrize("kind", sorted(REDUCTIONS))
@pytest.mark.parametrize("shape", [(4099,), (7, 13, 45), (3, 1000), (1, 256), (1, 32, 32, 512)])
def test_whole_tensor_equals_numpy(lowered, target, lanes, kind, shape):
    """Prime, odd and vector-multiple lengths: every element counted once (exact sums of whole
    numbers, extremes at both ends), each task's steps on vectors of several registers."""
    relax_op, numpy_op = REDUCTIONS[kind]
    func = scheduled(only_kernel(lowered(relax_op, x=shape)), target)
    x = small_integers(shape)
    np.testing.assert_array_equal(run(func, target, x), numpy_op(x))
    vectors = loop_kinds(func).vectorized
    assert len(vectors) == 2 and vectors[0] == vectors[1] and lanes <= vectors[0] <= 4 * lanes  # init, update
    assert loop_kinds(func).parallel == []  # below MIN_PARALLEL_ELEMENTS: one core


def test_float_sum_within_reordering_tolerance(lowered, target):
    """A float32 sum of 512K normal values summed in another order: within 1e-5 of the sum of
    magnitudes (a dropped or doubled element is ~1, a lost lane far more)."""
    shape = (32, 32, 512)
    x = np.random.default_rng(1).standard_normal(shape).astype("float32")
    got = run(scheduled(only_kernel(lowered(reduce_sum, x=shape)), target), target, x)
    np.testing.assert_allclose(got, x.astype(np.float64).sum(), rtol=0, atol=1e-5 * np.abs(x).sum())


@pytest.mark.parametrize("kind", ["min", "sum"])
def test_large_tensors_split_across_cores(lowered, target, monkeypatch, kind):
    """Past MIN_PARALLEL_ELEMENTS each core takes a contiguous share (a length the cores do not
    divide: the last share shorter) and combines its lanes before the final combine."""
    monkeypatch.setattr(whole_reduction, "MIN_PARALLEL_ELEMENTS", 1)
    relax_op, numpy_op = REDUCTIONS[kind]
    shape = (3, 4099)
    func = scheduled(only_kernel(lowered(relax_op, x=shape)), target)
    assert loop_kinds(func).parallel == [2]  # host_target's 2 cores
    x = small_integers(shape)
    np.testing.assert_array_equal(run(func, target, x), numpy_op(x))


def test_a_few_outputs_are_reduced_each_across_cores(lowered, target, monkeypatch):
    """Three row maxima: the rows and the cores' shares in one parallel loop."""
    monkeypatch.setattr(whole_reduction, "MIN_PARALLEL_ELEMENTS", 1)
    shape = (3, 4096)
    func = scheduled(only_kernel(lowered(lambda x: reduce_max(x, axis=[1]), x=shape)), target)
    assert loop_kinds(func).parallel == [3 * 2]
    x = small_integers(shape)
    np.testing.assert_array_equal(run(func, target, x, (3,)), x.max(axis=1))


def test_keepdims_output(lowered, target):
    shape = (4, 1000)
    func = scheduled(only_kernel(lowered(lambda x: reduce_min(x, keepdims=True), x=shape)), target)
    x = small_integers(shape)
    np.testing.assert_array_equal(run(func, target, x, (1, 1)), x.min(keepdims=True))


def test_element_wise_prologue_is_read_inside_the_reduction(target):
    """tanh fused into the min by FuseOps: computed in the vector loop, no intermediate tensor."""
    x_var = relax.Var("x", relax.TensorType((32, 32, 512), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x_var]):
        with bb.dataflow():
            out = bb.emit_output(reduce_min(tanh(x_var)))
        bb.emit_func_output(out)
    fused = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                      relax.transform.FuseOps(), relax.transform.FuseTIR()])(bb.get())
    func = only_kernel(fused)
    assert len(blocks_in(func)) == 2  # tanh, then the min
    ours = scheduled(func, target)
    assert not any(buf.name.startswith("compute") for buf in ours.body.block.alloc_buffers)
    x = np.random.default_rng(2).standard_normal((32, 32, 512)).astype("float32")
    np.testing.assert_allclose(run(ours, target, x), run(func, target, x), rtol=1e-6)


def test_symbolic_length_matches_numpy_at_any_size(target):
    """[n, 512]: cores' shares of a run-time length, one core for a small n."""
    n = tvm.tirx.Var("n", "int64")
    x_var = relax.Var("x", relax.TensorType([n, 512], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x_var]):
        with bb.dataflow():
            out = bb.emit_output(reduce_max(x_var))
        bb.emit_func_output(out)
    mod = relax.get_pipeline("zero")(bb.get())
    (gvar,) = [gv for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    func = scheduled(mod[gvar], target)
    assert loop_kinds(func).parallel == [2]  # the copy for a large n; a serial one beside it
    mod[gvar] = func.with_attr("tirx.is_scheduled", True)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    for rows in (1, 7, 300):
        x = small_integers((rows, 512), rows)
        assert vm["main"](tvm.runtime.tensor(x)).numpy() == x.max()


@pytest.mark.parametrize("fn, shape", [
    (lambda x: nn.softmax(x, axis=-1), (4, 512)),        # several reductions: Reduction's rows
    (lambda x: reduce_sum(x, axis=[1]), (128, 256)),      # more outputs than MAX_OUTPUTS
    (lambda x: reduce_sum(x, axis=[0]), (4096, 2)),       # a column sum: strided reads
    (reduce_max, (13,)),                                  # shorter than two vectors
])
def test_declines_what_reduction_schedules(lowered, target, fn, shape):
    func = only_kernel(lowered(fn, x=shape))
    assert WholeTensorReduction().apply(func, target, False) is None
    assert Reduction().apply(func, target, False) is not None


def test_asked_before_pooling_and_reduction():
    names = [rule_name(rule) for rule in rules_for_kind("llvm")]
    assert names.index("WholeTensorReduction") < min(names.index("Pooling"), names.index("Reduction"))


def dynamic_quantize_model(shape) -> onnx.ModelProto:
    """tashkeel-bilstm-int8's attention quantization: one DynamicQuantizeLinear of a whole tensor."""
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero_point"], name="quantize")
    graph = helper.make_graph([node], "quantize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("q", TensorProto.UINT8, list(shape)),
                               helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("zero_point", TensorProto.UINT8, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("shape", [(1, 32, 32, 512), (3, 4099)])
def test_dynamic_quantize_linear_equals_onnxruntime_bit_for_bit(tmp_path, shape):
    """Its min and max scheduled by this rule; q, scale and zero point are ONNX Runtime's exactly."""
    model = dynamic_quantize_model(shape)
    onnx.save(model, tmp_path / "dql.onnx")
    config = write_config(tmp_path / "host.toml", "default", dims={})
    dims = "x".join(str(d) for d in shape)
    result = compile_model(tmp_path / "dql.onnx", config, [f"x:{dims}"], output_dir=tmp_path / "build")
    rules = result.metadata["schedule_rules"]
    assert sorted(k.rstrip("0123456789") for k, r in rules.items() if r == "WholeTensorReduction") == ["max", "min"], rules
    x = np.tanh(np.random.default_rng(3).standard_normal(shape)).astype("float32")
    x.flat[-1] = 1.0  # the largest value in the last element
    expected = reference_outputs(model, {"x": x})
    got = tvm_fusion.load(result.artifact).run({"x": x})
    assert len(np.unique(expected["q"])) > 200  # a spread: the check means something
    for name, theirs in expected.items():
        assert got[name].dtype == theirs.dtype and np.array_equal(got[name], theirs), name
