"""compile's ``--precision int8`` for a float model: ONNX Runtime quantizes it to int8 QDQ
(``frontend/static_quantization.py``), and that QDQ model is what is compiled, verified against
ONNX Runtime on the same QDQ graph, and kept beside the artifacts (``<model>.int8.onnx``: what
the artifacts' ``built_from`` names, and what ``bench <artifact>`` times ONNX Runtime's int8
kernels on).

Verification says the int8 build computes the QDQ graph right; it cannot say what int8 costs
in accuracy. So the artifact's outputs are also set against ONNX Runtime float32 on the float
model, on the same inputs, and reported (max abs, max rel, cosine, and top-1 agreement for a
classifier-like output): reported, not gated, as int8's error is the user's call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..accuracy.bf16_gate import classifier_outputs
from ..accuracy.output_error import cosine_similarity, max_abs_error, max_rel_error, top1_agreement
from ..config import PipelineConfig
from ..errors import ConfigError
from ..files import sha256_of, write_file
from ..frontend.dims import ranges_of
from ..frontend.static_quantization import QUANTIZER, RANDOM_SAMPLES, calibration_samples, quantize_to_qdq
from ..preparation import Progress, ShapeArg, prepare
from ..verify import reference_outputs


@dataclasses.dataclass
class Int8Model:
    """The QDQ model compiled in the float model's place, and how it was made."""

    path: Path
    float_path: Path
    float_model: object  # the float model (static shapes, simplified): the accuracy reference
    calibration: str

    def to_json(self) -> dict:
        return {"quantizer": QUANTIZER, "calibration": self.calibration, "quantized_model": str(self.path),
                "float_model": str(self.float_path), "float_model_sha256": sha256_of(self.float_path)}


def quantize_for_int8(model_path: str | Path, cfg: PipelineConfig, input_shapes: ShapeArg,
                      calibration: str | Path | None, output_dir: str | Path, progress: Progress) -> Int8Model:
    """The float model at ``model_path`` quantized to int8 QDQ at its compile shapes, written to
    ``<output_dir>/<model>.int8.onnx``."""
    if cfg.precision != "float32":
        raise ConfigError(f"--precision int8 with config {cfg.name} at precision {cfg.precision}",
                          'int8 quantizes the float model: give a config at precision "float32"')
    prepared = prepare(model_path, cfg, input_shapes, progress)
    ranges = ranges_of(prepared.inputs)
    if ranges:
        raise ConfigError(f"--precision int8 needs static input shapes; {', '.join(ranges)} is a range",
                          "give each input one size with --input-shape (the quantized model is made at it)")
    model = prepared.simplified_with_weights()
    samples = calibration_samples(model, prepared.inputs, calibration, cfg.seed)
    if calibration is None:
        text = f"{RANDOM_SAMPLES} seeded random inputs (seed {cfg.seed})"
        progress(f"WARNING: --precision int8 without --calibration: the activation ranges are fitted to "
                 f"{text}, not to your data; accuracy on real inputs can be far worse than reported here. "
                 "Pass --calibration DIR with .npz samples of real inputs")
    else:
        text = f"{len(samples)} samples from {calibration}"
    output = Path(output_dir) / f"{prepared.name}.int8.onnx"
    progress(f"quantizing to int8 QDQ with ONNX Runtime's quantize_static on {text}")
    # staged beside it: a full disk or a read-only folder is an ArtifactError, and leaves no half model
    write_file(output, lambda staging: quantize_to_qdq(model, staging, samples), "the int8 model", "--output-dir")
    progress(f"wrote {output}")
    return Int8Model(output, Path(model_path), model, text)


def accuracy_against_float(int8: Int8Model, outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                           threads: int) -> list[dict]:
    """Per output, the int8 artifact's ``outputs`` against ONNX Runtime float32 on the float
    model for the same ``inputs``."""
    expected = reference_outputs(int8.float_model, inputs, threads)
    classifiers = classifier_outputs(int8.float_model)
    rows = []
    for name, ours in outputs.items():
        reference = expected[name]
        row = {"output": name, "max_abs_error": max_abs_error(ours, reference),
               "max_rel_error": max_rel_error(ours, reference), "cosine_similarity": cosine_similarity(ours, reference)}
        if name in classifiers and reference.ndim >= 1 and reference.shape[-1] >= 2:
            row["top1_agreement"] = top1_agreement(ours, reference)
        rows.append(row)
    return rows


def format_accuracy(rows: list[dict]) -> str:
    """The table compile prints."""
    lines = ["int8 against ONNX Runtime float32 on the float model (reported, not gated):",
             f"{'output':<24} {'max abs err':>12} {'max rel err':>12} {'cosine':>10} {'top-1':>7}"]
    for row in rows:
        top1 = f"{row['top1_agreement']:.3f}" if "top1_agreement" in row else "-"
        lines.append(f"{row['output']:<24} {row['max_abs_error']:>12.3e} {row['max_rel_error']:>12.3e} "
                     f"{row['cosine_similarity']:>10.6f} {top1:>7}")
    return "\n".join(lines)
