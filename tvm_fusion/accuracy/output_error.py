"""How far one run's output is from a reference run's: the measures that ``bench`` reports
for every runner against ONNX Runtime float32, and that a reduced-precision (bf16) build is
judged by.

Pure numpy, one output array per call, ``b`` the reference. Both are read as float64, so that a
bool or integer output (a mask, an index) is compared too, and float32 rounding does not add to
the error measured. A non-finite element counts as no error where both sides hold the same value
(the same inf, or nan on both) and as an infinite error where they differ.
"""

from __future__ import annotations

import numpy as np

# Where the reference is zero, the relative error is taken against this (as verify's table does).
REL_ERROR_FLOOR = 1e-12


def _pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} and {b.shape}")
    return a, b


def _abs_differences(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    return np.where(same, 0.0, np.nan_to_num(diff, nan=np.inf, posinf=np.inf))


def max_abs_error(a, b) -> float:
    """The largest ``|a - b|`` over the elements (0 for empty arrays)."""
    a, b = _pair(a, b)
    return float(_abs_differences(a, b).max(initial=0.0))


def max_rel_error(a, b) -> float:
    """The largest ``|a - b| / |b|`` over the elements, ``b`` the reference (under
    ``REL_ERROR_FLOOR``, taken as that). Elements near zero in the reference dominate it: read it
    beside the max abs error."""
    a, b = _pair(a, b)
    with np.errstate(invalid="ignore"):
        rel = _abs_differences(a, b) / np.fmax(np.abs(b), REL_ERROR_FLOOR)
    return float(np.nan_to_num(rel, nan=np.inf).max(initial=0.0))


def cosine_similarity(a, b) -> float:
    """``a . b / (|a| |b|)`` over the flattened arrays: 1 for the same direction, however small
    each element's error. Two all-zero (or empty) arrays are alike (1); one all-zero is not (0);
    any non-finite element gives nan."""
    a, b = (x.ravel() for x in _pair(a, b))
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    # Scaled by the largest magnitude first, so that no sum of squares can overflow.
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    if scale == 0.0:
        return 1.0
    a, b = a / scale, b / scale
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 0.0 if norms == 0.0 else float(np.clip(np.dot(a, b) / norms, -1.0, 1.0))


def top1_agreement(a, b) -> float:
    """The share of rows (every index but the last axis) whose argmax over the last axis is the
    same in ``a`` as in ``b``: for classifier-like outputs, whether the answer changed."""
    a, b = _pair(a, b)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"top-1 agreement needs a last axis to take the argmax over, not shape {a.shape}")
    if a.size == 0:
        return 1.0
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
