"""A float model quantized to int8 QDQ by ONNX Runtime's own quantizer (``--precision int8``, and
the zoo's quantized versions of its float models).

We do not write a quantizer: ``onnxruntime.quantization.quantize_static`` picks the ranges, and
the QDQ graph it writes is what the import already runs on int8 kernels (``qdq_fusion.py``,
``integer_matmul.py``) and verifies against ONNX Runtime. Its settings are ONNX Runtime's
recommended CPU ones: per-channel symmetric int8 weights, asymmetric uint8 activations, MinMax
ranges over the calibration samples, after ONNX Runtime's pre-processing (shape inference and
graph optimization). Only MatMul, Gemm and Conv by a constant weight are quantized: LayerNorm,
softmax, GELU, residual adds and attention's products of two activations stay float, where our
patterns fuse them as in the float model (quantized, each would be a fake-quantized island
that no pattern matches, and far less accurate: a transformer quantized whole lost most of
its cosine similarity to the float model).

Calibration samples come from a folder (``--calibration``): each ``.npz`` holds one sample, an
array per float input by name; a ``.npy`` is one sample of a model with one float input. Without
a folder, seeded random inputs stand in, and the caller must say loudly that the ranges then fit
noise, not the user's data.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter

from ..errors import ModelError
from .input_binding import FLOAT_DTYPES, TensorSpec
from .sample_inputs import random_inputs

QUANTIZER = ("onnxruntime.quantization.quantize_static (QDQ, per-channel int8 weights, uint8 activations, "
             "MinMax; MatMul, Gemm and Conv by constant weights)")
# The ops quantized: those with a constant weight, where int8 kernels read a quarter of the bytes.
QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")
RANDOM_SAMPLES = 8  # seeded random calibration samples when no folder is given


def calibration_samples(model: onnx.ModelProto, inputs: list[TensorSpec], folder: str | Path | None,
                        seed: int, count: int = RANDOM_SAMPLES) -> list[dict[str, np.ndarray]]:
    """The samples to calibrate ``model`` on at the static ``inputs``: read from ``folder``, or
    ``count`` seeded random ones (None). Each sample holds every input: a non-float input (token
    ids, a mask) that a sample file leaves out takes seeded random valid values."""
    if folder is None:
        return [random_inputs(model, inputs, seed + i) for i in range(count)]
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"calibration folder {folder} does not exist",
                         "pass --calibration a folder of .npz (one array per input name) or .npy samples")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".npz", ".npy"))
    if not files:
        raise ModelError(f"calibration folder {folder} holds no .npz or .npy file",
                         "save each sample with numpy.savez(path, **{input_name: array}), or numpy.save for "
                         "a model with one input")
    floats = [spec for spec in inputs if spec.dtype in FLOAT_DTYPES and spec.value is None]
    return [_sample(path, inputs, floats, random_inputs(model, inputs, seed + i)) for i, path in enumerate(files)]


def _sample(path: Path, inputs: list[TensorSpec], floats: list[TensorSpec],
            defaults: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One calibration sample from ``path``, checked against the model's inputs."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ModelError(f"calibration sample {path} cannot be read: {err}",
                         "write samples with numpy.savez / numpy.save") from err
    if path.suffix == ".npy":
        if len(floats) != 1:
            raise ModelError(f"calibration sample {path} is one array, but the model has {len(floats)} float inputs "
                             f"({', '.join(s.name for s in floats)})",
                             "save each sample as .npz with one array per input name")
        arrays = {floats[0].name: loaded}
    else:
        with loaded:
            arrays = {name: loaded[name] for name in loaded.files}
    known = {spec.name: spec for spec in inputs}
    unknown = sorted(set(arrays) - set(known))
    if unknown:
        raise ModelError(f"calibration sample {path} has arrays {unknown} that are no inputs of the model",
                         f"its inputs: {', '.join(known)}")
    sample = dict(defaults)
    for spec in floats:
        if spec.name not in arrays:
            raise ModelError(f"calibration sample {path} has no array for input {spec.name!r}",
                             f"save every float input: {', '.join(s.name for s in floats)}")
    for name, array in arrays.items():
        spec = known[name]
        if tuple(array.shape) != tuple(spec.shape):
            raise ModelError(f"calibration sample {path}: input {name!r} has shape {list(array.shape)}, the model is "
                             f"compiled at {list(spec.shape)}",
                             "save samples at the shapes given with --input-shape")
        sample[name] = array.astype(spec.dtype)
    return sample


def quantize_to_qdq(source: onnx.ModelProto, output: str | Path, samples: list[dict[str, np.ndarray]]) -> Path:
    """``source`` (a model with static shapes: ONNX Runtime's symbolic shape inference gives up
    on symbolic ones) quantized to int8 QDQ by ONNX Runtime, calibrated on ``samples``, written
    to ``output`` whole or not at all (temp file, then rename)."""
    # deferred: its import loads ONNX Runtime's quantization tools, which only this path uses
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quant_pre_process,
                                          quantize_static)

    class Samples(CalibrationDataReader):
        def __init__(self):
            self.remaining = iter(samples)

        def get_next(self):
            return next(self.remaining, None)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    source, per_channel = _with_channel_axes(source)
    with tempfile.TemporaryDirectory(prefix=".quantize.", dir=output.parent) as work:
        given = Path(work) / "float.onnx"
        onnx.save(source, str(given))
        prepared = Path(work) / "prepared.onnx"
        try:
            # ONNX shape inference only: the shapes are static, and the symbolic one, when it gives
            # up, saves its half-inferred model into the working directory
            quant_pre_process(str(given), str(prepared), skip_symbolic_shape=True)
        except Exception:  # noqa: BLE001 - its shape inference rejects some graphs: quantize the graph as given
            prepared = given
        named = Path(work) / "named.onnx"
        nodes = _name_weighted_products(str(prepared), named)
        staged = Path(work) / "quantized.onnx"
        try:
            quantize_static(str(named), str(staged), Samples(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_quantize=nodes,
                            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})
        except OSError:
            raise  # a full disk, a read-only folder: not the model's fault (the caller's write_file says so)
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's quantizer raises many kinds
            raise ModelError(f"ONNX Runtime's quantize_static failed: {type(err).__name__}: {err}",
                             "compile the float model (--precision float32 or bf16), or quantize it yourself "
                             "and compile the QDQ model") from err
        os.replace(staged, output)
    return output


def _with_channel_axes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """``model`` at opset 13 or later, where DequantizeLinear takes the ``axis`` of per-channel
    weights (ONNX Runtime's quantizer writes it at any opset, and onnx's checker then refuses the
    model), and whether its weights can be quantized per channel: not where the opset converter
    cannot lift the model (then one scale per weight)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset >= 13:
        return model, True
    try:
        return onnx.version_converter.convert_version(model, 13), True
    except Exception:  # noqa: BLE001 - the converter raises many kinds, for ops it cannot lift
        return model, False


def _name_weighted_products(source: str, output: Path) -> list[str]:
    """Save ``source`` to ``output`` with every node named, and return the names of its
    ``QUANTIZED_OPS`` nodes whose weight (second input) is an initializer."""
    model = onnx.load(source)
    constants = {init.name for init in model.graph.initializer}
    names = {node.name for node in model.graph.node if node.name}
    chosen = []
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = next(f"{node.op_type}_{index}_{n}" for n in range(len(names) + 1)
                             if f"{node.op_type}_{index}_{n}" not in names)
            names.add(node.name)
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[1] in constants:
            chosen.append(node.name)
    onnx.save(model, str(output))
    return chosen
