"""ONNX Clip (imported as call_tir maximum/minimum) -> R.clip, so it can join a GEMM epilogue.

Our frontend marks the two kernels; a maximum and minimum without the mark are not a Clip.
"""

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend import onnx as stock_onnx

from tvm_fusion.config import parse_config
from tvm_fusion.frontend.converters import from_onnx
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport


def matmul_clip_model(constant_bounds: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 16)).astype("float32"), "w")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])]
    initializers = [weight]
    if constant_bounds:
        initializers += [numpy_helper.from_array(np.array(0.0, "float32"), "lo"),
                         numpy_helper.from_array(np.array(6.0, "float32"), "hi")]
    else:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("lo", "hi")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Clip", ["mm", "lo", "hi"], ["y"])],
        "matmul_clip", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def import_onnx(model: onnx.ModelProto):
    """Our frontend (which marks the Clip kernels), with the model's own input shapes."""
    return from_onnx(model, shape_dict={}, dtype_dict={})


def config(patterns):
    return parse_config({"target": {"kind": "llvm"}, "pipeline": {"patterns": patterns, "schedule": "none"}},
                        name="test")


def test_relu6_clip_is_recognized_and_fused_into_the_matmul():
    model = matmul_clip_model(constant_bounds=True)
    report = PatternReport()
    mod = fusion_pipeline(config(["clip", "gemm_epilogue"]), report,
                          phases=("canonicalize", "fuse", "lower"))(import_onnx(model))
    assert report.fired["clip"] == 1
    assert report.variants["gemm_epilogue.matmul_clip"] == 1
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels == ["fused_relax_matmul_relax_clip"]
    x = np.random.default_rng(1).standard_normal((4, 8)).astype("float32") * 3
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    (expected,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert got.max() == 6.0 and got.min() == 0.0


def test_must_not_rewrite_runtime_bounds():
    model = matmul_clip_model(constant_bounds=False)
    report = PatternReport()
    fusion_pipeline(config(["clip", "gemm_epilogue"]), report, phases=("canonicalize",))(import_onnx(model))
    assert not report.fired["clip"]


def test_must_not_rewrite_kernels_the_frontend_did_not_mark():
    """TVM's own import emits the same maximum and minimum, unmarked: a near miss that says so."""
    report = PatternReport()
    stock = stock_onnx.from_onnx(matmul_clip_model(constant_bounds=True))
    fusion_pipeline(config(["clip"]), report, phases=("canonicalize",))(stock)
    assert not report.fired["clip"]
    assert any("tvm_fusion.kernel" in miss.reason for miss in report.near_misses if miss.pattern == "clip")
