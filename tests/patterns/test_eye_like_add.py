"""EyeLike + Add -> one kernel (AddEyeLike), the seed's worked example; exact against ONNX Runtime."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper
from machine import host_target
from tvm import relax

from tvm_fusion import api
from tvm_fusion.config import parse_config
from tvm_fusion.errors import ModelError
from tvm_fusion.kernels.eye_like import emit_eye_like
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.runtime import CompiledModel


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("eye_like_add")], report)(mod), report


def eye_like_add_model(shape=(8, 8), k=0, dtype=None, input_type=TensorProto.FLOAT,
                       eye_first=True) -> onnx.ModelProto:
    """y = EyeLike(x; k, dtype) + b, the seed's graph; x may have another dtype than b."""
    attrs = {"k": k} if dtype is None else {"k": k, "dtype": dtype}
    add_inputs = ["eye", "b"] if eye_first else ["b", "eye"]
    graph = helper.make_graph(
        [helper.make_node("EyeLike", ["x"], ["eye"], name="eye_like", **attrs),
         helper.make_node("Add", add_inputs, ["y"], name="add")],
        "eye_like_add",
        [helper.make_tensor_value_info("x", input_type, list(shape)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def compile_onnx(model, tmp_path, patterns):
    path = tmp_path / f"model-{len(patterns)}.onnx"
    onnx.save(model, str(path))
    cfg = parse_config({"target": host_target(),
                        "pipeline": {"patterns": patterns}}, name="test")
    prepared = api.prepare(path, cfg)
    optimized = api.optimize(prepared)
    compiled = CompiledModel(api.build(optimized.module, cfg),
                             {"inputs": [s.to_json() for s in prepared.inputs],
                              "outputs": [{"name": n} for n in prepared.output_names], "threads": 2})
    return compiled, optimized


def relax_eye_like_add(shape=(4, 6), other_shape=None, k=1, second_consumer=False):
    """add(b, EyeLike(x)) as the frontend imports it."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    b = relax.Var("b", relax.TensorType(other_shape or shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, b]):
        with bb.dataflow():
            eye = bb.emit(emit_eye_like(bb, x, k, "float32"))
            out = bb.emit(relax.op.add(b, eye))
            if second_consumer:
                out = bb.emit(relax.op.multiply(out, eye))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def test_eye_like_add_becomes_one_composite():
    after, report = fuse(relax_eye_like_add())
    assert report.variants["eye_like_add.add_eye_like"] == 1
    composites = [f for _, f in after.functions_items()
                  if isinstance(f, relax.Function) and f.attrs and "Composite" in f.attrs]
    assert len(composites) == 1
    assert [b.value.op.name for b in composites[0].body.blocks[0].bindings] == [
        "relax.call_tir", "relax.add"]
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert len(calls) == 1


@pytest.mark.parametrize("shape, k, dtype, input_type, eye_first", [
    ((8, 8), 0, None, TensorProto.FLOAT, True),
    ((48, 40), 3, None, TensorProto.FLOAT, False),      # k above the diagonal, bias-first Add
    ((40, 48), -5, TensorProto.FLOAT, TensorProto.INT64, True),  # dtype attribute != input dtype
])
def test_onnx_eye_like_add_is_exact_against_onnxruntime_and_unfused(tmp_path, shape, k, dtype,
                                                                    input_type, eye_first):
    model = eye_like_add_model(shape, k, dtype, input_type, eye_first)
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 9, shape) if input_type == TensorProto.INT64 else rng.standard_normal(shape))
    inputs = {"x": x.astype("int64" if input_type == TensorProto.INT64 else "float32"),
              "b": rng.standard_normal(shape).astype("float32")}
    fused, optimized = compile_onnx(model, tmp_path, ["eye_like_add"])
    assert optimized.report.fired["eye_like_add"] == 1
    assert list(optimized.schedule_rules.values()) == ["Injective"]
    (kernel,) = [f for _, f in optimized.module.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert "eye_like" not in kernel.script()  # the identity is inlined, never stored
    unfused, _ = compile_onnx(model, tmp_path, [])
    (expected,) = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    got = fused.run(inputs)["y"]
    np.testing.assert_array_equal(got, expected)  # adding 0 or 1: exact
    np.testing.assert_array_equal(unfused.run(inputs)["y"], got)


def test_must_not_fuse_when_the_other_operand_broadcasts():
    before = relax_eye_like_add((4, 4), other_shape=(2, 4, 4))
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the other operand of the add, shape (2, 4, 4), does not match the identity's shape "
        "(4, 4) (the add would broadcast)"]


def test_must_not_fuse_when_the_identity_has_a_second_consumer():
    before = relax_eye_like_add((4, 4), second_consumer=True)
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == ["the identity is also used outside the add"]


def test_identity_of_symbolic_shape_fuses_and_runs_at_any_size():
    """One kernel for every (n, m): the identity is computed from the indices."""
    n, m = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("m", "int64")
    after, report = fuse(relax_eye_like_add((n, m), k=1))
    assert report.variants["eye_like_add.add_eye_like"] == 1
    assert not report.near_misses
    vm = relax.VirtualMachine(tvm.compile(relax.get_pipeline("zero")(after), target=tvm.target.Target("llvm")),
                              tvm.cpu())
    for shape in ((3, 5), (6, 4)):
        x, b = np.zeros(shape, "float32"), np.arange(np.prod(shape), dtype="float32").reshape(shape)
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(b)).numpy()
        np.testing.assert_array_equal(got, b + np.eye(*shape, k=1, dtype="float32"))


def test_must_not_fuse_when_the_other_operand_has_another_symbolic_shape():
    """(n, k) is not provably (n, m): the add might broadcast."""
    n, m, k = (tvm.tirx.Var(name, "int64") for name in "nmk")
    before = relax_eye_like_add((n, m), other_shape=(n, k))
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the other operand of the add, shape (n, k), does not match the identity's shape (n, m) "
        "(the add would broadcast)"]


def test_onnx_eye_like_on_a_3d_input_is_a_model_error_naming_the_node(tmp_path):
    model = eye_like_add_model((2, 4, 4))
    path = tmp_path / "eye3d.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match="EyeLike node 'eye_like': its input has rank 3"):
        api.prepare(path, parse_config({"target": {"kind": "llvm"}, "pipeline": {}}, name="test"))


def test_must_not_fuse_a_kernel_that_only_shares_the_eye_like_name():
    """Recognized by our tvm_fusion.kernel attribute, not by the function's name."""
    before = relax_eye_like_add((4, 4))
    (gvar,) = [gv for gv, f in before.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    before[gvar] = before[gvar].without_attr("tvm_fusion.kernel")
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        f"kernel {gvar.name_hint!r} is not our eye_like kernel (its tvm_fusion.kernel attribute is not 'eye_like')"]
