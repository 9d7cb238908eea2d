"""TVM's ONNX importer, with our converters for the ops it gets wrong.

* Dropout: TVM ignores ``training_mode`` and imports every Dropout as inference (identity),
  and types its mask like the data. Training mode (a constant true ``training_mode``) becomes
  the counter-based ``dropout_training`` kernel; inference keeps TVM's ``nn.dropout`` (the
  ``dropout`` pattern removes it) with a boolean mask, as ONNX specifies.
* EyeLike: TVM rejects a ``dtype`` attribute that differs from the input's (ONNX allows it),
  names no node when the input is not 2-D, and its ``eye_like`` is constant-folded into a
  stored n x m tensor. Ours is a kernel on the input (see ``patterns/eye_like_add.py``).
* Upsample (opsets 7-9, written by older exporters for FPN/YOLO necks): TVM rounds the
  nearest source pixel (ONNX says floor: its output differs from ONNX Runtime's) and fails to
  import opset 9, where the scales are an input. Ours is ``resize2d`` with Upsample's
  asymmetric coordinates and floor.
* LSTM, GRU: TVM has no converter (CRNN OCR recognizers use them); ours are in ``recurrent.py``.

Everything else goes to TVM's own converters.
"""

from __future__ import annotations

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, get_constant, get_type

from ..errors import ModelError
from ..patterns.dropout_training import emit_dropout_training
from ..patterns.eye_like_add import emit_eye_like
from .recurrent import convert_gru, convert_lstm

_DEFAULT_RATIO = 0.5
# Ops converted only here: TVM's importer (and its unsupported-op check) does not know them.
OWN_OPS = frozenset({"LSTM", "GRU"})


class Importer(ONNXGraphImporter):
    """``ONNXGraphImporter`` that tries our converters first; None from one means "TVM's"."""

    def __init__(self, shape_dict, dtype_dict):
        super().__init__(shape_dict, dtype_dict)
        self._dropouts_without_seed = 0

    def _convert_operator(self, op_name, inputs, attrs, opset):
        convert = {"Dropout": self._dropout, "EyeLike": self._eye_like,
                   "Upsample": self._upsample, "LSTM": self._recurrent(convert_lstm),
                   "GRU": self._recurrent(convert_gru)}.get(op_name)
        converted = convert(inputs, attrs, opset) if convert is not None else None
        if converted is None:
            return super()._convert_operator(op_name, inputs, attrs, opset)
        return self.bb.normalize(converted)

    def _check_for_unsupported_ops(self, graph):
        """TVM's check would refuse the ops only we convert; ours counts them."""
        from .onnx import unsupported_ops, unsupported_ops_message

        missing = unsupported_ops(graph)
        if missing:
            raise ModelError(*unsupported_ops_message(missing))

    def _recurrent(self, convert):
        def run(inputs, attrs, _opset):
            return convert(self.bb, inputs, attrs, lambda e: get_constant(e, [self._nodes, self._params]))

        return run

    def _dropout(self, inputs, attrs, opset):
        if opset < 12 or len(inputs) < 3 or inputs[2] is None:
            return self._inference_dropout(inputs, attrs, opset)
        name = attrs["tvm_custom"]["name"] or "(unnamed)"
        training = get_constant(inputs[2], [self._nodes, self._params])
        if not isinstance(training, tvm.ir.GenericConst):
            raise ModelError(f"Dropout node {name!r}: training_mode is computed at run time",
                             "make training_mode a constant (an initializer) of the mode you "
                             "compile for; a compiled model runs one mode")
        if not bool(training.value.numpy()):
            return self._inference_dropout(inputs, attrs, opset)
        ratio = inputs[1] if len(inputs) > 1 and inputs[1] is not None else relax.const(_DEFAULT_RATIO)
        ratio = get_constant(ratio, [self._nodes, self._params])
        if ratio.ty.ndim != 0:  # some exporters write the scalar as a 1-element tensor
            ratio = self.bb.emit(relax.op.reshape(ratio, ()))
        if ratio.ty.dtype != "float32":
            ratio = self.bb.emit(relax.op.astype(ratio, "float32"))
        seed = attrs.get("seed")
        if seed is None:
            # ONNX leaves the seed to the runtime. Numbering unseeded Dropouts keeps builds
            # reproducible and gives each node its own mask.
            seed = self._dropouts_without_seed
            self._dropouts_without_seed += 1
        return emit_dropout_training(self.bb, inputs[0], ratio, int(seed))

    def _inference_dropout(self, inputs, attrs, opset):
        """TVM's identity ``nn.dropout``; the mask output, when there is one, all true (bool)."""
        if attrs["tvm_custom"]["num_outputs"] < 2:
            return None
        values = self.bb.emit(relax.TupleGetItem(
            super()._convert_operator("Dropout", inputs, attrs, opset), 0))
        return relax.Tuple([values, relax.op.ones_like(inputs[0], "bool")])

    def _eye_like(self, inputs, attrs, _opset):
        x = inputs[0]
        name = attrs["tvm_custom"]["name"] or "(unnamed)"
        if x.ty.ndim != 2:
            raise ModelError(f"EyeLike node {name!r}: its input has rank {x.ty.ndim}; "
                             "EyeLike takes a 2-D tensor", "fix the model (ONNX requires 2-D)")
        dtype = get_type(attrs["dtype"]) if "dtype" in attrs else x.ty.dtype
        return emit_eye_like(self.bb, x, int(attrs.get("k", 0)), dtype)


    def _upsample(self, inputs, attrs, opset):
        """NCHW Upsample with per-axis scales (1, 1, sh, sw) as ``resize2d``; anything else
        goes to TVM's converter (which then names what it does not support)."""
        x = inputs[0]
        if opset >= 9:
            scales = get_constant(inputs[1], [self._nodes, self._params]) if len(inputs) > 1 else None
            if not isinstance(scales, tvm.ir.GenericConst):
                return None
            scales = [float(v) for v in scales.value.numpy().reshape(-1)]
        else:
            scales = [float(v) for v in attrs.get("scales", ())]
        shape = [int(d) for d in x.ty.shape] if all(
            isinstance(d, tvm.tirx.IntImm) for d in getattr(x.ty, "shape", None) or ()) else None
        if shape is None or len(shape) != 4 or len(scales) != 4 or scales[:2] != [1.0, 1.0]:
            return None
        mode = attrs.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        method = {"nearest": "nearest_neighbor", "linear": "linear", "bilinear": "linear"}.get(mode)
        if method is None:
            return None
        size = [int(dim * scale) for dim, scale in zip(shape[2:], scales[2:])]  # ONNX: floor
        return relax.op.image.resize2d(x, size, layout="NCHW", method=method,
                                       coordinate_transformation_mode="asymmetric",
                                       rounding_method="floor")


def from_onnx(model: onnx.ModelProto, shape_dict: dict[str, list], dtype_dict: dict[str, str]):
    """``tvm.relax.frontend.onnx.from_onnx`` (default-domain opset, checked model) with our converters."""
    opset = next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), 1)
    return Importer(shape_dict, dtype_dict).from_onnx(model.graph, opset)
