"""Verification against ONNX Runtime: the comparison itself, and compile refusing wrong modules."""

from __future__ import annotations

import numpy as np
import pytest

from tvm_fusion import api, cli
from tvm_fusion.commands import compile as compilation
from tvm_fusion.errors import VerificationError
from tvm_fusion.verify import check_outputs, compare_outputs, format_comparisons

RTOL, ATOL = 1e-3, 1e-4


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


@pytest.fixture
def perturbed_reference(monkeypatch):
    """ONNX Runtime's outputs shifted by 0.5: the compiled module now looks wrong."""
    real = compilation.reference_outputs

    def perturbed(model, inputs, threads=1):
        return {name: value + np.float32(0.5) for name, value in real(model, inputs, threads).items()}

    monkeypatch.setattr(compilation, "reference_outputs", perturbed)


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
