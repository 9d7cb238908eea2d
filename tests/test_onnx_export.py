"""``tvm-fusion inspect --onnx [--check]``: the fused graph as ONNX, one tvm_fusion node per fusion.

The bundled models go through the whole path (TVM's fusion pipeline says what each fusion
absorbed; the file is written, checked by onnx.checker and run under onnx.reference against
ONNX Runtime). The fallbacks (an intermediate read elsewhere, an input produced too late)
use hand-made fusions on small graphs, without TVM.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api, cli
from tvm_fusion.onnx_export import DOMAIN, evaluator, fused_onnx
from tvm_fusion.onnx_export.fusions.gemm_epilogue import GemmEpilogue

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
CNN_SHAPE = ["input:1x3x224x224"]
BUNDLED = {  # model: (input shapes, fused nodes expected in the file)
    "bert_tiny": (None, {"GemmEpilogue": 8, "SkipLayerNorm": 5, "Attention": 2}),
    "gpt2_tiny": (None, {"GemmEpilogue": 6, "SkipLayerNorm": 5, "Attention": 2}),
    "resnet_tiny": (CNN_SHAPE, {"ConvEpilogue": 20, "GemmEpilogue": 1}),
    "mobilenetv3_tiny": (CNN_SHAPE, {"ConvEpilogue": 25, "SqueezeExcitation": 6, "GemmEpilogue": 2}),
    "dbnet_tiny": (CNN_SHAPE, {"ConvEpilogue": 17, "ConvTransposeEpilogue": 2, "ResizeMerge": 1}),
}


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_model_exports_a_valid_fused_graph_that_matches_onnxruntime(name, tmp_path):
    shapes, expected_ops = BUNDLED[name]
    report = api.export_fused_onnx(MODELS / f"{name}.onnx", None, shapes, tmp_path / "fused.onnx", check=True)
    assert report.fused_ops == expected_ops
    assert not report.kept, report.kept
    assert report.comparisons and all(c.within_tolerance for c in report.comparisons)
    model = onnx.load(str(tmp_path / "fused.onnx"))
    onnx.checker.check_model(model)
    assert any(o.domain == DOMAIN for o in model.opset_import)
    available = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # in topological order, every input produced before it is read
        assert all(i in available for i in node.input if i), node.name
        available.update(node.output)
        if node.domain == DOMAIN:
            assert node.doc_string.startswith(node.name.split("/")[0] + ": absorbed ONNX nodes: ")
    assert list(tmp_path.iterdir()) == [tmp_path / "fused.onnx"]  # no staging left behind


def skip_norm_model(sum_reader_between: bool) -> onnx.ModelProto:
    """x + skip -> LayerNorm, the sum also read by a Relu (placed before or after the norm)."""
    add = helper.make_node("Add", ["x", "skip"], ["s"], name="add")
    norm = helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="norm")
    relu = helper.make_node("Relu", ["s"], ["r"], name="relu")
    nodes = [add, relu, norm] if sum_reader_between else [add, norm, relu]
    graph = helper.make_graph(
        nodes, "skip_norm", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("x", "skip")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("y", "r")],
        [numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
         numpy_helper.from_array(np.zeros(8, np.float32), "beta")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def instance_of(model: onnx.ModelProto, names: list[str], variant: str) -> api.FusedNodes:
    indices = [i for i, n in enumerate(model.graph.node) if n.name in names]
    return api.FusedNodes(variant.split(".")[0], variant, names,
                          [model.graph.node[i].op_type for i in indices], indices)


FEEDS = {"x": np.ones((2, 8), np.float32), "skip": np.arange(16, dtype=np.float32).reshape(2, 8)}


def test_the_sum_read_after_the_norm_becomes_a_second_output():
    model = skip_norm_model(sum_reader_between=False)
    result = fused_onnx(model, [instance_of(model, ["add", "norm"], "skip_layernorm.skip")], FEEDS)
    assert [(n.op_type, list(n.output)) for n in result.model.graph.node] == [("SkipLayerNorm", ["y", "s"]),
                                                                              ("Relu", ["r"])]


def test_a_fused_output_read_before_the_fused_node_keeps_the_original_nodes():
    model = skip_norm_model(sum_reader_between=True)
    result = fused_onnx(model, [instance_of(model, ["add", "norm"], "skip_layernorm.skip")], FEEDS)
    assert [n.op_type for n in result.model.graph.node] == ["Add", "Relu", "LayerNormalization"]
    assert [k.variant for k in result.kept] == ["skip_layernorm.skip"]
    assert "produced after" in result.kept[0].reason


def test_an_intermediate_no_fused_output_carries_keeps_the_original_nodes():
    """matmul + bias + relu whose pre-activation sum is read elsewhere: GemmEpilogue has no such output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"), helper.make_node("Add", ["mm", "b"], ["h"],
                                                                                     name="bias"),
             helper.make_node("Relu", ["h"], ["y"], name="relu"), helper.make_node("Neg", ["h"], ["z"], name="neg")]
    graph = helper.make_graph(
        nodes, "leak", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("y", "z")],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "w"), numpy_helper.from_array(np.ones(3, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    instance = instance_of(model, ["mm", "bias", "relu"], "gemm_epilogue.matmul_bias_relu")
    result = fused_onnx(model, [instance], {"x": np.ones((2, 4), np.float32)})
    assert [n.op_type for n in result.model.graph.node] == ["MatMul", "Add", "Relu", "Neg"]
    assert "'h' is read outside the fusion" in result.kept[0].reason


def test_fusions_inside_one_onnx_node_keep_that_node():
    """TVM imports an ONNX GRU or LSTM as many ops, several of them fused: each such fusion
    absorbed the same single node, which stays as it is."""
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="rnn")], "one_node",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "w"), numpy_helper.from_array(np.ones(3, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    instances = [instance_of(model, ["rnn"], "gemm_epilogue.matmul_bias")] * 2
    result = fused_onnx(model, instances, {"x": np.ones((2, 4), np.float32)})
    assert [n.op_type for n in result.model.graph.node] == ["Gemm"]
    assert [k.reason for k in result.kept] == ["one of 2 fusions inside the ONNX Gemm node 'rnn' (its import is "
                                               "several ops): it stays one node"] * 2


def test_cli_writes_and_checks_the_fused_graph(capsys, tmp_path, mlp_path):
    out = tmp_path / "sub" / "mlp_fused.onnx"
    code = cli.main(["inspect", str(mlp_path), "--input-shape", "x:4x16", "--onnx", str(out), "--check"])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"fused ONNX graph: {out} (2 GemmEpilogue)" in printed
    assert "onnx.reference (tvm_fusion ops) vs ONNX Runtime" in printed and " ok" in printed
    ops = [(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node]
    assert ops == [(DOMAIN, "GemmEpilogue")] * 2


def test_cli_check_fails_with_exit_5_naming_the_output(capsys, tmp_path, mlp_path, monkeypatch):
    def off_by_one(self, *args, **kwargs):
        return (original(self, *args, **kwargs)[0] + 1,)

    original = GemmEpilogue._run
    monkeypatch.setattr(GemmEpilogue, "_run", off_by_one)
    code = cli.main(["inspect", str(mlp_path), "--input-shape", "x:4x16", "--onnx", str(tmp_path / "f.onnx"),
                     "--check"])
    err = capsys.readouterr().err
    assert code == 5
    assert "disagrees with ONNX Runtime on output 'y'" in err and "MISMATCH" in err


def test_cli_check_without_onnx_is_a_usage_error(capsys, mlp_path):
    assert cli.main(["inspect", str(mlp_path), "--input-shape", "x:4x16", "--check"]) == 2
    assert "--onnx" in capsys.readouterr().err


def test_fused_file_runs_under_the_reference_evaluator_alone(tmp_path, mlp_path):
    """The file is self-contained: onnx_export.evaluator runs it with nothing but the file."""
    path = tmp_path / "m.onnx"
    api.export_fused_onnx(mlp_path, None, ["x:4x16"], path)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    (y,) = evaluator(onnx.load(str(path))).run(None, {"x": x})
    assert y.shape == (4, 8) and np.isfinite(y).all()
