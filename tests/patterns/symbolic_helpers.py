"""Modules with symbolic image height and width (a model compiled for a range of sizes), run
through the whole tvm_fusion pipeline and compared with the unfused module at several sizes."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvm_fusion.config import load_config
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport

HEIGHT, WIDTH = tirx.Var("height", "int64"), tirx.Var("width", "int64")


def symbolic_module(fn, inputs: dict, constants: dict | None = None) -> tvm.IRModule:
    """``main(**inputs)`` returning ``fn(*inputs, *constants)``; shapes may use HEIGHT and
    WIDTH, constants (numpy arrays) become ``R.const`` weights as the ONNX importer makes them."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in inputs.items()]
    consts = [relax.const(value) for value in (constants or {}).values()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params, *consts))
        bb.emit_func_output(out)
    return bb.get()


def pipeline_and_compare(mod: tvm.IRModule, sizes: list[tuple[int, int]], rtol=1e-4, atol=1e-4):
    """Run the default pipeline on ``mod``, compare against the unfused module at every
    ``(height, width)``; returns the pattern report and the schedule log."""
    cfg = load_config(None)
    report, log = PatternReport(), {}
    optimized = fusion_pipeline(cfg, report, schedule_log=log)(mod)
    target = cfg.tvm_target()
    fused = relax.VirtualMachine(tvm.compile(optimized, target=target), tvm.cpu())
    plain = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    rng = np.random.default_rng(0)
    params = mod["main"].params
    for height, width in sizes:
        bind = {HEIGHT: height, WIDTH: width}
        inputs = []
        for param in params:
            shape = [int(bind.get(d, d)) if not isinstance(d, tirx.IntImm) else int(d)
                     for d in param.ty.shape.values]
            inputs.append(tvm.runtime.tensor(rng.standard_normal(shape).astype("float32")))
        np.testing.assert_allclose(fused["main"](*inputs).numpy(), plain["main"](*inputs).numpy(),
                                   rtol=rtol, atol=atol)
    return report, log
