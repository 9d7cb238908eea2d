"""Compare a compiled module with ONNX Runtime on the same seeded inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from .errors import VerificationError


@dataclasses.dataclass
class OutputComparison:
    name: str
    max_abs: float
    max_rel: float
    within_tolerance: bool
    note: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def onnxruntime_session(model: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning intra-op threads would keep both cores busy between ORT runs and starve the TVM
    # runs interleaved with them in one benchmark process.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int = 1):
    session = onnxruntime_session(model, threads)
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


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
        a, e = value.astype(np.float64), reference.astype(np.float64)
        both = np.isfinite(a) & np.isfinite(e)
        # Where either side is inf or nan, both must hold the same value (+inf != -inf, nan == nan).
        finite = bool(np.array_equal(a[~both], e[~both], equal_nan=True))
        diff, e = np.abs(a[both] - e[both]), e[both]
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(e), 1e-12)).max()) if diff.size else 0.0
        if not finite:
            max_abs = max_rel = float("inf")
        ok = finite and bool(np.all(diff <= atol + rtol * np.abs(e)))
        results.append(OutputComparison(name, max_abs, max_rel, ok, "" if finite else "non-finite values differ"))
    return results


def format_comparisons(results: list[OutputComparison], rtol: float, atol: float) -> str:
    lines = [f"{'output':<24} {'max abs err':>12} {'max rel err':>12}  result (rtol={rtol:g}, atol={atol:g})"]
    for r in results:
        verdict = "ok" if r.within_tolerance else "MISMATCH"
        lines.append(f"{r.name:<24} {r.max_abs:>12.3e} {r.max_rel:>12.3e}  {verdict} {r.note}".rstrip())
    return "\n".join(lines)


def check_outputs(results: list[OutputComparison], rtol: float, atol: float) -> None:
    if not all(r.within_tolerance for r in results):
        raise VerificationError(
            "the compiled module disagrees with ONNX Runtime:\n" + format_comparisons(results, rtol, atol),
            "no artifact was written; report the model, or loosen [verify] rtol/atol in the config "
            "if the difference is acceptable, or pass --no-verify")
