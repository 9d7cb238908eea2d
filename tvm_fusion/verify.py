"""Compare a compiled module with ONNX Runtime on the same seeded inputs."""

from __future__ import annotations

import ctypes
import dataclasses

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from .errors import VerificationError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


class ReferenceUnavailable(VerificationError):
    """ONNX Runtime cannot run the model (no CPU kernel for an op at its dtype, say): no reference."""


@dataclasses.dataclass
class OutputComparison:
    name: str
    max_abs: float
    max_rel: float
    within_tolerance: bool
    note: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def onnxruntime_session(model: onnx.ModelProto, threads: int, exact_integer_products: bool = False):
    """``exact_integer_products``: for a reference. On x86 without VNNI, ONNX Runtime's fast
    uint8 x int8 products (quantize_dynamic's LSTM and MatMul) saturate pairs of terms at int16,
    so its outputs depend on the CPU; this makes it use exact (slower) uint8 x uint8 products."""
    options = ort.SessionOptions()
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


def reference_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray], threads: int = 1):
    return run_onnxruntime(onnxruntime_session(model, threads, exact_integer_products=True),
                           onnxruntime_feeds(inputs))


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
        a, e = value.astype(np.float64), reference.astype(np.float64)
        both = np.isfinite(a) & np.isfinite(e)
        # Where either side is inf or nan, both must hold the same value (+inf != -inf, nan == nan).
        finite = bool(np.array_equal(a[~both], e[~both], equal_nan=True))
        diff, e = np.abs(a[both] - e[both]), e[both]
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(e), 1e-12)).max()) if diff.size else 0.0
        if not finite:
            max_abs = max_rel = float("inf")
        allowed = atol + rtol * np.abs(e)
        outside = diff > allowed
        ok = finite and not bool(outside.any())
        note = "" if finite else "non-finite values differ"
        if finite and not ok:
            worst = int(np.argmax(diff - allowed))
            note = (f"{int(outside.sum())} of {diff.size} elements outside; worst: tvm_fusion "
                    f"{a[both][worst]:.6g}, ONNX Runtime {e[worst]:.6g}")
        results.append(OutputComparison(name, max_abs, max_rel, ok, note))
    return results


def format_comparisons(results: list[OutputComparison], rtol: float, atol: float) -> str:
    """The table, then the rule: an output is ok when every element is within atol + rtol * |reference|
    (so a max rel err above rtol is fine where the reference is near zero)."""
    lines = [f"{'output':<24} {'max abs err':>12} {'max rel err':>12}  result (rtol={rtol:g}, atol={atol:g})"]
    for r in results:
        verdict = "ok" if r.within_tolerance else "MISMATCH"
        lines.append(f"{r.name:<24} {r.max_abs:>12.3e} {r.max_rel:>12.3e}  {verdict} {r.note}".rstrip())
    lines.append(f"ok: every element has |tvm_fusion - ONNX Runtime| <= atol + rtol * |ONNX Runtime| "
                 f"(= {atol:g} + {rtol:g} * |ONNX Runtime|)")
    return "\n".join(lines)


def check_outputs(results: list[OutputComparison], rtol: float, atol: float, at: str = "") -> None:
    """``at``: where a range was run (`` at sequence=512``), for the message."""
    if not all(r.within_tolerance for r in results):
        raise VerificationError(
            f"the compiled module disagrees with ONNX Runtime{at}:\n" + format_comparisons(results, rtol, atol),
            "no artifact was written; report the model, or loosen [verify] rtol/atol in the config "
            "if the difference is acceptable, or pass --no-verify")
