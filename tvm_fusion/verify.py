"""Compare a compiled module with ONNX Runtime on the same seeded inputs.

An output is ok when every element is within ``atol + rtol * |reference|``. One that is not is
checked once more against ONNX Runtime's own spread: the reference rerun in configurations that
compute the same function with its float operations in another order or their last bits moved
(``REFERENCE_VARIANTS``).
Where that spread alone exceeds the tolerance, the output is ill-conditioned at these inputs (a
last-bit difference before a run-time quantization moves a value across a rounding step, and the
model amplifies it): it passes when our error is at most ``SPREAD_MULTIPLE`` times that spread,
and the table and metadata say so, with both numbers. Elsewhere the tolerance is all there is.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from .accuracy.reference_variants import halved_reductions, nudged_quantization_inputs
from .errors import VerificationError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Our error may be this many times ONNX Runtime's own spread on an ill-conditioned output: one
# configuration's spread can understate what 1-ulp noise before its quantizations does by about
# this much (the measurements are in docs/commands.md).
SPREAD_MULTIPLE = 2.0


class ReferenceUnavailable(VerificationError):
    """ONNX Runtime cannot run the model (no CPU kernel for an op at its dtype, say): no reference."""


@dataclasses.dataclass
class ReferenceSpread:
    """ONNX Runtime against itself on one output, in multiples of the tolerance: the worst
    ``|d| / (atol + rtol * |reference|)`` over the elements, d between the two runs."""

    configuration: str  # the variant that differed most from the reference
    max_abs: float  # its max abs difference from the reference
    multiple: float  # ONNX Runtime's own difference, in multiples of the tolerance
    outside: int  # ONNX Runtime's own elements outside the tolerance
    ours: float  # our difference, in the same multiples
    allowed: float  # SPREAD_MULTIPLE * multiple where that is over 1 (ill-conditioned), else 1

    @property
    def ill_conditioned(self) -> bool:
        return self.multiple > 1.0

    @property
    def accepted(self) -> bool:
        return self.ill_conditioned and self.ours <= self.allowed

    def summary(self) -> str:
        """Our multiple, ONNX Runtime's own (its configuration, max abs, elements outside), the bound."""
        elements = f"{self.outside} element{'' if self.outside == 1 else 's'}"
        return (f"{self.ours:.3g}x the tolerance, ONNX Runtime against itself ({self.configuration}) "
                f"{self.multiple:.3g}x (max abs {self.max_abs:.3e}, {elements} outside)"
                + (f", allowed {self.allowed:.3g}x" if self.ill_conditioned else ", within the tolerance"))


@dataclasses.dataclass
class OutputComparison:
    name: str
    max_abs: float
    max_rel: float
    within_tolerance: bool
    note: str = ""
    # Measured only for an output outside the tolerance (judge_conditioning).
    reference_spread: ReferenceSpread | None = None

    @property
    def passed(self) -> bool:
        """Within the tolerance, or ill-conditioned and within SPREAD_MULTIPLE x ONNX Runtime's own spread."""
        return self.within_tolerance or (self.reference_spread is not None and self.reference_spread.accepted)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        if self.reference_spread is not None:
            data["reference_spread"].update(ill_conditioned=self.reference_spread.ill_conditioned,
                                            accepted=self.reference_spread.accepted)
        data["passed"] = self.passed
        return data


def _other_thread_count(threads: int) -> int:
    return 1 if threads > 1 else 2


# Configurations that compute the same function as the reference, with its float operations in
# another order or their last bits moved (``accuracy/reference_variants.py``): the reference's own
# rounding noise. Name -> (graph optimization level, threads, what the model becomes).
REFERENCE_VARIANTS = {
    "graph optimizations off": (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, lambda threads: threads, None),
    "another intra-op thread count": (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, _other_thread_count, None),
    "reductions summed by halves": (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, lambda threads: threads,
                                    halved_reductions),
    "run-time quantizations' inputs an ulp up": (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, lambda threads: threads,
                                                  nudged_quantization_inputs),
}


def onnxruntime_session(model: onnx.ModelProto, threads: int, exact_integer_products: bool = False,
                        optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    """``exact_integer_products``: for a reference. On x86 without VNNI, ONNX Runtime's fast
    uint8 x int8 products (quantize_dynamic's LSTM and MatMul) saturate pairs of terms at int16,
    so its outputs depend on the CPU; this makes it use exact (slower) uint8 x uint8 products.
    ``optimization``: ONNX Runtime's graph optimization level (its default: all)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = optimization
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning intra-op threads would keep both cores busy between ORT runs and starve the TVM
    # runs interleaved with them in one benchmark process.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if exact_integer_products:
        options.add_session_config_entry("session.x64quantprecision", "1")
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own classes (NotImplemented, Fail, ...)
        raise _unavailable(err) from err


def onnxruntime_feeds(inputs: dict[str, np.ndarray]) -> dict:
    """Inputs as OrtValues: ORT's numpy bridge has no bfloat16, so those go in as their bits."""
    feeds = {}
    for name, value in inputs.items():
        value = np.require(value, requirements="C")  # keeps a scalar 0-d (ascontiguousarray: 1-D)
        feeds[name] = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(value.view(np.uint16),
                                                                      onnx.TensorProto.BFLOAT16)
                       if value.dtype == BFLOAT16 else ort.OrtValue.ortvalue_from_numpy(value))
    return feeds


def run_onnxruntime(session, feeds: dict) -> dict[str, np.ndarray]:
    """Outputs by name; a failing run (an op with no kernel at this dtype) is ReferenceUnavailable."""
    names = [output.name for output in session.get_outputs()]
    try:
        values = session.run_with_ort_values(names, feeds)
    except Exception as err:  # ORT raises its own classes
        raise _unavailable(err) from err
    return {name: _to_numpy(value) for name, value in zip(names, values)}


@functools.cache
def _reference_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The thread every reference runs on. ONNX Runtime's AMX integer products (MLAS) load the
    tile configuration once per thread and take it to hold from then on: AMX code that changed
    it on that thread since makes the next MLAS product die of SIGILL. Our kernels put it back
    (``passes/restore_tile_config.py``); the reference, which judges them, runs where no artifact
    ever ran all the same, so that it cannot depend on that."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onnxruntime-reference")


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int = 1):
    session = onnxruntime_session(model, threads, exact_integer_products=True)
    return _reference_thread().submit(run_onnxruntime, session, onnxruntime_feeds(inputs)).result()


def reference_variants(model: onnx.ModelProto, inputs: dict[str, np.ndarray],
                       threads: int = 1) -> dict[str, dict[str, np.ndarray]]:
    """The reference's outputs under each of REFERENCE_VARIANTS, by variant name: what ONNX
    Runtime itself gives when only its rounding noise changes. A rewrite that leaves the model as
    it is (nothing to nudge) is not run."""
    feeds, runs = onnxruntime_feeds(inputs), {}
    for name, (level, count, rewrite) in REFERENCE_VARIANTS.items():
        variant = rewrite(model) if rewrite else model
        if rewrite and variant is model:
            continue
        try:
            session = onnxruntime_session(variant, count(threads), exact_integer_products=True, optimization=level)
            runs[name] = _reference_thread().submit(run_onnxruntime, session, feeds).result()
        except ReferenceUnavailable:  # no spread from a configuration ONNX Runtime cannot run
            continue
    return runs


def _to_numpy(value) -> np.ndarray:
    """OrtValue.numpy() refuses bfloat16: copy its 16-bit words out and view them as bfloat16."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    shape = value.shape()
    count = int(np.prod(shape))
    if count == 0:
        return np.zeros(shape, BFLOAT16)
    words = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(words).copy().view(BFLOAT16).reshape(shape)


def _unavailable(err: Exception) -> ReferenceUnavailable:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return ReferenceUnavailable(f"ONNX Runtime cannot run the model, so there is no reference to verify "
                                f"against: {lines[0] if lines else type(err).__name__}",
                                "compile still builds such a model, marked NOT VERIFIED; "
                                "`tvm-fusion run ARTIFACT --repeat N` times it without ONNX Runtime")


def compare_outputs(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                    rtol: float, atol: float) -> list[OutputComparison]:
    """Per output: max abs and max rel error, and whether |a-e| <= atol + rtol*|e| everywhere."""
    results = []
    for name, reference in expected.items():
        value = actual.get(name)
        if value is None:
            results.append(OutputComparison(name, float("inf"), float("inf"), False, "missing"))
            continue
        if value.shape != reference.shape:
            results.append(OutputComparison(name, float("inf"), float("inf"), False,
                                            f"shape {value.shape} != {reference.shape}"))
            continue
        finite = _finite_differences(value, reference)
        if finite is None:
            results.append(OutputComparison(name, float("inf"), float("inf"), False, "non-finite values differ"))
            continue
        diff, a, e = finite
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(e), 1e-12)).max()) if diff.size else 0.0
        allowed = atol + rtol * np.abs(e)
        outside = diff > allowed
        ok = not bool(outside.any())
        note = ""
        if not ok:
            worst = int(np.argmax(diff - allowed))
            note = (f"{int(outside.sum())} of {diff.size} elements outside; worst: tvm_fusion "
                    f"{a[worst]:.6g}, ONNX Runtime {e[worst]:.6g}")
        results.append(OutputComparison(name, max_abs, max_rel, ok, note))
    return results


def _finite_differences(actual: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(|a - e|, a, e) in float64 over the elements finite on both sides; None where the others
    differ (where either side is inf or nan, both must hold the same value: +inf != -inf, nan == nan)."""
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    both = np.isfinite(a) & np.isfinite(e)
    if not np.array_equal(a[~both], e[~both], equal_nan=True):
        return None
    return np.abs(a[both] - e[both]), a[both], e[both]


def _multiples(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> np.ndarray | None:
    """Per finite element, ``|actual - expected| / (atol + rtol * |expected|)`` (over 1: outside
    the tolerance); None where the shapes or the non-finite values differ."""
    finite = _finite_differences(actual, expected) if actual.shape == expected.shape else None
    if finite is None:
        return None
    diff, _, e = finite
    allowed = atol + rtol * np.abs(e)
    with np.errstate(divide="ignore", invalid="ignore"):  # allowed 0 (atol 0, e 0) and diff > 0: inf
        return np.where(diff > 0, diff / allowed, 0.0)


def tolerance_multiple(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> float:
    """The worst ``|actual - expected| / (atol + rtol * |expected|)``: at most 1 is within the
    tolerance. Infinite where the shapes or the non-finite values differ."""
    multiples = _multiples(actual, expected, rtol, atol)
    return float("inf") if multiples is None else float(multiples.max()) if multiples.size else 0.0


def judge_conditioning(results: list[OutputComparison], actual: dict[str, np.ndarray],
                       expected: dict[str, np.ndarray], variants: Callable[[], dict[str, dict[str, np.ndarray]]],
                       rtol: float, atol: float) -> list[OutputComparison]:
    """Each output outside the tolerance gets ONNX Runtime's own spread on it (``variants()``:
    the reference's outputs under REFERENCE_VARIANTS, run only when some output needs them).
    Where the spread exceeds the tolerance the output is ill-conditioned and passes within
    SPREAD_MULTIPLE times it; an output missing, of another shape or with other non-finite
    values never does."""
    def ours(r: OutputComparison) -> float | None:
        multiple = tolerance_multiple(actual[r.name], expected[r.name], rtol, atol) if r.name in actual else None
        return None if multiple in (None, float("inf")) else multiple

    def measure(values: np.ndarray, reference: np.ndarray) -> tuple[float, int] | None:
        multiples = _multiples(values, reference, rtol, atol)
        return None if multiples is None else (float(multiples.max()) if multiples.size else 0.0,
                                               int((multiples > 1).sum()))

    return judge_by_spread(results, expected, variants, ours, measure)


Judged = TypeVar("Judged", bound=OutputComparison)


def judge_by_spread(results: Sequence[Judged], expected: dict[str, np.ndarray],
                    variants: Callable[[], dict[str, dict[str, np.ndarray]]], ours: Callable[[Judged], float | None],
                    measure: Callable[[np.ndarray, np.ndarray], tuple[float, int] | None]) -> list[Judged]:
    """``results`` with ONNX Runtime's own spread on each output outside its rule, in that rule's
    multiples: ``ours(r)`` is our multiple (None: the spread cannot excuse this output),
    ``measure(values, reference)`` a variant's multiple and its elements outside (None: not
    comparable). Over 1 the output is ill-conditioned, and passes within SPREAD_MULTIPLE times it."""
    judged, runs = [], None
    for r in results:
        mine = None if r.within_tolerance else ours(r)
        if mine is None:
            judged.append(r)
            continue
        runs = variants() if runs is None else runs
        spreads = [(*found, name) for name, outputs in runs.items() if r.name in outputs
                   for found in [measure(outputs[r.name], expected[r.name])] if found is not None]
        if not spreads:
            judged.append(r)
            continue
        multiple, outside, name = max(spreads)
        diff, _, _ = _finite_differences(runs[name][r.name], expected[r.name])  # not None: measure took it
        max_abs = float(diff.max()) if diff.size else 0.0
        allowed = SPREAD_MULTIPLE * multiple if multiple > 1.0 else 1.0
        judged.append(dataclasses.replace(r, reference_spread=ReferenceSpread(name, max_abs, multiple, outside,
                                                                              mine, allowed)))
    return judged


def _verdict(r: OutputComparison) -> str:
    spread = r.reference_spread
    if spread is None:
        return f"{'ok' if r.within_tolerance else 'MISMATCH'} {r.note}"
    if spread.accepted:
        return f"ok, ILL-CONDITIONED: {r.note}; {spread.summary()}"
    return f"MISMATCH {r.note}; {spread.summary()}"


def format_comparisons(results: list[OutputComparison], rtol: float, atol: float) -> str:
    """The table, then the rule: an output is ok when every element is within atol + rtol * |reference|
    (so a max rel err above rtol is fine where the reference is near zero); where ONNX Runtime's
    own spread was measured, the rule for ill-conditioned outputs too."""
    lines = [f"{'output':<24} {'max abs err':>12} {'max rel err':>12}  result (rtol={rtol:g}, atol={atol:g})"]
    for r in results:
        lines.append(f"{r.name:<24} {r.max_abs:>12.3e} {r.max_rel:>12.3e}  {_verdict(r)}".rstrip())
    lines.append(f"ok: every element has |tvm_fusion - ONNX Runtime| <= atol + rtol * |ONNX Runtime| "
                 f"(= {atol:g} + {rtol:g} * |ONNX Runtime|)")
    if any(r.reference_spread is not None for r in results):
        lines.append(f"ill-conditioned: ONNX Runtime rerun with {' / '.join(REFERENCE_VARIANTS)} is itself "
                     f"outside that tolerance; then ok within {SPREAD_MULTIPLE:g}x its own worst difference "
                     f"(in multiples of atol + rtol * |ONNX Runtime|)")
    return "\n".join(lines)


def ill_conditioned(results: Sequence[OutputComparison]) -> list[OutputComparison]:
    """The outputs that passed only as ill-conditioned."""
    return [r for r in results if not r.within_tolerance and r.passed]


def check_outputs(results: list[OutputComparison], rtol: float, atol: float, at: str = "") -> None:
    """``at``: where a range was run (`` at sequence=512``), for the message."""
    if not all(r.passed for r in results):
        raise VerificationError(
            f"the compiled module disagrees with ONNX Runtime{at}:\n" + format_comparisons(results, rtol, atol),
            "no artifact was written; report the model, or loosen [verify] rtol/atol in the config "
            "if the difference is acceptable, or pass --no-verify")
