"""The bf16 accuracy gate (tvm_fusion.accuracy.bf16_gate) on planted outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_fusion.accuracy.bf16_gate import (Bf16Tolerance, check_bf16, classifier_outputs, compare_bf16,
                                           compare_bf16_matmul, format_bf16, judge_bf16_conditioning)
from tvm_fusion.errors import VerificationError

TOLERANCE = Bf16Tolerance()


def gate(actual: dict, expected: dict, classifiers: dict | None = None, tolerance: Bf16Tolerance = TOLERANCE):
    return compare_bf16(actual, expected, tolerance, classifiers or {}, rtol=1e-3, atol=1e-4)


def test_bf16_rounding_of_an_output_passes_the_defaults():
    reference = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    rounded = reference.astype("bfloat16").astype(np.float32)  # rel error <= 2^-8 per element
    (result,) = gate({"y": rounded}, {"y": reference})
    assert result.passed and result.note == ""
    assert 0 < result.max_abs <= 2.0 ** -8 * np.abs(reference).max()
    assert 1 - 1e-5 < result.cosine <= 1.0
    assert result.top1_agreement is None  # not classifier-like: no top-1


def test_cosine_of_known_vectors_decides():
    reference = {"y": np.array([1.0, 0.0, 0.0, 1.0], np.float32)}
    rotated = {"y": np.array([1.0, 0.0, 0.0, 0.9], np.float32)}  # cos = 1.9 / sqrt(2 * 1.81)
    (result,) = gate(rotated, reference, tolerance=Bf16Tolerance(rtol=1.0, atol=1.0))
    assert result.cosine == pytest.approx(1.9 / np.sqrt(2 * 1.81))
    assert not result.passed and "cosine" in result.note  # 0.9986 < 0.999: the elements alone would pass


def test_a_local_error_fails_the_element_rule_though_the_cosine_holds():
    reference = np.linspace(-1.0, 1.0, 10_000).astype(np.float32)
    produced = reference.copy()
    produced[1234] += 0.1  # 0.1 > 2^-5 * peak + 2^-5 * |e|
    (result,) = gate({"y": produced}, {"y": reference})
    assert result.cosine > 0.9999
    assert not result.passed and result.note.startswith("1 of 10000 elements outside")


def test_top1_agreement_with_a_planted_flip():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal((4, 10)).astype(np.float32)
    reference[:, 3] = 5.0  # every row's answer is class 3, by a wide margin
    produced = reference.copy()
    produced[2, 3], produced[2, 7] = 0.0, 6.0  # row 2 now answers class 7
    (result,) = gate({"logits": produced}, {"logits": reference}, {"logits": "scores"})
    assert (result.top1_agreement, result.top1_rows, result.near_ties) == (0.75, 4, 0)
    assert not result.passed and "top-1 agreement 0.75 < 1.0" in result.note


def test_a_flip_between_near_tied_classes_is_not_a_disagreement():
    reference = np.array([[1.0, 0.999, -2.0], [3.0, 0.0, -1.0]], np.float32)
    produced = np.array([[0.999, 1.0, -2.0], [3.0, 0.0, -1.0]], np.float32)
    (result,) = gate({"p": produced}, {"p": reference}, {"p": "scores"})
    assert (result.top1_agreement, result.near_ties) == (0.5, 1)
    assert result.passed


def test_a_head_is_classifier_like_only_when_two_dimensional():
    reference = np.eye(3, dtype=np.float32)
    (flat,) = gate({"h": reference[None]}, {"h": reference[None]}, {"h": "head"})
    (head,) = gate({"h": reference}, {"h": reference}, {"h": "head"})
    assert flat.top1_agreement is None and head.top1_agreement == 1.0


def test_integer_outputs_keep_the_float32_rule():
    indices = np.array([3, 1, 2], np.int64)
    (same,) = gate({"i": indices}, {"i": indices.copy()})
    (moved,) = gate({"i": indices + 1}, {"i": indices})
    assert same.passed and same.cosine is None
    assert not moved.passed and moved.cosine is None
    (missing,) = gate({}, {"i": indices})
    assert not missing.passed and missing.note == "missing"


def test_classifier_outputs_are_read_from_the_graph():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"]),
             helper.make_node("ArgMax", ["logits"], ["label"], keepdims=0),
             helper.make_node("Relu", ["x"], ["hidden"])]
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("logits", "probs", "hidden")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              floats + [helper.make_tensor_value_info("label", TensorProto.INT64, None)],
                              [onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])
    assert classifier_outputs(helper.make_model(graph)) == {"logits": "scores", "probs": "scores"}
    graph.node.pop(2)  # no ArgMax reads the logits: a head's output, classifier-like when 2-D
    assert classifier_outputs(helper.make_model(graph)) == {"logits": "head", "probs": "scores"}
    graph.node.append(helper.make_node("Add", ["logits", "logits"], ["biased"]))  # a head with its bias
    graph.output.append(helper.make_tensor_value_info("biased", TensorProto.FLOAT, None))
    assert classifier_outputs(helper.make_model(graph))["biased"] == "head"


def test_a_failing_output_raises_with_the_table_and_the_way_out():
    reference = np.ones(4, np.float32)
    results = gate({"y": -reference}, {"y": reference})
    with pytest.raises(VerificationError) as info:
        check_bf16(results, TOLERANCE, " at sequence=8")
    assert info.value.exit_code == 5
    assert "bf16 build fails the accuracy gate against ONNX Runtime float32 at sequence=8" in info.value.message
    assert format_bf16(results, TOLERANCE) in info.value.message
    assert "--precision float32" in info.value.hint and "bf16_min_cosine" in info.value.hint
    assert info.value.failures == ["y: 4 of 4 elements outside; cosine -1.0000000 < 0.999"]


def zero_sum_columns(rng, shape=(64, 32)) -> np.ndarray:
    raw = rng.standard_normal(shape)
    return (raw - raw.mean(axis=0)).astype(np.float32)


def test_a_matmul_on_centered_activations_passes_alone():
    """Independent activations: bf16 rounding errs by about u of the output, whatever the weight."""
    rng = np.random.default_rng(0)
    result = compare_bf16_matmul("m", rng.standard_normal((8, 64)).astype(np.float32), zero_sum_columns(rng), TOLERANCE)
    assert result.passed and result.cosine > 0.9999 and result.top1_agreement is None


def test_a_matmul_whose_activation_cancels_against_its_weight_fails_alone():
    """A large common part of the activation (an offset) meets weight columns summing to zero: the
    float32 product is the small remainder, which bf16's rounding of the operands swamps."""
    rng = np.random.default_rng(0)
    shifted = (rng.standard_normal((2, 4, 64)) + 1000.0).astype(np.float32)
    result = compare_bf16_matmul("m", shifted, zero_sum_columns(rng), TOLERANCE)
    assert not result.passed and result.cosine < 0.9 and "cosine" in result.note
    assert result.name == "m"


def test_a_scaled_tolerance_shrinks_every_allowance():
    half = TOLERANCE.scaled(0.5)
    assert (half.rtol, half.atol, half.min_top1) == (TOLERANCE.rtol / 2, TOLERANCE.atol / 2, TOLERANCE.min_top1)
    assert 1 - half.min_cosine == pytest.approx((1 - TOLERANCE.min_cosine) / 4)  # the RMS error allowed halves


def test_share_is_the_larger_of_the_element_rule_and_the_rms_error():
    reference = np.linspace(-1.0, 1.0, 1000)
    one_element = np.zeros(1000)
    one_element[10] = 2 * (TOLERANCE.atol + TOLERANCE.rtol * abs(reference[10]))  # twice its allowance
    assert TOLERANCE.share(one_element, reference) == pytest.approx(2.0)
    spread = 0.01 * reference  # relative RMS 1%, the cosine allows sqrt(0.002) = 4.5%
    assert TOLERANCE.share(spread, reference) == pytest.approx(0.01 / np.sqrt(0.002))
    assert TOLERANCE.share(np.zeros(3), np.zeros(3)) == 0.0


def ill_conditioned_case(ours_factor: float):
    """An output a few float32 steps from zero, as a detector's sigmoid map of noise: ONNX Runtime
    against itself is off by a relative RMS of 5%, past the cosine's 4.5%."""
    rng = np.random.default_rng(2)
    reference = np.abs(rng.standard_normal(4096)) * 1e-6
    noise = rng.standard_normal(4096) * 0.05 * np.sqrt(np.mean(reference ** 2))
    variant = reference + noise
    ours = reference + ours_factor * noise[::-1]
    results = gate({"map": ours}, {"map": reference})
    return judge_bf16_conditioning(results, {"map": ours}, {"map": reference}, lambda: {"optimizations off": {
        "map": variant}}, TOLERANCE)


def test_an_output_onnx_runtime_itself_fails_passes_within_twice_its_spread():
    (result,) = ill_conditioned_case(1.5)
    assert not result.within_tolerance and result.passed
    spread = result.reference_spread
    assert spread.configuration == "optimizations off" and spread.multiple > 1.0 and spread.ours <= spread.allowed
    assert "ok, ILL-CONDITIONED" in format_bf16([result], TOLERANCE)


def test_beyond_twice_its_spread_it_fails():
    (result,) = ill_conditioned_case(3.0)
    assert not result.passed and result.reference_spread.ours > result.reference_spread.allowed
    assert "MISMATCH" in format_bf16([result], TOLERANCE)


def test_a_well_conditioned_output_gets_no_allowance():
    reference = np.linspace(1.0, 2.0, 100)
    ours = reference * 1.1  # 10% off: outside
    (result,) = judge_bf16_conditioning(gate({"y": ours}, {"y": reference}), {"y": ours}, {"y": reference},
                                        lambda: {"optimizations off": {"y": reference.copy()}}, TOLERANCE)
    assert not result.passed and result.reference_spread.multiple == 0.0 and result.reference_spread.allowed == 1.0


def test_a_top1_disagreement_is_never_excused_and_a_passing_output_runs_no_variant():
    reference = np.array([[1.0, 0.0], [0.0, 1.0]])
    flipped = reference[:, ::-1].copy()
    (result,) = gate({"p": flipped}, {"p": reference}, {"p": "scores"})

    def no_variants():
        raise AssertionError("variants run for an output they cannot excuse")
    (judged,) = judge_bf16_conditioning([result], {"p": flipped}, {"p": reference}, no_variants, TOLERANCE)
    assert judged.reference_spread is None and not judged.passed
    (passing,) = gate({"p": reference}, {"p": reference}, {"p": "scores"})
    assert judge_bf16_conditioning([passing], {"p": reference}, {"p": reference}, no_variants, TOLERANCE) == [passing]
