"""bench's peers: OpenVINO compiled like-for-like, and at its default precision (the bench itself
is tested in test_api/test_cli)."""

import math

import numpy as np
import pytest
import onnx
from onnx import TensorProto, helper

from tvm_fusion.commands import bench, peers
from tvm_fusion.verify import reference_outputs


def test_openvino_compiles_f32_latency_unpinned_at_the_given_threads(mlp_path):
    import openvino as ov

    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    runner = peers.OpenVinoRunner(mlp_path, {"x": x}, threads=1)
    assert runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32 and runner.precision == "f32"
    assert str(runner.compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
    assert runner.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert runner.compiled.get_property("ENABLE_CPU_PINNING") is False
    assert runner.compiled.get_property(peers.DYNAMIC_QUANTIZATION) == 0  # no int8 under the f32 label
    runner.run()
    reference = reference_outputs(onnx.load(mlp_path), {"x": x})
    produced = runner.outputs(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(produced[name], value, rtol=1e-5, atol=1e-5)
    x[:] = 0  # the request reads the caller's array: inputs are set once, not copied per run
    runner.run()
    zeros = reference_outputs(onnx.load(mlp_path), {"x": x})
    assert all(np.allclose(runner.outputs(zeros)[k], v, atol=1e-5) for k, v in zeros.items())



def test_openvino_default_precision_is_left_to_it_and_read_back(mlp_path):
    """No precision hint: OpenVINO picks (bf16 with AVX512_BF16 or AMX, f32 on AVX2-only hosts),
    and the runner reports what the compiled model says it picked."""
    import openvino as ov

    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    runner = peers.OpenVinoRunner(mlp_path, {"x": x}, threads=1, precision=None)
    chose = runner.compiled.get_property("INFERENCE_PRECISION_HINT")
    assert runner.precision.split()[0] == chose.to_string()
    group = runner.compiled.get_property(peers.DYNAMIC_QUANTIZATION)
    assert (f"groups of {group}" in runner.precision) == bool(group)
    assert chose == ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")  # the plugin's default
    assert str(runner.compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
    assert runner.compiled.get_property("ENABLE_CPU_PINNING") is False


def _matmul_softmax(path):
    """A tiny classifier head, x @ w + b then softmax: a contraction (which OpenVINO runs in bf16 at
    its default) and a softmax (f32 in both of its schemes)."""
    rng = np.random.default_rng(1)
    w = helper.make_tensor("w", TensorProto.FLOAT, [32, 10], rng.standard_normal((32, 10)).astype("float32").ravel())
    b = helper.make_tensor("b", TensorProto.FLOAT, [10], rng.standard_normal(10).astype("float32"))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)],
        "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 10]),
         helper.make_tensor_value_info("probs", TensorProto.FLOAT, [3, 10])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_bench_reports_both_openvino_rows_with_their_errors(tmp_path, config_path):
    """Both OpenVINO rows time in the same rounds; each is checked against ONNX Runtime float32 on
    the same inputs. f32 must agree; the default's error (bf16 on this kind of host) is only
    reported, finite: on any x86 host it is whatever OpenVINO's default gives."""
    path = _matmul_softmax(tmp_path / "head.onnx")
    report = bench.bench_model(path, config_path(), repeat=2, warmup=1, include_stock=False, peers=("openvino",))
    rows = {name for name, _ in peers.OPENVINO_ROWS}
    assert rows == {"openvino", "openvino_default"} and rows <= set(report.medians_ms)
    assert all(len(report.samples_ms[name]) == 2 for name in rows)  # medians of the same interleaved rounds
    chose = report.peer_precision
    assert chose["openvino"] == "f32" and chose["openvino_default"].split()[0] in ("bf16", "f16", "f32")
    assert report.max_abs_error["openvino"] <= 1e-4 and report.max_rel_error["openvino"] <= 1e-4
    assert abs(1 - report.cosine_similarity["openvino"]) <= 1e-6
    for metric in (report.max_abs_error, report.max_rel_error, report.cosine_similarity):
        assert math.isfinite(metric["openvino_default"])
    assert report.cosine_similarity["openvino_default"] > 0.9
    data = report.to_json()
    assert data["peer_precision"] == report.peer_precision
    assert set(data["max_rel_error"]) == set(data["cosine_similarity"]) == {"tvm_fusion", *rows}


def test_bench_errors_are_the_worst_output(tmp_path, config_path, monkeypatch):
    """A runner's error is its worst output's: ``probs`` pushed off by 0.25 decides the largest
    abs and rel error and the smallest cosine, though ``logits`` still agrees."""
    path = _matmul_softmax(tmp_path / "head.onnx")
    real_outputs = peers.OpenVinoRunner.outputs

    def probs_off(self, names):
        out = real_outputs(self, names)
        return {**out, "probs": out["probs"] + np.float32(0.25)}

    monkeypatch.setattr(peers.OpenVinoRunner, "outputs", probs_off)
    report = bench.bench_model(path, config_path(), repeat=1, warmup=0, include_stock=False, peers=("openvino",))
    assert report.max_abs_error["openvino"] == pytest.approx(0.25, abs=1e-4)
    assert report.max_rel_error["openvino"] >= 0.25 - 1e-4
    assert report.cosine_similarity["openvino"] < 0.999
    assert report.cosine_similarity["tvm_fusion"] == pytest.approx(1.0, abs=1e-9)
