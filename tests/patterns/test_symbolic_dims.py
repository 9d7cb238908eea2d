"""Compile once for a range of sizes: a model imported with symbolic batch/sequence dims fuses
exactly like the same model imported with static ones, and the one build runs at any size."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from tvm import relax, tirx

from tvm_fusion.config import load_config
from tvm_fusion.frontend.converters import from_onnx
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport

REPO = Path(__file__).resolve().parents[2]
BERT_BLOCK = REPO / "tests" / "data" / "bert_block_opset14.onnx"
BERT_TINY = REPO / "examples" / "models" / "bert_tiny.onnx"
# Stated tolerances: float32 BERT layers, reductions in another order than ONNX Runtime.
RTOL, ATOL = 1e-4, 1e-5


def import_model(model: onnx.ModelProto, sizes: dict):
    """The model's Relax module with each named input dim (``batch``, ``sequence``) bound to
    ``sizes[name]``: an int for a static dim, a string for a symbolic ``tirx.Var`` of that name."""
    variables: dict = {}

    def dim(d):
        size = sizes.get(d.dim_param, d.dim_value)
        return variables.setdefault(size, tirx.Var(size, "int64")) if isinstance(size, str) else size

    shapes = {i.name: [dim(d) for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    return from_onnx(model, shapes, {i.name: "int64" for i in model.graph.input}), shapes


def optimize(model: onnx.ModelProto, sizes: dict):
    report = PatternReport()
    mod, shapes = import_model(model, sizes)
    return fusion_pipeline(load_config(), report)(mod), report, shapes


@pytest.mark.parametrize("path, symbolic", [
    (BERT_BLOCK, {"batch": 1, "sequence": "sequence"}),
    (BERT_BLOCK, {"batch": "batch", "sequence": "sequence"}),
    (BERT_TINY, {"batch": 1, "sequence": "sequence"}),
])
def test_symbolic_import_fires_what_the_static_import_fires(path, symbolic):
    model = onnx.load(path)
    _, static, _ = optimize(model, {"batch": 1, "sequence": 8})
    _, dynamic, _ = optimize(model, symbolic)
    assert static.fired["attention"] and static.fired["skip_layernorm"] and static.fired["gemm_epilogue"]
    assert dict(dynamic.fired) == dict(static.fired)
    assert [(m.pattern, m.reason) for m in dynamic.near_misses] == [
        (m.pattern, m.reason) for m in static.near_misses]


def test_one_build_runs_every_size_and_matches_onnxruntime():
    model = onnx.load(BERT_BLOCK)
    optimized, report, shapes = optimize(model, {"batch": "batch", "sequence": "sequence"})
    assert report.fired["attention"] == 1
    vm = relax.VirtualMachine(tvm.compile(optimized, target=load_config().tvm_target()), tvm.cpu())
    session = ort.InferenceSession(str(BERT_BLOCK), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, sequence in ((1, 8), (2, 5)):  # sequence <= 32, the position table
        feed = {"input_ids": rng.integers(0, 64, (batch, sequence)).astype("int64"),
                "attention_mask": (rng.random((batch, sequence)) > 0.2).astype("int64")}
        (expected,) = session.run(None, feed)
        got = vm["main"](*[tvm.runtime.tensor(feed[name]) for name in shapes])
        np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)
