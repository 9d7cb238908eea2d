"""Standard ONNX ops as the fused-graph check runs them (``registry.evaluator``).

Two jobs, both about onnx.reference's own implementations of standard ops: running one op
on its own where a fused op is made of it and numpy has no one-liner (Conv, ConvTranspose,
Resize: ``standard``, ``resize``), and replacing the ones that depart from ONNX Runtime, so
that a mismatch under ``inspect --onnx --check`` is ours and not the reference's
(``STANDARD_FIXES``, passed to every evaluator that runs an original or fused graph).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.ops.op_batch_normalization import BatchNormalization_14

# The standard-op implementations used inside fused ops (Conv, ConvTranspose, Resize).
STANDARD_OPSET = 21

RESIZE_ATTRIBUTES = ("antialias", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                     "extrapolation_value", "keep_aspect_ratio_policy", "mode", "nearest_mode")


@functools.lru_cache(maxsize=None)
def _standard_evaluator(op_type: str, inputs: tuple[bool, ...], attributes: tuple) -> ReferenceEvaluator:
    names = [f"in{i}" if present else "" for i, present in enumerate(inputs)]
    node = helper.make_node(op_type, names, ["out"], **dict(attributes))
    graph = helper.make_graph(
        [node], op_type, [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in names if n],
        [helper.make_tensor_value_info("out", TensorProto.UNDEFINED, None)])
    return ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", STANDARD_OPSET)]))


def standard(op_type: str, *inputs, **attributes) -> np.ndarray:
    """One standard ONNX op (None for an absent optional input; None attributes left out)."""
    kept = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in attributes.items() if v is not None))
    evaluator = _standard_evaluator(op_type, tuple(i is not None for i in inputs), kept)
    feeds = {f"in{i}": value for i, value in enumerate(inputs) if value is not None}
    return evaluator.run(None, feeds)[0]


def resize(x: np.ndarray, scales, attributes: dict) -> np.ndarray:
    """ONNX Resize of x by ``scales``; ``attributes`` holds Resize's attributes prefixed ``resize_``."""
    options = {name: attributes.get(f"resize_{name}") for name in RESIZE_ATTRIBUTES}
    return standard("Resize", x, None, np.asarray(scales, np.float32), **options)


class BatchNormalization(BatchNormalization_14):
    """BatchNormalization of every opset, in inference form unless ``training_mode`` is 1 (opset 14+).

    onnx.reference runs a node of opset 9-13 in training mode (batch statistics) whenever it
    has a ``momentum`` attribute, which paddle2onnx writes on every node (PP-OCRv4's detector);
    those opsets have no training mode, and ONNX Runtime computes the inference form.
    """

    op_domain = ""
    op_schema = None  # the node's own attributes only: opset 6/7's is_test and spatial go to **_older

    def _run(self, x, scale, bias, mean, var, epsilon=1e-5, momentum=0.9, training_mode=0, **_older):
        return super()._run(x, scale, bias, mean, var, epsilon=epsilon, momentum=momentum,
                            training_mode=training_mode)


STANDARD_FIXES = [BatchNormalization]


def standard_evaluator(model: onnx.ModelProto) -> ReferenceEvaluator:
    """A ReferenceEvaluator for a graph of standard ops (the model before fusion), with ``STANDARD_FIXES``."""
    return ReferenceEvaluator(model, new_ops=STANDARD_FIXES)
