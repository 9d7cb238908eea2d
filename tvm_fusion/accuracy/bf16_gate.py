"""The bf16 accuracy gate: a bf16 build's outputs against ONNX Runtime float32, per output.

A bf16 matmul rounds its operands to 8 significant bits (unit roundoff u = 2^-8), so its error
scales with the magnitude of what it sums, not with each output element: float32's element-wise
rule (``atol + rtol * |reference|``) fails wherever a sum cancels to near zero. A float output
passes when

* every element has ``|ours - reference| <= atol * peak + rtol * |reference|``, ``peak`` the
  output's largest ``|reference|``: a local error (one wrong row, a box off by pixels) fails;
* its cosine similarity to the reference is at least ``min_cosine``: drift spread over the
  whole output, which a heavy-tailed output's peak would hide, fails (``1 - cos`` is about
  ``r^2 / 2`` for a relative RMS error ``r``);
* a classifier-like output (``classifier_outputs``) has a top-1 agreement of at least
  ``min_top1`` over its rows, a row where the reference scores our answer within the element
  tolerance of its own counted as agreeing (a near tie: either answer is within bf16 rounding).

An integer or bool output (indices, masks) keeps the float32 rule, ``[verify] rtol/atol``.
The defaults and their reasons are in docs/precision.md.

Some outputs fail the gate in float32 already: ONNX Runtime against itself (``verify.
REFERENCE_VARIANTS``) differs by more than the gate allows, as where a detector's sigmoid map of
noise is a few float32 steps from zero everywhere. Such an output is ill-conditioned at these
inputs, as in float32's check (``verify.judge_conditioning``), and passes within
``SPREAD_MULTIPLE`` times ONNX Runtime's own difference, in shares of the gate's allowance
(``Bf16Tolerance.share``); a top-1 disagreement still fails (``judge_bf16_conditioning``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx

from ..errors import VerificationError
from ..verify import REFERENCE_VARIANTS, SPREAD_MULTIPLE, OutputComparison, compare_outputs, judge_by_spread
from .output_error import cosine_similarity, max_abs_error, max_rel_error, top1_agreement

# Producers of class scores, and consumers that pick a class from them.
SCORE_OPS = ("Softmax", "LogSoftmax")
DECISION_OPS = ("ArgMax", "TopK")
# A 2-D output ([batch, classes]) of these ops, or their sum with a bias, is a classifier head's logits.
HEAD_OPS = ("Gemm", "MatMul")


class Bf16GateFailure(VerificationError):
    """A bf16 build outside the gate; ``failures`` names each failing output and why (auto's report)."""

    def __init__(self, message: str, hint: str, failures: list[str]):
        super().__init__(message, hint)
        self.failures = failures


@dataclasses.dataclass(frozen=True)
class Bf16Tolerance:
    """``[verify] bf16_*``: 8 u for the element rule (atol of the peak, rtol of the element), a
    relative RMS error of about 4.5% for the cosine, every non-tied row for top-1."""

    rtol: float = 2.0 ** -5
    atol: float = 2.0 ** -5
    min_cosine: float = 0.999
    min_top1: float = 1.0

    def scaled(self, margin: float) -> Bf16Tolerance:
        """Every error allowance times ``margin``: the element rule's, and the relative RMS
        error the cosine allows (``1 - cos`` goes as its square)."""
        return Bf16Tolerance(self.rtol * margin, self.atol * margin, 1 - (1 - self.min_cosine) * margin ** 2,
                             self.min_top1)

    def share(self, error: np.ndarray, reference: np.ndarray) -> float:
        """How much of this tolerance ``error`` (a change in an output ``reference``) takes
        alone, 1 the whole of it: the larger of its worst element against the element rule and
        its relative RMS against what the cosine allows."""
        error, reference = error.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
        norm = np.linalg.norm(reference)
        if not error.size or norm == 0:
            return 0.0
        allowed = self.atol * np.abs(reference).max() + self.rtol * np.abs(reference)
        worst = float(np.max(np.abs(error) / np.maximum(allowed, np.finfo(np.float64).tiny)))
        rms_allowed = np.sqrt(max(2 * (1 - self.min_cosine), np.finfo(np.float64).tiny))
        return max(worst, float(np.linalg.norm(error) / norm / rms_allowed))


@dataclasses.dataclass
class Bf16Comparison(OutputComparison):
    cosine: float | None = None  # None for an integer or bool output
    top1_agreement: float | None = None  # classifier-like outputs only: plain share of rows agreeing
    top1_rows: int = 0
    near_ties: int = 0  # rows that disagree where the reference's own margin is within the tolerance


def classifier_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Graph outputs that score classes, by how: ``"scores"`` made by Softmax or LogSoftmax or read
    by ArgMax or TopK; ``"head"`` made by Gemm or MatMul (plus a bias), a head's logits when the
    output is 2-D ([batch, classes]). A hidden state or an embedding is neither, and its argmax
    means nothing."""
    graph = model.graph
    made_by = {out: node for node in graph.node for out in node.output}
    decided = {node.input[0] for node in graph.node if node.op_type in DECISION_OPS and node.input}

    def op(name: str) -> str:
        return made_by[name].op_type if name in made_by else ""

    roles = {}
    for output in graph.output:
        maker = made_by.get(output.name)
        if op(output.name) in SCORE_OPS or output.name in decided:
            roles[output.name] = "scores"
        elif op(output.name) in HEAD_OPS or (maker is not None and maker.op_type == "Add"
                                              and any(op(name) in HEAD_OPS for name in maker.input)):
            roles[output.name] = "head"
    return roles


def _is_classifier(name: str, value: np.ndarray, classifiers: dict[str, str]) -> bool:
    if value.ndim == 0 or value.shape[-1] < 2:
        return False
    role = classifiers.get(name)
    return role == "scores" or (role == "head" and value.ndim == 2)


def _near_ties(ours: np.ndarray, reference: np.ndarray, allowed) -> int:
    """Rows whose argmax differs where the reference scores our pick within the tolerance of its own."""
    rows_a, rows_e = ours.reshape(-1, ours.shape[-1]), reference.reshape(-1, reference.shape[-1])
    picked, best = np.argmax(rows_a, axis=-1), np.argmax(rows_e, axis=-1)
    index = np.arange(len(rows_e))
    top, ours_there = rows_e[index, best], rows_e[index, picked]
    margin_allowed = allowed(top) + allowed(ours_there)
    return int(np.sum((picked != best) & (top - ours_there <= margin_allowed)))


def compare_bf16(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], tolerance: Bf16Tolerance,
                 classifiers: dict[str, str], rtol: float, atol: float) -> list[Bf16Comparison]:
    """Per output: max abs and rel error, cosine, top-1 agreement where classifier-like, and the
    gate's verdict; ``rtol``/``atol`` judge the integer and bool outputs."""
    results = []
    for name, reference in expected.items():
        value = actual.get(name)
        if (value is None or value.shape != reference.shape or not np.issubdtype(reference.dtype, np.floating)
                or not np.isfinite(value).all() or not np.isfinite(reference).all()):
            (plain,) = compare_outputs({name: value} if value is not None else {}, {name: reference}, rtol, atol)
            results.append(Bf16Comparison(**dataclasses.asdict(plain)))
            continue
        peak = float(np.abs(reference).max(initial=0.0))

        def allowed(e, peak=peak):
            return tolerance.atol * peak + tolerance.rtol * np.abs(e)

        diff = np.abs(value.astype(np.float64) - reference.astype(np.float64))
        outside = int(np.sum(diff > allowed(reference.astype(np.float64))))
        cosine = cosine_similarity(value, reference)
        problems = [f"{outside} of {diff.size} elements outside"] if outside else []
        if cosine < tolerance.min_cosine:
            problems.append(f"cosine {cosine:.7f} < {tolerance.min_cosine}")
        comparison = Bf16Comparison(name, max_abs_error(value, reference), max_rel_error(value, reference),
                                    True, cosine=cosine)
        if _is_classifier(name, reference, classifiers):
            ties = _near_ties(value.astype(np.float64), reference.astype(np.float64), allowed)
            rows = reference.size // reference.shape[-1]
            agreement = top1_agreement(value, reference)
            comparison.top1_agreement, comparison.top1_rows, comparison.near_ties = agreement, rows, ties
            gated = agreement + ties / rows if rows else 1.0
            if gated < tolerance.min_top1:
                problems.append(f"top-1 agreement {gated:.4g} < {tolerance.min_top1}")
        comparison.within_tolerance = not problems
        comparison.note = "; ".join(problems)
        results.append(comparison)
    return results


def judge_bf16_conditioning(results: list[Bf16Comparison], actual: dict[str, np.ndarray],
                            expected: dict[str, np.ndarray], variants: Callable[[], dict[str, dict[str, np.ndarray]]],
                            tolerance: Bf16Tolerance) -> list[Bf16Comparison]:
    """Each float output outside the gate by its elements or cosine alone gets ONNX Runtime's own
    spread on it (``variants()``: the reference's outputs under ``verify.REFERENCE_VARIANTS``, run
    only when some output needs them), in shares of the gate's allowance; where that share is
    over 1 the output is ill-conditioned and passes within ``SPREAD_MULTIPLE`` times it
    (``verify.judge_by_spread``)."""
    def ours(r: Bf16Comparison) -> float | None:
        reference, value = expected.get(r.name), actual.get(r.name)
        if r.cosine is None or "top-1" in r.note or reference is None or value is None:
            return None
        return tolerance.share(value - reference, reference)

    def measure(values: np.ndarray, reference: np.ndarray) -> tuple[float, int] | None:
        if values.shape != reference.shape or not np.isfinite(values).all():
            return None
        allowed = tolerance.atol * float(np.abs(reference).max()) + tolerance.rtol * np.abs(reference)
        outside = int(np.sum(np.abs(values.astype(np.float64) - reference) > allowed))
        return tolerance.share(values - reference, reference), outside

    return judge_by_spread(results, expected, variants, ours, measure)


def compare_bf16_matmul(name: str, activation: np.ndarray, weight: np.ndarray,
                        tolerance: Bf16Tolerance) -> Bf16Comparison:
    """One matmul's bf16 product against its exact one on the activation the model gave it,
    judged by the element rule and the cosine (a hidden value: no top-1). Both operands are
    rounded to bf16 to nearest even, as the kernel rounds them; the sums are float64, so what is
    judged is the operands' rounding, which bf16 adds, not the order of float32 sums, which
    float32 has too."""
    rows = activation.reshape(-1, weight.shape[0])
    exact = rows.astype(np.float64) @ weight.astype(np.float64)
    rounded = [value.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) for value in (rows, weight)]
    (result,) = compare_bf16({name: rounded[0] @ rounded[1]}, {name: exact}, tolerance, {}, 0.0, 0.0)
    return result


def _top1_text(r: Bf16Comparison) -> str:
    if r.top1_agreement is None:
        return "-"
    ties = f", {r.near_ties} tied" if r.near_ties else ""
    return f"{round(r.top1_agreement * r.top1_rows)}/{r.top1_rows}{ties}"


def format_bf16(results: list[Bf16Comparison], tolerance: Bf16Tolerance) -> str:
    """The table at bf16, then the gate's rule (and the ill-conditioned outputs' where measured)."""
    lines = [f"{'output':<24} {'max abs err':>12} {'max rel err':>12} {'cosine':>10} {'top-1':>9}  result"]
    for r in results:
        cosine = "-" if r.cosine is None else f"{r.cosine:.6f}"
        lines.append(f"{r.name:<24} {r.max_abs:>12.3e} {r.max_rel:>12.3e} {cosine:>10} {_top1_text(r):>9}  "
                     f"{_verdict(r)}".rstrip())
    lines.append(f"bf16 gate, against ONNX Runtime float32: every element within {tolerance.atol:g} * "
                 f"max|ONNX Runtime| + {tolerance.rtol:g} * |ONNX Runtime|, cosine >= {tolerance.min_cosine:g}, "
                 f"top-1 agreement (near ties counted) >= {tolerance.min_top1:g} where classifier-like")
    if any(r.reference_spread is not None for r in results):
        lines.append(f"ill-conditioned: ONNX Runtime rerun with {' / '.join(REFERENCE_VARIANTS)} is itself outside "
                     f"the gate; then ok within {SPREAD_MULTIPLE:g}x its own difference (in shares of the gate's "
                     "allowance: the worst element's, or the relative RMS error's against the cosine's)")
    return "\n".join(lines)


def spread_summary(r: OutputComparison) -> str:
    """Ours and ONNX Runtime's own difference in shares of the gate's allowance, and the bound."""
    spread = r.reference_spread
    if spread is None:
        return ""
    return (f"{spread.ours:.3g}x the gate, ONNX Runtime against itself ({spread.configuration}) "
            f"{spread.multiple:.3g}x" + (f", allowed {spread.allowed:.3g}x" if spread.ill_conditioned else ""))


def _verdict(r: Bf16Comparison) -> str:
    if r.reference_spread is None:
        return f"{'ok' if r.passed else 'MISMATCH'} {r.note}"
    return f"{'ok, ILL-CONDITIONED' if r.passed else 'MISMATCH'} {r.note}; {spread_summary(r)}"


def check_bf16(results: list[Bf16Comparison], tolerance: Bf16Tolerance, at: str = "") -> None:
    """``at``: where a range was run (`` at sequence=512``), for the message."""
    if not all(r.passed for r in results):
        raise Bf16GateFailure(
            f"the bf16 build fails the accuracy gate against ONNX Runtime float32{at}:\n"
            + format_bf16(results, tolerance),
            "no artifact was written; use --precision float32 (or auto, which falls back to it), or loosen "
            "[verify] bf16_rtol/bf16_atol/bf16_min_cosine/bf16_min_top1 if the error is acceptable",
            [f"{r.name}: {r.note}" for r in results if not r.passed])
