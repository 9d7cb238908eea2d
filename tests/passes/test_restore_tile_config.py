"""RestoreTileConfig: a kernel that loads AMX tile configurations saves the calling thread's first
and puts it back at its end; a kernel without tiles is left alone; and ONNX Runtime's int8 AMX
kernels, which trust the configuration they loaded on a thread, run right on a thread where our
artifact ran in between (without the pass that run died of SIGILL)."""

from __future__ import annotations

import helpers
import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import api
from tvm_fusion.frontend.bf16_matmul import emit_bf16_matmul
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.passes.restore_tile_config import RestoreTileConfig, configures_tiles
from tvm_fusion.schedules.cpu import Bf16MatmulAmx
from tvm_fusion.targets import host_cpu_flags
from tvm_fusion.targets.amx import request_amx_permission

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})


def bf16_kernel() -> tvm.tirx.PrimFunc:
    """The bf16 matmul kernel of a 32 x 64 x 32 product, lowered, not scheduled."""
    a = relax.Var("a", relax.TensorType((32, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a]):
        with bb.dataflow():
            out = bb.emit_output(emit_bf16_matmul(bb, a, np.ones((64, 32), np.float32)))
        bb.emit_func_output(out)
    lowered = tvm.transform.Sequential(lowering_passes())(bb.get())
    (func,) = [f for gv, f in lowered.functions_items() if "bf16_matmul" in gv.name_hint]
    return func


def tiled_kernel() -> tvm.tirx.PrimFunc:
    return Bf16MatmulAmx().apply(bf16_kernel(), AMX, False).mod["main"]


def test_a_kernel_with_tiles_saves_and_restores_the_callers_configuration():
    func = tiled_kernel()
    assert configures_tiles(func)
    wrapped = RestoreTileConfig()(tvm.IRModule({"main": func}))["main"]
    body = wrapped.body.block.body
    first, *_, compare, restore = body.seq
    assert "sttilecfg" in str(first) and "caller_tile_config" in str(first)
    assert "sttilecfg" in str(compare) and "tile_config_after" in str(compare)
    assert "tilerelease" in str(restore.then_case) and "ldtilecfg" in str(restore.then_case)
    kernel = func.body.block.body  # between them, the kernel's own statements, unchanged
    statements = list(kernel.seq) if isinstance(kernel, tvm.tirx.SeqStmt) else [kernel]
    assert len(body.seq) == len(statements) + 3
    for wrapped_statement, statement in zip(body.seq[1:-2], statements):
        tvm.ir.assert_structural_equal(wrapped_statement, statement, map_free_vars=True)


def test_must_not_touch_a_kernel_without_tiles():
    func = bf16_kernel()  # as written: no schedule, no tiles
    assert not configures_tiles(func)
    mod = tvm.IRModule({"main": func})
    assert RestoreTileConfig()(mod).same_as(mod)


ORT_THEN_OURS = """
import sys, json, pathlib, numpy as np, tvm, onnxruntime as ort
from tvm_fusion.runtime import CompiledModel
artifact = pathlib.Path(sys.argv[1])
ours = CompiledModel(tvm.runtime.load_module(str(artifact / "model.so")),
                     json.loads((artifact / "metadata.json").read_text()))
options = ort.SessionOptions()
options.intra_op_num_threads = 1  # ONNX Runtime's kernels on this thread, as ours
session = ort.InferenceSession(sys.argv[2], options, providers=["CPUExecutionProvider"])
x = {"x": np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)}
first = session.run(None, x)[0]
for _ in range(3):
    ours.run(x)
    assert np.array_equal(session.run(None, x)[0], first)
print("ok")
"""


@pytest.mark.skipif(not {"amx_int8", "amx_tile"} <= host_cpu_flags() or not request_amx_permission(),
                    reason="the host CPU has no AMX-INT8 (the wrapping is tested above on a named target)")
def test_onnx_runtime_int8_and_our_artifact_share_a_thread(tmp_path):
    weight = np.random.default_rng(1).integers(-128, 127, (512, 1536)).astype(np.int8)
    graph = helper.make_graph([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
                               helper.make_node("MatMulInteger", ["q", "w", "z"], ["y"])], "dynamic_matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [16, 1536])],
                              [numpy_helper.from_array(weight, "w")])
    model = tmp_path / "dynamic_matmul.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    result = api.compile_model(model, None, None, output_dir=tmp_path / "out")
    assert "Int8MatmulAmx" in result.metadata["schedule_rules"].values()
    ran = helpers.run_python(ORT_THEN_OURS, str(result.artifact), str(model))
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-2000:]
