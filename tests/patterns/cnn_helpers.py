"""Tiny ONNX CNN graphs for the conv pattern tests, and running them through the pipeline."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion.config import parse_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport
from tvm_fusion.frontend.onnx import import_model, TensorSpec

CONV_PATTERNS = ["silu", "clip", "hardswish", "hardsigmoid", "conv_bn_fold", "squeeze_excitation",
                 "conv_epilogue"]


def make_model(nodes, inputs: dict[str, tuple], output: str, initializers: dict[str, np.ndarray],
               output_shape=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "cnn",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT,
                                       output_shape or ["n", "c", "h", "w"])],
        [numpy_helper.from_array(value.astype(np.float32), name) for name, value in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def random_weights(rng, **shapes) -> dict[str, np.ndarray]:
    return {name: rng.standard_normal(shape).astype(np.float32) * 0.3 for name, shape in shapes.items()}


def batch_norm_params(rng, prefix: str, channels: int) -> dict[str, np.ndarray]:
    return {f"{prefix}_gamma": rng.normal(1.0, 0.2, channels), f"{prefix}_beta": rng.normal(0.0, 0.2, channels),
            f"{prefix}_mean": rng.normal(0.0, 0.2, channels), f"{prefix}_var": rng.uniform(0.5, 1.5, channels)}


def config(patterns=None, schedule="default", conv_layout="NCHW", winograd=True):
    return parse_config({"target": {"kind": "llvm", "mcpu": "host", "num-cores": 2},
                         "pipeline": {"patterns": CONV_PATTERNS if patterns is None else patterns,
                                      "schedule": schedule, "conv_layout": conv_layout, "winograd": winograd}},
                        name="test")


def compile_and_compare(model: onnx.ModelProto, patterns=None, phases=("canonicalize", "fuse", "lower", "schedule"),
                        seed: int = 1, rtol: float = 1e-4, atol: float = 1e-4, winograd: bool = True):
    """Run the pipeline on ``model``; check the output against ONNX Runtime and against the
    unfused (stock) module at ``rtol``/``atol``. Returns (report, lowered module). With the
    ``layout`` phase, convs take the blocked layout (``conv_layout = "NCHWc"``); ``winograd``:
    the config's switch for its 3x3 convs."""
    rng = np.random.default_rng(seed)
    specs = [TensorSpec(v.name, tuple(d.dim_value for d in v.type.tensor_type.shape.dim), "float32")
             for v in model.graph.input]
    inputs = {s.name: rng.standard_normal(s.shape).astype(np.float32) * 2 for s in specs}
    report = PatternReport()
    cfg = config(patterns, conv_layout="NCHWc" if "layout" in phases else "NCHW", winograd=winograd)
    module = fusion_pipeline(cfg, report, phases=phases)(import_model(model, specs))
    unfused = import_model(model, specs)
    got, stock = run(module, cfg, inputs), run(unfused, cfg, inputs)
    (expected,) = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"]).run(None, inputs)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got, stock, rtol=rtol, atol=atol)
    return report, module


def run(module, cfg, inputs):
    vm = relax.VirtualMachine(tvm.compile(module, target=cfg.tvm_target()), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()]).numpy()


def prim_func_names(module) -> list[str]:
    return sorted(gv.name_hint for gv, f in module.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def relax_ops(module) -> list[str]:
    ops = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            ops.append(expr.op.name)

    relax.analysis.post_order_visit(module["main"], visit)
    return ops
