"""scripts/zoo_report.py fails the report on what must not hide: a model that does not compile,
a kernel only a generic rule took, a schedule rule that raised, a compile over its memory budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parent.parent / "scripts" / "zoo_report.py"


@pytest.fixture
def zoo_report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPORT.parent))  # the script imports its sibling isolated.py
    spec = importlib.util.spec_from_file_location("zoo_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(**fields) -> dict:
    return {"model": "m", "compiles": True, "generic_kernels": [], "schedule_rule_errors": [],
            "compile_peak_rss_mb": 900.0, "weights_mb": 10.0, "compile_rss_within_budget": True, **fields}


def test_a_clean_row_passes(zoo_report):
    assert zoo_report.failures([row()]) == []


def test_each_finding_fails_the_report_with_its_culprit(zoo_report):
    rows = [row(model="broken", compiles=False, error="verification: max abs 0.5"),
            row(model="generic", generic_kernels=[{"kernel": "fused_einsum", "rule": "Reduction", "flops": 1_000_000,
                                                   "contraction": True, "onnx_nodes": ["Einsum_3"]}]),
            row(model="raised", schedule_rule_errors=[{"kernel": "softmax", "rule": "Softmax",
                                                       "error": "StopIteration", "scheduled_by": "Reduction"}]),
            row(model="heavy", compile_peak_rss_mb=1200.0, compile_rss_within_budget=False)]
    found = zoo_report.failures(rows)
    assert len(found) == 4
    assert found[0].startswith("broken: does not compile: verification")
    assert "fused_einsum (Reduction, 1,000,000 FLOPs" in found[1]
    assert "schedule rule Softmax raised on softmax: StopIteration" in found[2]
    assert "heavy: compile peak RSS 1200.0 MB over the budget of 1054 MB" in found[3]


def test_the_table_names_outputs_that_passed_as_ill_conditioned(zoo_report):
    rows = [row(model="t5", exporter="ort-quantization", max_abs_error=7.2e-3, ill_conditioned=["last_hidden_state"]),
            row(model="mlp", exporter="torch", max_abs_error=1e-6, ill_conditioned=[])]
    lines = zoo_report.markdown(rows).splitlines()
    assert "| t5 | ort-quantization | yes | 7.2e-03 (ill-conditioned: last_hidden_state) |" in lines[2]
    assert "ill-conditioned" not in lines[3]


def _large_result(size: int, queue) -> None:
    queue.put({"payload": "x" * size})


def _no_result(queue) -> None:
    raise SystemExit(3)


def test_a_result_larger_than_a_pipe_comes_back_from_its_worker(zoo_report):
    """The worker cannot exit until its result is read (a multiprocessing queue's feeder thread
    blocks on the full pipe): reading only after its exit hung until the timeout."""
    import isolated

    result, failure = isolated.run_in_worker(_large_result, (1 << 20,), timeout=60)
    assert failure is None and len(result["payload"]) == 1 << 20
    assert isolated.run_in_worker(_no_result, (), timeout=60) == (None, "worker died (exit code 3)")


def test_the_table_sets_openvino_at_f32_beside_its_default_precision(zoo_report):
    """Both OpenVINO rows with their errors against ONNX Runtime float32, and the precision its
    default ran at; a row timed without OpenVINO leaves those cells empty."""
    timed = row(model="bert", exporter="torch", max_abs_error=1e-6, ill_conditioned=[], ort_ms=4.5, ours_ms=3.4,
                ratio_to_ort=0.76, openvino_ms=3.4, ratio_to_openvino=1.01, openvino_max_abs_error=1.2e-6,
                openvino_default_ms=1.2, ratio_to_openvino_default=2.79, openvino_default_precision="bf16",
                openvino_default_max_abs_error=2.9e-3)
    lines = zoo_report.markdown([timed, row(model="mlp", exporter="torch", max_abs_error=1e-6, ill_conditioned=[])])
    assert len({line.count("|") for line in lines.splitlines()}) == 1  # every row has every column
    assert "| 3.4 (1.01x) | 1.2 (bf16; 2.79x) | 1.2e-06 / 2.9e-03 |" in lines.splitlines()[2]
    assert "|  |  |" in lines.splitlines()[3]


def test_a_bf16_run_records_our_bf16_row_beside_float32_and_openvino_default(zoo_report):
    """bf16_timings: our bf16 time, its ratios to our float32 and to OpenVINO's default, its error
    against ONNX Runtime float32 and its bf16 kernel count; nothing for a float32 bench."""
    class Bench:
        medians_ms = {"onnxruntime": 8.0, "tvm_fusion": 4.0, "tvm_fusion_bf16": 3.0, "openvino_default": 2.0}
        bf16_kernels = ["fused_matmul_add", "fused_matmul_gelu"]
        max_abs_error = {"tvm_fusion": 1e-6, "tvm_fusion_bf16": 3e-2}
        cosine_similarity = {"tvm_fusion": 1.0, "tvm_fusion_bf16": 0.9999}

    assert zoo_report.bf16_timings(Bench()) == {
        "ours_bf16_ms": 3.0, "ratio_bf16_to_f32": 0.75, "bf16_kernels": 2, "bf16_max_abs_error": 3e-2,
        "bf16_cosine_similarity": 0.9999, "ratio_bf16_to_openvino_default": 1.5}
    Bench.medians_ms = {"onnxruntime": 8.0, "tvm_fusion": 4.0}
    assert zoo_report.bf16_timings(Bench()) == {}


def test_the_table_has_a_bf16_column_only_for_a_bf16_run(zoo_report):
    timed = row(model="bert", exporter="torch", max_abs_error=1e-6, ill_conditioned=[], ort_ms=4.5, ours_ms=3.4,
                ratio_to_ort=0.76, ours_bf16_ms=2.1, ratio_bf16_to_f32=0.62, bf16_kernels=3, bf16_max_abs_error=4.2e-2)
    lines = zoo_report.markdown([timed, row(model="broken", compiles=False, error="crash")]).splitlines()
    assert "ours bf16 ms" in lines[0] and len({line.count("|") for line in lines}) == 1
    assert "| 2.1 (0.62x; 3; 4.2e-02) |" in lines[2]
    assert "bf16" not in zoo_report.markdown([row(model="mlp", exporter="torch", max_abs_error=1e-6)])


def test_bf16_is_refused_on_a_host_without_bf16_kernels(zoo_report, monkeypatch, capsys):
    monkeypatch.setattr(zoo_report, "has_bf16_kernels", lambda target: False)
    with pytest.raises(SystemExit) as info:
        zoo_report.main(["--precision", "bf16", "--only", "minilm-l6"])
    assert info.value.code == 2
    assert "--precision bf16 needs a host CPU with AVX512_BF16 or AMX-BF16" in capsys.readouterr().err
