"""``--check``: the fused file under onnx.reference (our ops' numpy definitions, fusions/)
against the original model under ONNX Runtime, on the same inputs.

Apart from the export so that the file is written first and can be looked at when the check
fails, and so that the sweep over the zoo (scripts/check_fused_onnx_zoo.py) runs the same check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..errors import VerificationError
from ..verify import OutputComparison, compare_outputs, format_comparisons, reference_outputs
from .registry import evaluator


def compare_with_onnxruntime(original: onnx.ModelProto, fused: onnx.ModelProto, inputs: dict[str, np.ndarray],
                             rtol: float, atol: float, threads: int = 1) -> list[OutputComparison]:
    """Each output of the fused graph under onnx.reference (our ops' numpy definitions) against
    the original model under ONNX Runtime, on the same inputs."""
    expected = reference_outputs(original, inputs, threads)
    with np.errstate(over="ignore", invalid="ignore"):
        values = evaluator(fused).run(None, inputs)
    actual = {o.name: np.asarray(v) for o, v in zip(fused.graph.output, values)}
    return compare_outputs(actual, expected, rtol, atol)


def check_comparisons(results: list[OutputComparison], path: Path, rtol: float, atol: float) -> None:
    """VerificationError naming the first output outside the tolerances, with the whole table."""
    failed = [r for r in results if not r.within_tolerance]
    if failed:
        raise VerificationError(
            f"the fused ONNX graph {path} disagrees with ONNX Runtime on output {failed[0].name!r}:\n"
            + format_comparisons(results, rtol, atol),
            "a fused op's reference implementation or its export (the op's module in "
            "tvm_fusion/onnx_export/fusions/) is wrong: report the model; [verify] rtol/atol set the tolerances")
