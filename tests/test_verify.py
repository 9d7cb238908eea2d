"""Verification against ONNX Runtime: the comparison itself, and compile refusing wrong modules."""

from __future__ import annotations

import json
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api, cli, verify
from tvm_fusion.commands import references
from tvm_fusion.errors import VerificationError
from tvm_fusion.verify import check_outputs, compare_outputs, format_comparisons

RTOL, ATOL = 1e-3, 1e-4
NUDGED = "run-time quantizations' inputs an ulp up"


def compare_one(actual, expected):
    [result] = compare_outputs({"y": np.asarray(actual, np.float32)}, {"y": np.asarray(expected, np.float32)},
                               RTOL, ATOL)
    return result


def test_within_tolerance_passes():
    expected = np.array([1.0, -2.0, 0.0, 100.0], np.float32)
    actual = expected + np.array([5e-5, -2e-3 + 1e-4, 9e-5, 0.1], np.float32)  # each <= atol + rtol*|e|
    result = compare_one(actual, expected)
    assert result.within_tolerance and result.note == ""
    assert result.max_abs == pytest.approx(0.1, rel=1e-3)
    check_outputs([result], RTOL, ATOL)  # does not raise


def test_beyond_tolerance_is_flagged_with_its_errors():
    expected = np.array([1.0, 2.0, 4.0], np.float32)
    actual = np.array([1.0, 2.01, 4.0], np.float32)
    result = compare_one(actual, expected)
    assert not result.within_tolerance
    assert result.max_abs == pytest.approx(0.01, rel=1e-4)
    assert result.max_rel == pytest.approx(0.005, rel=1e-4)


def test_error_exactly_at_zero_expected():
    result = compare_one([2e-4], [0.0])  # atol 1e-4 is all the slack a zero gets
    assert not result.within_tolerance
    assert compare_one([5e-5], [0.0]).within_tolerance


def test_shape_mismatch():
    [result] = compare_outputs({"y": np.zeros((2, 3), np.float32)}, {"y": np.zeros((3, 2), np.float32)},
                               RTOL, ATOL)
    assert not result.within_tolerance and result.note == "shape (2, 3) != (3, 2)"


def test_missing_output():
    results = compare_outputs({"a": np.zeros(2)}, {"a": np.zeros(2), "b": np.zeros(2)}, RTOL, ATOL)
    assert [(r.name, r.within_tolerance, r.note) for r in results] == [("a", True, ""), ("b", False, "missing")]


@pytest.mark.parametrize("actual,expected", [
    ([1.0, np.nan], [1.0, 2.0]),
    ([1.0, 2.0], [1.0, np.inf]),
    ([1.0, np.inf], [1.0, -np.inf]),
    ([1.0, np.nan], [1.0, np.inf]),
], ids=["nan-vs-finite", "finite-vs-inf", "inf-vs-minus-inf", "nan-vs-inf"])
def test_non_finite_mismatch(actual, expected):
    result = compare_one(actual, expected)
    assert not result.within_tolerance
    assert result.note == "non-finite values differ"


def test_matching_non_finite_values_pass():
    result = compare_one([np.nan, np.inf, -np.inf, 1.0], [np.nan, np.inf, -np.inf, 1.00001])
    assert result.within_tolerance
    assert np.isfinite(result.max_abs) and result.max_abs == pytest.approx(1e-5, rel=1e-2)


def test_check_outputs_raises_with_table():
    results = [compare_one([1.0], [1.0]), compare_one([1.5], [1.0])]
    results[1].name = "logits"
    with pytest.raises(VerificationError) as info:
        check_outputs(results, RTOL, ATOL)
    assert info.value.exit_code == 5
    message = str(info.value)
    assert format_comparisons(results, RTOL, ATOL) in message
    assert "logits" in message and "MISMATCH" in message and "5.000e-01" in message
    assert "no artifact was written" in info.value.hint


def test_table_states_the_rule_and_the_worst_element():
    """A max rel err above rtol can be ok (reference near zero); the table says why, and a
    mismatch names how many elements are out and the worst one, both sides."""
    near_zero = compare_one([1e-5, 1.0], [2e-5, 1.0])
    assert near_zero.within_tolerance and near_zero.max_rel > RTOL
    wrong = compare_one([1.0, 2.0, 3.5], [1.0, 2.5, 3.0])
    assert not wrong.within_tolerance
    assert wrong.note == "2 of 3 elements outside; worst: tvm_fusion 2, ONNX Runtime 2.5"
    text = format_comparisons([near_zero, wrong], RTOL, ATOL)
    assert text.splitlines()[-1] == (f"ok: every element has |tvm_fusion - ONNX Runtime| <= atol + rtol * "
                                     f"|ONNX Runtime| (= {ATOL:g} + {RTOL:g} * |ONNX Runtime|)")


def shifted(function, by: float):
    """``function`` (reference_outputs or reference_variants) with every output shifted by ``by``."""
    def run(model, inputs, threads=1):
        found = function(model, inputs, threads)
        if all(isinstance(value, dict) for value in found.values()):  # reference_variants: by variant
            return {variant: {name: value + np.float32(by) for name, value in outputs.items()}
                    for variant, outputs in found.items()}
        return {name: value + np.float32(by) for name, value in found.items()}
    return run


@pytest.fixture
def perturbed_reference(monkeypatch):
    """ONNX Runtime's outputs shifted by 0.5 in every configuration: the compiled module now looks
    wrong, and ONNX Runtime agrees with itself (the output is well-conditioned)."""
    monkeypatch.setattr(references, "reference_outputs", shifted(verify.reference_outputs, 0.5))
    monkeypatch.setattr(references, "reference_variants", shifted(verify.reference_variants, 0.5))


def test_compile_refuses_a_wrong_module_and_writes_nothing(tmp_path, mlp_path, config_path, perturbed_reference):
    out = tmp_path / "build"
    with pytest.raises(VerificationError) as info:
        api.compile_model(mlp_path, config_path(), ["x:4x16"], output_dir=out)
    message = str(info.value)
    assert "disagrees with ONNX Runtime" in message
    assert "max abs err" in message and "max rel err" in message
    row = next(line for line in message.splitlines() if line.startswith("y "))
    assert "MISMATCH" in row and "5.000e-01" in row
    assert not out.exists()


def test_cli_verification_failure_keeps_previous_artifact(tmp_path, capsys, mlp_path, mlp_artifact, config_path,
                                                          perturbed_reference):
    import shutil

    previous = tmp_path / mlp_artifact.name
    shutil.copytree(mlp_artifact, previous)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    code = cli.main(["-q", "compile", str(mlp_path), "--config", str(config_path()), "--input-shape", "x:4x16",
                     "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == VerificationError.exit_code == 5
    assert err.count("tvm-fusion: error:") == 1 and "MISMATCH" in err
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [mlp_artifact.name]


def test_no_verify_writes_despite_a_wrong_reference(tmp_path, mlp_path, config_path, perturbed_reference):
    result = api.compile_model(mlp_path, config_path(), ["x:4x16"], output_dir=tmp_path, verify=False)
    assert result.artifact.is_dir() and result.comparisons == []
    assert result.metadata["verification"] is None


# Ill-conditioned outputs: ONNX Runtime's own spread (verify.judge_conditioning).

def judge(actual, expected, variant, rtol=RTOL, atol=ATOL):
    """One output ``y`` judged with ONNX Runtime's variant run injected."""
    actual, expected = {"y": np.asarray(actual, np.float32)}, {"y": np.asarray(expected, np.float32)}
    runs = {"graph optimizations off": {"y": np.asarray(variant, np.float32)}}
    [result] = verify.judge_conditioning(compare_outputs(actual, expected, rtol, atol), actual, expected,
                                         lambda: runs, rtol, atol)
    return result


def test_ill_conditioned_output_passes_within_the_multiple_of_the_reference_spread():
    expected = [1.0, 2.0, 4.0]
    result = judge([1.0, 2.05, 4.0], expected, variant=[1.0, 2.03, 4.0])
    assert not result.within_tolerance and result.passed  # the tolerance is still reported as missed
    spread = result.reference_spread
    assert spread.ill_conditioned and spread.accepted
    assert spread.configuration == "graph optimizations off"
    assert spread.max_abs == pytest.approx(0.03, rel=1e-4) and spread.outside == 1
    assert spread.multiple == pytest.approx(0.03 / (ATOL + RTOL * 2.0), rel=1e-4)
    assert spread.ours == pytest.approx(0.05 / (ATOL + RTOL * 2.0), rel=1e-4)
    assert spread.allowed == pytest.approx(verify.SPREAD_MULTIPLE * spread.multiple)
    check_outputs([result], RTOL, ATOL)  # does not raise
    data = result.to_json()
    assert data["within_tolerance"] is False and data["passed"] is True
    assert data["reference_spread"]["ill_conditioned"] and data["reference_spread"]["accepted"]


def test_error_beyond_the_multiple_of_the_reference_spread_fails():
    result = judge([1.0, 2.05, 4.0], [1.0, 2.0, 4.0], variant=[1.0, 2.02, 4.0])  # 0.05 > 2 x 0.02
    assert result.reference_spread.ill_conditioned and not result.passed
    with pytest.raises(VerificationError):
        check_outputs([result], RTOL, ATOL)


def test_well_conditioned_output_with_a_planted_error_fails():
    """ONNX Runtime agrees with itself within the tolerance: no spread to lean on, whatever it is."""
    for variant in ([1.0, 2.0, 4.0], [1.0, 2.001, 4.0]):  # bit-equal, and within the tolerance
        result = judge([1.0, 2.05, 4.0], [1.0, 2.0, 4.0], variant=variant)
        assert not result.reference_spread.ill_conditioned and not result.passed
        assert result.reference_spread.allowed == 1.0
        row = format_comparisons([result], RTOL, ATOL).splitlines()[1]
        assert "MISMATCH" in row and "within the tolerance" in row


def test_spread_is_only_measured_for_an_output_outside_the_tolerance():
    calls = []
    actual = expected = {"y": np.ones(3, np.float32)}
    results = verify.judge_conditioning(compare_outputs(actual, expected, RTOL, ATOL), actual, expected,
                                        lambda: calls.append(1) or {}, RTOL, ATOL)
    assert calls == [] and results[0].reference_spread is None
    assert len(format_comparisons(results, RTOL, ATOL).splitlines()) == 3  # no ill-conditioned rule line


def test_missing_or_non_finite_outputs_are_never_ill_conditioned():
    result = judge([1.0, np.nan], [1.0, 2.0], variant=[1.0, 5.0])
    assert result.reference_spread is None and not result.passed
    results = verify.judge_conditioning(compare_outputs({}, {"y": np.ones(2)}, RTOL, ATOL), {}, {"y": np.ones(2)},
                                        lambda: {"v": {"y": np.full(2, 9.0)}}, RTOL, ATOL)
    assert results[0].reference_spread is None and not results[0].passed


def test_the_table_names_the_ill_conditioned_output_with_both_errors():
    result = judge([1.0, 2.05, 4.0], [1.0, 2.0, 4.0], variant=[1.0, 2.03, 4.0])
    result.name = "last_hidden_state"
    text = format_comparisons([result], RTOL, ATOL)
    row = next(line for line in text.splitlines() if line.startswith("last_hidden_state"))
    assert "ILL-CONDITIONED" in row and "graph optimizations off" in row
    assert f"{result.reference_spread.ours:.3g}x" in row and f"{result.reference_spread.multiple:.3g}x" in row
    assert "max abs 3.000e-02, 1 element outside" in row and f"allowed {result.reference_spread.allowed:.3g}x" in row
    assert "1 of 3 elements outside; worst: tvm_fusion 2.05, ONNX Runtime 2" in row  # ours, as for a mismatch
    assert text.splitlines()[-1].startswith("ill-conditioned: ONNX Runtime rerun with graph optimizations off")


def rms_norm_dynamic_matmul():
    """T5's RMSNorm -> DynamicQuantizeLinear -> MatMulInteger: ONNX Runtime fuses the norm into
    SimplifiedLayerNormalization when optimizing, which rounds some normalized values 1 ulp apart;
    at the input below one lands on the other side of a quantization step (found by sweeping
    x[0, 5]), and the output moves ~30x the tolerance: ill-conditioned by construction."""
    rng = np.random.default_rng(0)
    constants = {"w": rng.integers(-127, 128, (16, 4)).astype(np.int8), "wz": np.array(0, np.int8),
                 "ws": np.array(0.01, np.float32), "two": np.array(2.0, np.float32),
                 "eps": np.array(1e-6, np.float32), "g": rng.standard_normal(16).astype(np.float32)}
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("ReduceMean", ["p"], ["m"], axes=[-1]),
             helper.make_node("Add", ["m", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["n"]), helper.make_node("Mul", ["g", "n"], ["xn"]),
             helper.make_node("DynamicQuantizeLinear", ["xn"], ["q", "qs", "qz"]),
             helper.make_node("MatMulInteger", ["q", "w", "qz", "wz"], ["i"]),
             helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["qs", "ws"], ["sc"]), helper.make_node("Mul", ["f", "sc"], ["y"])]
    graph = helper.make_graph(nodes, "rms_dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    x[0, 5] = np.float32(0.37160220742225647)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), {"x": x}


def test_onnxruntime_disagrees_with_itself_on_an_ill_conditioned_model():
    model, inputs = rms_norm_dynamic_matmul()
    expected = verify.reference_outputs(model, inputs)
    runs = verify.reference_variants(model, inputs)
    assert set(runs) == set(verify.REFERENCE_VARIANTS)
    assert verify.tolerance_multiple(runs["graph optimizations off"]["y"], expected["y"], RTOL, ATOL) > 10
    # Ours computed in the unfused order (as graph optimizations off): ill-conditioned, passes, named.
    ours = {"y": runs["graph optimizations off"]["y"]}
    [result] = verify.judge_conditioning(compare_outputs(ours, expected, RTOL, ATOL), ours, expected,
                                         lambda: runs, RTOL, ATOL)
    assert not result.within_tolerance and result.passed and result.reference_spread.ours > 10
    assert "ILL-CONDITIONED" in format_comparisons([result], RTOL, ATOL)
    # A planted error 3x ONNX Runtime's own on that output still fails.
    planted = {"y": expected["y"] + 3 * (runs["graph optimizations off"]["y"] - expected["y"])}
    [result] = verify.judge_conditioning(compare_outputs(planted, expected, RTOL, ATOL), planted, expected,
                                         lambda: runs, RTOL, ATOL)
    assert result.reference_spread.ill_conditioned and not result.passed


def test_onnxruntime_agrees_with_itself_on_a_well_conditioned_model(mlp_path):
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    model = onnx.load(mlp_path)
    expected = verify.reference_outputs(model, {"x": x})
    for outputs in verify.reference_variants(model, {"x": x}).values():
        assert verify.tolerance_multiple(outputs["y"], expected["y"], RTOL, ATOL) < 0.1
    planted = {"y": expected["y"] + np.float32(0.01)}
    [result] = verify.judge_conditioning(compare_outputs(planted, expected, RTOL, ATOL), planted, expected,
                                         lambda: verify.reference_variants(model, {"x": x}), RTOL, ATOL)
    assert not result.reference_spread.ill_conditioned and not result.passed


@pytest.fixture
def ill_conditioned_reference(monkeypatch):
    """ONNX Runtime's outputs shifted by 0.5, its variants by 0.2: its own spread is 0.3, and the
    compiled module's error of 0.5 is within 2x that."""
    monkeypatch.setattr(references, "reference_outputs", shifted(verify.reference_outputs, 0.5))
    monkeypatch.setattr(references, "reference_variants", shifted(verify.reference_variants, 0.2))


def test_compile_passes_an_ill_conditioned_output_and_says_so(tmp_path, capsys, mlp_path, config_path,
                                                              ill_conditioned_reference):
    code = cli.main(["compile", str(mlp_path), "--config", str(config_path()), "--input-shape", "x:4x16",
                     "-o", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0
    row = next(line for line in captured.out.splitlines() if line.startswith("y "))
    assert "ILL-CONDITIONED" in row and "allowed" in row
    assert "ILL-CONDITIONED output y" in captured.err  # the progress line
    [artifact] = tmp_path.iterdir()
    verification = json.loads((artifact / "metadata.json").read_text())["verification"]
    [output] = verification["outputs"]
    assert output["within_tolerance"] is False and output["passed"] is True
    assert output["reference_spread"]["accepted"] and output["reference_spread"]["max_abs"] == pytest.approx(0.3, 1e-3)
    assert verification["ill_conditioned"]["outputs"] == ["y"]


def mean_before_a_cancellation():
    """(row mean of x - c) * 1e6, with c each row's mean rounded from float64: the output is the
    mean's last bits. No graph optimization rewrites a lone ReduceMean, so only its sums taken in
    another order show ONNX Runtime's own spread (T5's layer norms before DynamicQuantizeLinear)."""
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    constants = {"axes": np.array([-1], np.int64), "c": x.astype(np.float64).mean(-1, keepdims=True).astype(np.float32),
                 "big": np.array(1e6, np.float32)}
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"]), helper.make_node("Sub", ["m", "c"], ["d"]),
             helper.make_node("Mul", ["d", "big"], ["y"])]
    graph = helper.make_graph(nodes, "mean_cancel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 1])],
                              [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), {"x": x}


def test_only_sums_in_another_order_show_the_spread_of_a_mean_before_a_cancellation():
    model, inputs = mean_before_a_cancellation()
    expected = verify.reference_outputs(model, inputs)
    runs = verify.reference_variants(model, inputs)
    assert set(runs) == set(verify.REFERENCE_VARIANTS) - {NUDGED}  # no run-time quantization to nudge
    for name in ("graph optimizations off", "another intra-op thread count"):
        np.testing.assert_array_equal(runs[name]["y"], expected["y"])  # the same sums, bit for bit
    assert verify.tolerance_multiple(runs["reductions summed by halves"]["y"], expected["y"], RTOL, ATOL) > 1


def test_the_reference_runs_on_a_thread_of_its_own(monkeypatch, mlp_path):
    """ONNX Runtime's AMX products take the tile configuration of their thread to be their own;
    our AMX kernels load theirs on the threads they run on (verify._reference_thread)."""
    threads = []

    def recording(session, feeds):
        threads.append(threading.current_thread())
        return run(session, feeds)

    run = verify.run_onnxruntime
    monkeypatch.setattr(verify, "run_onnxruntime", recording)
    model, inputs = onnx.load(mlp_path), {"x": np.zeros((4, 16), np.float32)}
    verify.reference_outputs(model, inputs)
    verify.reference_variants(model, inputs)
    assert len(threads) == len(verify.REFERENCE_VARIANTS)  # the reference, and each variant but the nudge
    assert {thread.name for thread in threads} == {"onnxruntime-reference_0"}
