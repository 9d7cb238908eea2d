"""The error measures bench reports against ONNX Runtime float32 (tvm_fusion.accuracy.output_error)."""

import numpy as np
import pytest

from tvm_fusion.accuracy.output_error import cosine_similarity, max_abs_error, max_rel_error, top1_agreement


def test_equal_arrays_have_no_error():
    a = np.random.default_rng(0).standard_normal((3, 5)).astype("float32")
    assert max_abs_error(a, a.copy()) == 0.0 and max_rel_error(a, a.copy()) == 0.0
    assert cosine_similarity(a, a.copy()) == pytest.approx(1.0, abs=1e-15)
    assert top1_agreement(a, a.copy()) == 1.0


def test_errors_are_measured_against_the_second_array():
    reference = np.array([1.0, -2.0, 0.0, 4.0], "float32")
    produced = np.array([1.5, -2.0, 1e-6, 4.0], "float32")
    assert max_abs_error(produced, reference) == pytest.approx(0.5)
    # The reference's zero is taken as 1e-12 (as verify's table does): the near-zero element decides.
    assert max_rel_error(produced, reference) == pytest.approx(1e-6 / 1e-12, rel=1e-6)
    assert max_rel_error(np.array([1.1, 2.0]), np.array([1.0, 2.0])) == pytest.approx(0.1)


def test_cosine_sees_direction_not_scale():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert cosine_similarity(3 * a, a) == pytest.approx(1.0)
    assert cosine_similarity(-a, a) == pytest.approx(-1.0)
    assert cosine_similarity(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(0.0)
    assert cosine_similarity(np.zeros(3), np.zeros(3)) == 1.0 and cosine_similarity(np.zeros(3), np.ones(3)) == 0.0
    big = np.full(4, 1e200)  # its squares would overflow float64
    assert cosine_similarity(big, big) == pytest.approx(1.0)


def test_top1_agreement_is_the_share_of_rows_whose_argmax_holds():
    reference = np.array([[[0.1, 0.9], [0.8, 0.2]], [[0.3, 0.7], [0.6, 0.4]]])
    produced = reference.copy()
    produced[1, 1] = [0.4, 0.6]  # one of four rows changes its answer
    assert top1_agreement(produced, reference) == 0.75
    with pytest.raises(ValueError, match="last axis"):
        top1_agreement(np.float32(1.0), np.float32(1.0))


def test_masks_and_non_finite_values():
    mask = np.array([True, False, True])
    assert max_abs_error(mask, mask) == 0.0 and max_abs_error(~mask, mask) == 1.0
    same = np.array([np.inf, np.nan, 1.0])
    assert max_abs_error(same, same.copy()) == 0.0 and max_rel_error(same, same.copy()) == 0.0
    assert max_abs_error(np.array([np.nan, 1.0]), np.array([2.0, 1.0])) == np.inf
    assert max_abs_error(np.array([np.inf]), np.array([-np.inf])) == np.inf
    assert np.isnan(cosine_similarity(same, same))
    with pytest.raises(ValueError, match="shapes differ"):
        max_abs_error(np.zeros(2), np.zeros(3))


def test_empty_outputs_have_no_error():
    empty = np.zeros((0, 4), "float32")
    assert max_abs_error(empty, empty) == max_rel_error(empty, empty) == 0.0
    assert cosine_similarity(empty, empty) == 1.0 and top1_agreement(empty, empty) == 1.0
